"""What each capture step found: one frozen result per step kind, handed back to the runner
(``mlxwatch.capture.runner``) and read by ``collector`` to assemble the classifier's evidence
and the manifest. A step's defaults are what it found when it found nothing (a step that was
skipped, raised or was cut off at the ceiling), so the evidence reads every result the same way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from mlxwatch.capture.death import Cause
from mlxwatch.capture.delivery import WindowDelivery
from mlxwatch.capture.procstats import ProcessWindow
from mlxwatch.capture.runner import StepResult
from mlxwatch.front.recorder import RecordedRequest
from mlxwatch.host.group import Group, Rank
from mlxwatch.probes import CheckReport
from mlxwatch.serverlog.markers import LogMarkers
from mlxwatch.shim.stacks import ShimWindow
from mlxwatch.stacks import ThreadStack

Snapshot = tuple[float, list[ThreadStack]]  # (seconds into the capture, the threads then)


@dataclass(frozen=True, kw_only=True)
class ProcessResult(StepResult):
    """The target process as ``process.json`` holds it (``describe_process``)."""

    info: dict = field(default_factory=dict)

    @property
    def missing(self) -> bool:
        """No process with that PID (or none was given)."""
        return "process" in self.info.get("errors", {})

    @property
    def create_time(self) -> float | None:
        return self.info.get("create_time")


@dataclass(frozen=True, kw_only=True)
class StacksResult(StepResult):
    """Python stack snapshots (py-spy's or the launch shim's), in the order they were taken.
    ``error`` is also the classifier's ``stacks_error``: why stacks are missing or incomplete."""

    snapshots: tuple[Snapshot, ...] = ()


@dataclass(frozen=True, kw_only=True)
class CpuResult(StepResult):
    """The process's CPU and thread states over the window (``procstats.json``)."""

    window: ProcessWindow = field(default_factory=ProcessWindow)


@dataclass(frozen=True, kw_only=True)
class DeliveryResult(StepResult):
    """What the kernel saw the server send its clients over the window (``kernel.json``)."""

    delivery: WindowDelivery = field(default_factory=WindowDelivery)


@dataclass(frozen=True, kw_only=True)
class RequestsResult(StepResult):
    """The recorded requests written into the bundle's private ``requests/`` (``capture.requests``):
    the front door's when it holds any, else the launch shim's; ``at`` is the monotonic moment
    they are described against (the verdict's, or the capture's start)."""

    recorded: tuple[RecordedRequest, ...] = ()
    at: float | None = None
    source: str | None = None  # "door" | "shim"


@dataclass(frozen=True, kw_only=True)
class ProbeResult(StepResult):
    """The capture's own probe (``probe.json``), and its stream's background drain, if any:
    the caller of ``capture_bundle`` owns that task (``Bundle.lingering``)."""

    report: CheckReport | None = None
    lingering: asyncio.Task | None = None


@dataclass(frozen=True, kw_only=True)
class HeartbeatResult(StepResult):
    """The launch shim's heartbeat over the window; None when the step never read it."""

    window: ShimWindow | None = None


@dataclass(frozen=True, kw_only=True)
class SampleResult(StepResult):
    """macOS ``sample``, read: every thread's heaviest native path (MLX/Metal threads marked)."""

    native_findings: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class VersionsResult(StepResult):
    """``versions.json``: the server's packages and Python, and mlxwatch's."""

    versions: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class LogResult(StepResult):
    """The server log after the window: its markers, and what it gained during the window
    (``gained`` None: the log could not be followed from the window's start) with each
    prompt's last X before it (``before``), for the progress rule."""

    markers: LogMarkers | None = None
    gained: str | None = None
    before: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RankFinding:
    """One rank of a group: its state when captured and its stacks (none for rank 0 here: the
    stacks step takes the target's)."""

    rank: Rank
    snapshots: tuple[Snapshot, ...] = ()
    error: str | None = None


@dataclass(frozen=True, kw_only=True)
class GroupResult(StepResult):
    """Every rank of an ``mlx.launch`` group (``group`` refreshed at the capture); none for a
    single server, or when the step was cut off."""

    group: Group | None = None
    ranks: tuple[RankFinding, ...] = ()


@dataclass(frozen=True, kw_only=True)
class DeathResult(StepResult):
    """Why the gone server died (``death.json``); None when it did not die."""

    cause: Cause | None = None


@dataclass(frozen=True)
class CaptureResults:
    """Every step's result: what the evidence and the manifest are assembled from."""

    process: ProcessResult
    stacks: StacksResult
    cpu: CpuResult
    probe: ProbeResult
    heartbeat: HeartbeatResult
    sample: SampleResult
    versions: VersionsResult
    log: LogResult
    ranks: GroupResult = GroupResult(outcome="skipped")
    delivery: DeliveryResult = DeliveryResult(outcome="skipped")
    death: DeathResult = DeathResult(outcome="skipped")
    requests: RequestsResult = RequestsResult(outcome="skipped")
