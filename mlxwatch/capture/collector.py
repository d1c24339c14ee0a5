"""Capture an evidence bundle from a live (possibly hung) server, within a hard time ceiling.

Each step is a function that returns its typed result (``mlxwatch.capture.results``) to the
step runner (``mlxwatch.capture.runner``), which applies the ceiling, times the step and
records its outcome; none can abort another (a failed step is recorded with its error and the
bundle is still written). The classifier's evidence and the manifest are assembled from those
results. The steps run side by side::

    the window:       stack snapshots (py-spy, at 0, spacing, 2*spacing, ...) | CPU sampling | one probe
    beside it:        macOS sample / spindump / crash reports | versions
    after the window: log tail and markers (what the log says happened *during* the window)
    then:             classification, summary.md, manifest.json, rename into place

The capture's own probe stops waiting for a first token shortly after the stack/CPU window ends
(``PROBE_MARGIN``, never sooner than ``PROBE_FLOOR``): by then its verdict is clear, and a hung
server would otherwise hold the bundle for the whole first-token limit. When the probe supports
lingering, a probe that gave up with its stream still open keeps draining it in the background
so the server can finish (and drop) the generation it started; the capture does not wait for
it and hands it back as ``Bundle.lingering``: the caller awaits or cancels it (``asyncio.run``
cancels it when a CLI capture returns).

Nothing here blocks the event loop it shares with the daemon's other instances: psutil reads,
log reads and scans, bundle writes (each fsynced), crash-report copies and pruning run in worker
threads (``asyncio.to_thread``).

Usage::

    bundle = await capture_bundle(CaptureRequest(pid=1234, out_dir=Path("bundles"), url=url))
    print(bundle.path, bundle.classification.kind)
    if bundle.lingering:
        bundle.lingering.cancel()
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shlex
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypedDict

import httpx

from mlxwatch import __version__, probes, stacks
from mlxwatch.capture import death, macos, pyspy
from mlxwatch.capture.bundle import BundleWriter, adopt_partials, prune
from mlxwatch.capture.delivery import watch_delivery
from mlxwatch.capture.classify import Classification, Evidence, RankEvidence, classify
from mlxwatch.capture.procstats import describe_process, sample_process
from mlxwatch.capture.requests import INDEX as REQUESTS_INDEX
from mlxwatch.capture.requests import from_shim, index_entries, manifest_entry, write_requests
from mlxwatch.capture.redact import (
    NONE,
    PRIVATE,
    redact_bytes,
    redact_json,
    redact_text,
)
from mlxwatch.capture.results import (
    CaptureResults,
    CpuResult,
    DeathResult,
    DeliveryResult,
    GroupResult,
    RankFinding,
    HeartbeatResult,
    LogResult,
    ProbeResult,
    ProcessResult,
    RequestsResult,
    SampleResult,
    Snapshot,
    StacksResult,
    VersionsResult,
)
from mlxwatch.capture.runner import R, StepCallback, StepResult, StepRunner
from mlxwatch.capture.summary import render_summary
from mlxwatch.capture.versions import server_versions
from mlxwatch.config import CaptureConfig, ProbeConfig, url_port
from mlxwatch.errors import ProcessGoneError
from mlxwatch.front.recorder import RecordedRequest
from mlxwatch.host.commands import CommandResult, Runner, run_command
from mlxwatch.host.group import SSH_OPTIONS, Group, Rank, refresh
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.probes import CheckReport
from mlxwatch.serverlog.follow import LogFollower
from mlxwatch.serverlog.markers import (
    RECENT_BYTES,
    LogMarkers,
    completions_ok,
    open_log,
    progress_lines,
    read_recent_across,
    rotated_from,
    scan,
    since_last_start,
    tail_lines,
)
from mlxwatch.shim import stacks as shim_stacks
from mlxwatch.shim.heartbeat import Heartbeat, ShimError
from mlxwatch.shim.stacks import ShimWindow
from mlxwatch.serverlog.markers import prompt_advances

DUMP_TIMEOUT = 10.0
# The stacks step holds the live process to the one the capture recorded, read milliseconds
# apart: a reused PID started after the recorded process ended, by far more than this.
REUSED_PID_SLACK = 1.0
FINISH_RESERVE = 2.0  # seconds of the ceiling kept for classifying and writing
LOG_RESERVE = 2.0  # the log is read at the latest this long before the steps are cut off
PROBE_MARGIN = 1.0  # the capture's probe waits for a first token this long past the window's end
PROBE_FLOOR = 5.0  # ...and never less than this
PROBE_LINGER = 30.0  # how long a given-up probe keeps draining its stream in the background
# The capture's own probe: the instance's timeouts, capped so that it fits the capture window.
PROBE_FIRST_TOKEN_CAP = 10.0
PROBE_TIMEOUT_CAP = 20.0



@dataclass
class CaptureRequest:
    pid: int | None  # None: no server process could be found (it is gone)
    out_dir: Path
    label: str | None = None
    url: str | None = None
    log: Path | None = None
    snapshots: int = CaptureConfig.snapshots
    spacing: float = CaptureConfig.spacing
    ceiling: float = CaptureConfig.ceiling
    sudo: bool = CaptureConfig.sudo
    log_tail_lines: int = CaptureConfig.log_tail_lines
    probe_first_token_timeout: float = PROBE_FIRST_TOKEN_CAP  # an upper bound: the window's end (+ margin) cuts it
    probe_timeout: float = PROBE_TIMEOUT_CAP
    prior_probes: list[dict] = field(default_factory=list)  # the watchdog's failed probes
    front_requests: list[dict] | None = None  # the front door's requests in flight at the verdict (front/requests.json)
    keep: int = CaptureConfig.keep
    max_bytes: int = CaptureConfig.max_bytes
    keep_days: float | None = CaptureConfig.keep_days
    min_free_bytes: int = CaptureConfig.min_free_bytes  # below it: LowDiskSpace, no bundle
    verdict: str | None = None  # the watchdog's reason for judging the server hung; None: manual capture
    probe_linger: float = PROBE_LINGER  # 0: a given-up probe closes its stream at once
    # Python stacks from: auto (the launch shim if present, else py-spy) | pyspy | shim | sample
    stacks: str = CaptureConfig.stacks
    redact: bool = CaptureConfig.redact  # the raw bundle's redaction (redact.PRIVATE); False: complete (NONE)
    group: Group | None = None  # the mlx.launch group whose rank 0 ``pid`` is: every rank is captured
    kernel: bool = True  # read what the server sends its clients over the window (instances[].kernel)
    gone: death.GoneProcess | None = None  # the server last seen, when ``pid`` is None: why it died is asked about it
    # The door's recorded requests up to the verdict (front.record), arrival order, and when
    # they were taken (monotonic): the bundle's private requests/ (capture.requests module).
    recorded: tuple[RecordedRequest, ...] | None = None
    recorded_at: float | None = None

    @property
    def kernel_port(self) -> int | None:
        """The port whose client connections the capture reads; None: it reads none."""
        return url_port(self.url) if self.url is not None and self.kernel else None


class ProbeTimeouts(TypedDict):
    """The CaptureRequest fields ``capture_probe_timeouts`` fills (typed, for ``**`` into it)."""

    probe_first_token_timeout: float
    probe_timeout: float


def capture_probe_timeouts(probe: ProbeConfig) -> ProbeTimeouts:
    """A CaptureRequest's probe limits for an instance probed with ``probe``: its own, capped."""
    return {"probe_first_token_timeout": min(probe.first_token_timeout, PROBE_FIRST_TOKEN_CAP),
            "probe_timeout": min(probe.timeout, PROBE_TIMEOUT_CAP)}


@dataclass
class Bundle:
    path: Path
    classification: Classification
    manifest: dict[str, Any]
    # The capture probe's background drain (see the module docstring), or None. The caller owns
    # it: await it or cancel it before its event loop ends.
    lingering: asyncio.Task | None = None


class _Files:
    """The bundle being written. Every file enters it through the redaction pass at the
    bundle's level, then the write (blocking, so the async forms use a worker thread: a log or
    a spindump can be megabytes)."""

    def __init__(self, writer: BundleWriter, redaction: str) -> None:
        self.writer = writer
        self.redaction = redaction

    def write_blocking(self, relname: str, data: bytes | str) -> None:
        self.writer.write(relname, redact_bytes(relname, data, self.redaction))

    async def write(self, relname: str, data: bytes | str) -> None:
        await asyncio.to_thread(self.write_blocking, relname, data)

    async def write_json(self, relname: str, value: object) -> None:
        text = json.dumps(value, indent=2, sort_keys=True, default=str)  # as BundleWriter.write_json
        await asyncio.to_thread(self.write_blocking, relname, text)


async def capture_bundle(req: CaptureRequest, *, runner: Runner = run_command, on_step: StepCallback | None = None) -> Bundle:
    """Capture, classify and write one bundle. Raises only if the bundle itself cannot be written.

    The returned ``Bundle.lingering`` (if not None) is a task still draining the capture probe's
    stream; the caller awaits or cancels it."""
    began = time.monotonic()  # requests that arrive after this (the capture's own probe) are not its evidence
    steps = StepRunner(deadline=began + req.ceiling - FINISH_RESERVE, ceiling=req.ceiling, on_step=on_step)
    window_seconds = max(0.5, (req.snapshots - 1) * req.spacing + 0.5)
    probe_first_token = min(req.probe_first_token_timeout, max(PROBE_FLOOR, window_seconds + PROBE_MARGIN))
    writer = await asyncio.to_thread(BundleWriter, req.out_dir, req.label or f"pid-{req.pid}", req.min_free_bytes)
    files = _Files(writer, PRIVATE if req.redact else NONE)
    before: asyncio.Future[dict[int, int]] | None = None
    probe_step: asyncio.Future[ProbeResult] | None = None
    try:
        followers = None  # the log (and the file it was last rotated to) followed from the window's start
        if req.log is not None:
            followers = await asyncio.to_thread(_follow_log, req.log)
            if followers is not None:  # what the log said before the window, read beside it
                before = asyncio.ensure_future(asyncio.to_thread(_progress_before, followers))
        process = await steps.run("process", lambda: _process(req, files), ProcessResult)
        # What these two steps had when cut off at the ceiling is kept: spaced dumps can be slow.
        taken: list[Snapshot] = []
        opened: list[Heartbeat] = []
        stacks_step = asyncio.ensure_future(steps.run(
            "stacks", lambda: _stacks(req, process, files, runner, steps.now, taken),
            lambda: StacksResult(snapshots=tuple(taken))))
        cpu_step = asyncio.ensure_future(steps.run("cpu", lambda: _cpu(req, files, window_seconds), CpuResult))
        probe_step = asyncio.ensure_future(steps.run("probe", lambda: _probe(req, files, probe_first_token), ProbeResult))
        heartbeat_step = asyncio.ensure_future(steps.run(
            "heartbeat", lambda: _heartbeat(req, process, files, window_seconds, opened),
            lambda: HeartbeatResult(window=ShimWindow(start=opened[0] if opened else None))))
        ranks_step: asyncio.Future[GroupResult]  # a single server has no such step (nor its line in the bundle)
        if req.group is not None:
            ranks_step = asyncio.ensure_future(steps.run("ranks", lambda: _ranks(req, files, runner, steps.now), GroupResult))
        else:
            ranks_step = asyncio.get_running_loop().create_future()
            ranks_step.set_result(GroupResult(outcome="skipped"))
        delivery_step = asyncio.ensure_future(steps.run(
            "kernel", lambda: _delivery(req, files, window_seconds), DeliveryResult))
        window: list[asyncio.Future] = [stacks_step, cpu_step, probe_step, heartbeat_step, ranks_step, delivery_step]
        sample_step = asyncio.ensure_future(steps.run("sample", lambda: _sample(req, files, runner), SampleResult))
        spindump_step = asyncio.ensure_future(steps.run("spindump", lambda: _spindump(req, files, runner), StepResult))
        crash_step = asyncio.ensure_future(steps.run(
            "crash_reports", lambda: _crash_reports(req, process, files), StepResult))
        versions_step = asyncio.ensure_future(steps.run("versions", lambda: _versions(process, files), VersionsResult))
        requests_step = asyncio.ensure_future(steps.run(
            "requests", lambda: _requests(req, process, files, began), RequestsResult))
        log_step = asyncio.ensure_future(_after(window, steps.deadline - LOG_RESERVE, lambda: steps.run(
            "log", lambda: _log(req, files, followers, before), LogResult)))
        await asyncio.gather(*window, sample_step, spindump_step, crash_step, versions_step, requests_step, log_step)
        cpu_result, log_result = cpu_step.result(), log_step.result()
        death_result = DeathResult(outcome="skipped", error="the server did not die")
        if process.missing or cpu_result.window.gone_at is not None:
            death_result = await steps.run("death", lambda: _death(req, process, log_result, files), DeathResult)
        results = CaptureResults(process=process, stacks=stacks_step.result(), cpu=cpu_result,
                                 probe=probe_step.result(), heartbeat=heartbeat_step.result(),
                                 sample=sample_step.result(), versions=versions_step.result(), log=log_result,
                                 ranks=ranks_step.result(), delivery=delivery_step.result(), death=death_result,
                                 requests=requests_step.result())
        bundle = await asyncio.to_thread(_finish, req, steps, files, results, probe_first_token)
    except BaseException:
        if probe_step is not None and probe_step.done() and not probe_step.cancelled() \
                and probe_step.exception() is None:
            drain = probe_step.result().lingering
            if drain is not None:  # nobody will receive it: end it now
                drain.cancel()
        raise
    finally:
        if before is not None and not before.done():
            before.cancel()
    bundle.lingering = results.probe.lingering
    return bundle


async def _after(tasks: list[asyncio.Future], until: float, then: Callable[[], Awaitable[R]]) -> R:
    """Run ``then`` once ``tasks`` are done, or at ``until`` (monotonic) at the latest."""
    budget = until - time.monotonic()
    if budget > 0:
        await asyncio.wait(tasks, timeout=budget)
    return await then()


async def _process(req: CaptureRequest, files: _Files) -> ProcessResult:
    if req.pid is None:
        return ProcessResult(info={"pid": None, "errors": {"process": "no server process found"}}, outcome="failed",
                             error=("no server process could be proven at the URL (nothing listens "
                                    "there, or another program holds the port: see the verdict)"))
    info = await asyncio.to_thread(describe_process, req.pid)
    await files.write_json("process.json", info)
    if "process" in info["errors"]:
        return ProcessResult(info=info, outcome="failed", error=f"no process with PID {req.pid}")
    return ProcessResult(info=info)


async def _stacks(req: CaptureRequest, process: ProcessResult, files: _Files, runner: Runner,
                  now: Callable[[], float], taken: list[Snapshot]) -> StacksResult:
    """Spaced Python stack dumps, from the launch shim or py-spy (``capture.stacks``); each
    snapshot is appended to ``taken`` as it comes."""
    if req.pid is None or process.missing:
        return StacksResult(outcome="skipped", error="no process to inspect")
    if req.stacks == "sample":
        return StacksResult(outcome="skipped",
                            error="capture.stacks is sample: no Python stacks (macOS sample is the stack source)")
    shim_error = None
    if req.stacks in ("shim", "auto"):
        from_shim = await _shim_stacks(req, req.pid, process, files, now, taken, required=req.stacks == "shim")
        if taken or req.stacks == "shim":
            return from_shim
        shim_error = from_shim.error  # auto: py-spy is tried next; the shim's trouble stands unless py-spy has its own
    exe = await asyncio.to_thread(pyspy.find_py_spy)
    if exe is None:
        return StacksResult(outcome="failed", error="py-spy not found on PATH (pip install py-spy)")
    if pyspy.needs_root() and not req.sudo:
        return StacksResult(outcome="skipped",
                            error="py-spy needs root on macOS: run as root or set capture.sudo (see README)")
    errors = await _pyspy_series(req, req.pid, exe, files, runner, now, taken, "stacks")
    if errors:
        return StacksResult(snapshots=tuple(taken), outcome="ok" if taken else "failed", error="; ".join(errors))
    return StacksResult(snapshots=tuple(taken), error=shim_error)


async def _pyspy_series(req: CaptureRequest, pid: int, exe: str, files: _Files, runner: Runner,
                        now: Callable[[], float], taken: list[Snapshot], directory: str,
                        wrap: Callable[[list[str]], list[str]] | None = None) -> list[str]:
    """py-spy dumps of ``pid`` on the snapshot schedule, into ``directory``/pyspy-N.json and .txt;
    each appended to ``taken`` as it comes. ``wrap`` turns a py-spy argv into the one to run (a
    remote rank's: over ssh). The errors, one per failed snapshot."""
    native = pyspy.native_supported() and wrap is None  # --native: local only (it needs the binary's symbols here)
    wrap = wrap or (lambda argv: argv)
    errors: list[str] = []
    async for i in _snapshot_schedule(req.snapshots, req.spacing):
        at = now()
        result = await runner(wrap(pyspy.dump_command(exe, pid, as_json=True, native=False, sudo=req.sudo)), DUMP_TIMEOUT)
        nonblocking = False
        if not result.ok and not _missing_or_denied(result.error):
            # A SIGSTOPped target cannot be suspended again ("Failed to suspend process" or
            # "Failed to get stack traces"); --nonblocking reads it anyway.
            nonblocking = True
            result = await runner(wrap(pyspy.dump_command(exe, pid, as_json=True, native=False, nonblocking=True,
                                                          sudo=req.sudo)), DUMP_TIMEOUT)
        if not result.ok:
            output = result.stderr.decode("utf-8", "replace")
            meaning = pyspy.explain(output)
            errors.append(f"snapshot {i}: {result.error}" + (f" ({meaning})" if meaning else ""))
            if pyspy.hopeless(output):  # another dump would fail the same way (macOS: see pyspy)
                break
            continue
        try:
            threads = pyspy.parse_dump_json(result.stdout.decode("utf-8", "replace"))
        except ValueError as exc:
            errors.append(f"snapshot {i}: unreadable py-spy JSON: {exc}")
            continue
        taken.append((at, threads))
        await files.write(f"{directory}/pyspy-{i}.json", result.stdout)
        text = await runner(wrap(pyspy.dump_command(exe, pid, as_json=False, native=native and not nonblocking,
                                                    nonblocking=nonblocking, sudo=req.sudo)), DUMP_TIMEOUT)
        header = f"# py-spy dump {i} at +{at:.2f}s ({datetime.now(timezone.utc).isoformat()})" \
                 f"{' --native' if native and not nonblocking else ''}{' --nonblocking' if nonblocking else ''}\n"
        body = text.stdout.decode("utf-8", "replace") if text.ok else f"# failed: {text.error}\n"
        await files.write(f"{directory}/pyspy-{i}.txt", header + body)
    return errors


def _over_ssh(host: str, exe: str) -> Callable[[list[str]], list[str]]:
    """A py-spy argv run on ``host`` the way mlx.launch reaches it (``ssh HOST``): py-spy from
    that host's PATH, else from where it is here (mlx.launch assumes the same paths everywhere)."""
    here = os.path.dirname(exe)

    def wrap(argv: list[str]) -> list[str]:
        script = f'PATH="$PATH:{here}" exec "$@"'
        return ["ssh", *SSH_OPTIONS, host, shlex.join(["sh", "-c", script, "sh", "py-spy", *argv[1:]])]
    return wrap


async def _ranks(req: CaptureRequest, files: _Files, runner: Runner, now: Callable[[], float]) -> GroupResult:
    """Every rank of the group but the target (rank 0, whose stacks the stacks step takes): its
    state now, its process (local ranks: ``ranks/rank-N/process.json``) and spaced py-spy stacks
    (``ranks/rank-N/stacks/``), all ranks side by side on the same schedule."""
    if req.group is None:
        return GroupResult(outcome="skipped", error="not a distributed group")
    group = await asyncio.to_thread(refresh, req.group)
    exe = await asyncio.to_thread(pyspy.find_py_spy)

    async def one(rank: Rank) -> RankFinding:
        if rank.pid == req.pid and rank.local:
            return RankFinding(rank=rank)
        if rank.pid is None or rank.state not in ("running", "stopped"):
            return RankFinding(rank=rank, error=f"rank {rank.rank}: {rank.state}, nothing to inspect")
        directory = f"ranks/rank-{rank.rank}"
        if rank.local:
            info = await asyncio.to_thread(describe_process, rank.pid)
            await files.write_json(f"{directory}/process.json", info)
        if exe is None:
            return RankFinding(rank=rank, error="py-spy not found on PATH (pip install py-spy)")
        taken: list[Snapshot] = []
        errors = await _pyspy_series(req, rank.pid, exe, files, runner, now, taken, f"{directory}/stacks",
                                     None if rank.local else _over_ssh(rank.host, exe))
        return RankFinding(rank=rank, snapshots=tuple(taken),
                           error="; ".join(f"rank {rank.rank} {e}" for e in errors) or None)

    found = await asyncio.gather(*(one(r) for r in group.ranks))
    errors = [f.error for f in found if f.error] + list(group.errors)
    return GroupResult(group=group, ranks=tuple(found), error="; ".join(errors) or None)


async def _shim_stacks(req: CaptureRequest, pid: int, process: ProcessResult, files: _Files, now: Callable[[], float],
                       taken: list[Snapshot], *, required: bool) -> StacksResult:
    """Stacks from the launch shim's dumps, on py-spy's schedule (``stacks/shim-N.txt``
    and ``.json``). With ``required`` (``capture.stacks: shim``) a missing shim is the step's
    failure; in ``auto`` it is silence, and the caller goes on with py-spy."""
    hb, identity, problem = await asyncio.to_thread(_shim_dumper, pid, process.create_time)
    if hb is None or identity is None:
        return StacksResult(outcome="failed", error=f"shim stacks: {problem}") if required else StacksResult()
    errors: list[str] = []
    async for i in _snapshot_schedule(req.snapshots, req.spacing):
        at = now()
        try:
            dump = await asyncio.to_thread(shim_stacks.request_dump, identity, hb)
        except (ShimError, OSError) as exc:
            errors.append(f"snapshot {i}: {exc}")
            if shim_stacks.dumps_are_over(exc):
                break
            continue
        taken.append((at, dump.threads))
        by = "its dump thread" if dump.by == "thread" else "faulthandler on the stack signal (the GIL was held)"
        header = (f"# shim dump {i} by {by} at +{at:.2f}s ({datetime.now(timezone.utc).isoformat()}); "
                  "thread names from the heartbeat:\n")
        header += "".join(f"#   {t.name}\n" for t in dump.threads)
        await files.write(f"stacks/shim-{i}.txt", header + dump.text)
        await files.write_json(f"stacks/shim-{i}.json", shim_stacks.pyspy_json(dump.threads))
    if not errors:
        return StacksResult(snapshots=tuple(taken))
    error = "shim stacks: " + "; ".join(errors)
    if not taken and not required:
        return StacksResult(error=error)  # auto: py-spy is tried next and decides the outcome
    return StacksResult(snapshots=tuple(taken), outcome="ok" if taken else "failed", error=error)


def _shim_dumper(pid: int, recorded: float | None) -> tuple[Heartbeat | None, ProcessIdentity | None, str | None]:
    """The shim that can dump ``pid``'s stacks, and the identity each dump request proves again
    before it signals (by the kernel start, which no clock step moves). Taken from the live
    process, then held to the capture's: a PID reused since is refused here, and a heartbeat left
    by a process now gone must belong to the live one (a process without the shim would be killed
    by the signal)."""
    try:
        identity = ProcessIdentity.of(pid)
    except ProcessGoneError as exc:
        return None, None, str(exc)
    if recorded is not None and abs(identity.create_time - recorded) > REUSED_PID_SLACK:
        return None, None, f"PID {pid} is another process now"
    hb, problem = shim_stacks.find_dumper(pid, identity.create_time)
    return hb, identity, problem


def _missing_or_denied(error: str | None) -> bool:
    text = (error or "").lower()
    return any(w in text for w in ("not found", "no such process", "permission denied", "operation not permitted"))


async def _cpu(req: CaptureRequest, files: _Files, seconds: float) -> CpuResult:
    if req.pid is None:
        return CpuResult(outcome="skipped", error="no process to inspect")
    window = await sample_process(req.pid, seconds)
    await files.write_json("procstats.json", window.to_dict())
    return CpuResult(window=window, error="; ".join(window.errors) or None)


async def _delivery(req: CaptureRequest, files: _Files, seconds: float) -> DeliveryResult:
    if req.kernel_port is None:
        return DeliveryResult(outcome="skipped", error="no URL" if req.url is None else "kernel: off")
    found = await watch_delivery(req.kernel_port, req.pid, seconds)
    await files.write_json("kernel.json", found.to_dict())
    if found.unavailable:
        return DeliveryResult(delivery=found, outcome="skipped", error=f"kernel sight unavailable: {found.unavailable}")
    return DeliveryResult(delivery=found)


async def _heartbeat(req: CaptureRequest, process: ProcessResult, files: _Files, seconds: float,
                     opened: list[Heartbeat]) -> HeartbeatResult:
    """The launch shim's heartbeat at the window's start and end (``shim/heartbeat-*.json``);
    the first reading is appended to ``opened`` as it comes."""
    if req.pid is None or process.missing:
        return HeartbeatResult(window=ShimWindow(), outcome="skipped", error="no process to inspect")

    async def started(hb: Heartbeat) -> None:
        opened.append(hb)
        await files.write_json("shim/heartbeat-start.json", hb.data)

    window = await shim_stacks.heartbeat_window(req.pid, process.create_time, seconds, on_start=started)
    if window.start is None:
        return HeartbeatResult(window=window, outcome="skipped",
                               error=f"no launch shim in this process (`mlxwatch launch`): {window.problem}")
    if window.end is None:
        return HeartbeatResult(window=window, error=f"heartbeat gone by the window's end: {window.problem}")
    await files.write_json("shim/heartbeat-end.json", window.end.data)
    return HeartbeatResult(window=window)


async def _probe(req: CaptureRequest, files: _Files, first_token_timeout: float) -> ProbeResult:
    if req.prior_probes:
        await files.write_json("probes-before.json", req.prior_probes)
    if req.front_requests is not None:  # data the daemon passed: capture reads no door itself
        await files.write_json("front/requests.json", req.front_requests)
    if not req.url:
        return ProbeResult(outcome="skipped", error="no URL given (--url or --instance)")
    client = probes.make_client()
    try:
        report = await probes.run_check(client, req.url, first_token_timeout=first_token_timeout,
                                        timeout=req.probe_timeout, endpoint_timeout=5.0, linger=req.probe_linger)
    except BaseException:
        await client.aclose()
        raise
    lingering = getattr(report, "lingering", None)
    drain = None
    if lingering is not None:  # the stream stays open: so must the client, until the drain ends
        drain = asyncio.ensure_future(_drain_then_close(lingering, client))
    else:
        await client.aclose()
    try:
        await files.write_json("probe.json", report.to_dict())
    except BaseException:
        if drain is not None:  # this result is lost: nobody would end the drain
            drain.cancel()
        raise
    return ProbeResult(report=report, lingering=drain,
                       error=None if report.healthy else f"probe: {report.reason}")  # evidence, not a step failure


async def _drain_then_close(lingering: Awaitable[object], client: httpx.AsyncClient) -> object:
    """Own the probe's client while its background drain runs; cancelling this cancels the drain."""
    try:
        return await lingering
    except Exception:  # the drain's outcome is nobody's evidence: the bundle is already written
        return None
    finally:
        await client.aclose()


async def _requests(req: CaptureRequest, process: ProcessResult, files: _Files, began: float) -> RequestsResult:
    """The recorded requests into the bundle's private ``requests/``: the door's (``front.record``,
    handed over by the daemon) when it holds any, else those the launch shim in the server
    recorded (``mlxwatch launch --record``) up to the capture's start. The bodies exact (never
    redacted: a replay sends them again), the index through the bundle's redaction."""
    if req.recorded:
        recorded, at, source, note = req.recorded, req.recorded_at, "door", ""
    elif req.pid is None or process.missing:
        return RequestsResult(outcome="skipped", error="no process to read recorded requests of")
    else:
        found, note = await asyncio.to_thread(from_shim, req.pid, process.create_time, began)
        if found is None:
            return RequestsResult(outcome="skipped", error=f"none recorded (front.record, mlxwatch launch --record): {note}")
        recorded, at, source = found, began, "shim"
    if recorded:
        await asyncio.to_thread(write_requests, files.writer, recorded)
        await files.write_json(REQUESTS_INDEX, index_entries(recorded))
    return RequestsResult(recorded=tuple(recorded), at=at, source=source, error=note or None)


async def _sample(req: CaptureRequest, files: _Files, runner: Runner) -> SampleResult:
    if not macos.is_macos():
        return SampleResult(outcome="skipped", error="sample: not available on this OS (macOS only)")
    if req.pid is None:
        return SampleResult(outcome="skipped", error="no process to inspect")
    if not await asyncio.to_thread(macos.tool_available, "sample"):
        return SampleResult(outcome="skipped", error="sample: not found")
    out = await asyncio.to_thread(files.writer.tool_output, "native/sample.txt")
    result = await runner(macos.sample_command(req.pid, out), macos.SAMPLE_SECONDS + 15)
    ran = await _register_tool_output(files, "native/sample.txt", result)
    # sample's call graph, read: every thread's heaviest native path (MLX/Metal threads marked)
    report = await asyncio.to_thread(
        lambda: macos.parse_sample(out.read_text(errors="replace")) if out.exists() else None)
    if report is None:
        return SampleResult(outcome=ran.outcome, error=ran.error)
    await files.write_json("native/sample-threads.json", {
        "process": report.process, "findings": report.findings(), "threads": [vars(t) for t in report.threads]})
    return SampleResult(native_findings=tuple(report.findings()), outcome=ran.outcome, error=ran.error)


async def _spindump(req: CaptureRequest, files: _Files, runner: Runner) -> StepResult:
    if not macos.is_macos():
        return StepResult(outcome="skipped", error="spindump: not available on this OS (macOS only)")
    if req.pid is None:
        return StepResult(outcome="skipped", error="no process to inspect")
    if os.geteuid() != 0 and not req.sudo:
        return StepResult(outcome="skipped", error="spindump needs root: run as root or set capture.sudo")
    # The report comes on stdout and is written here: a file spindump wrote under sudo would be
    # root's, neither private nor readable by this daemon.
    result = await runner(macos.spindump_command(req.pid, sudo=req.sudo and os.geteuid() != 0),
                          macos.SAMPLE_SECONDS + 30)
    if result.stdout:
        await files.write("native/spindump.txt", result.stdout)
    return StepResult() if result.ok else StepResult(outcome="failed", error=result.error)


async def _register_tool_output(files: _Files, relname: str, result: CommandResult) -> StepResult:
    """Tools that write their own file: list it in the manifest (or say why there is none)."""
    await asyncio.to_thread(files.writer.adopt, relname)
    return StepResult() if result.ok else StepResult(outcome="failed", error=result.error)


async def _crash_reports(req: CaptureRequest, process: ProcessResult, files: _Files) -> StepResult:
    if not macos.is_macos():
        return StepResult(outcome="skipped", error="crash reports: macOS only")
    since = process.create_time or macos.since_default()

    def collect() -> None:
        for path in macos.recent_crash_reports(req.pid, since):
            with open(path, "rb") as fh:
                files.write_blocking(f"crash/{path.name}", fh.read(16 * 1024 * 1024))

    await asyncio.to_thread(collect)
    return StepResult()


async def _death(req: CaptureRequest, process: ProcessResult, log: LogResult, files: _Files) -> DeathResult:
    """Why the server died (``capture.death``): its records copied in, ``death.json`` beside them."""
    gone = death.GoneProcess(req.pid, process.create_time) if req.pid is not None else req.gone
    if gone is not None and gone.started is None and req.gone is not None and req.gone.pid == gone.pid:
        gone = req.gone
    reports: tuple[death.Cause, ...] = ()
    if macos.is_macos() and gone is not None:
        reports = await asyncio.to_thread(death.macos_reports, gone, time.time())
    cause = await asyncio.to_thread(death.why_gone, gone, log.markers, linux=sys.platform.startswith("linux"),
                                    reports=reports)
    for relname, text in cause.files.items():
        await files.write(relname, text)
    await files.write_json("death.json", {"pid": gone.pid if gone else None, **cause.to_dict()})
    return DeathResult(cause=cause)


def _follow_log(path: Path) -> list[LogFollower] | None:
    """The log and the file it was last rotated to (its writer may still be on it: a launchd
    job's stderr is until the job restarts), each followed from its current end, older first;
    None when the log cannot be followed. Rotations during the window are followed too."""
    followers = []
    for candidate in (rotated_from(path), path):
        if candidate is not None:
            follower = LogFollower(candidate, max_read=RECENT_BYTES)
            if follower.prime() is None:
                followers.append(follower)
            elif candidate == path:
                return None
    return followers


def _read_range(path: Path, start: int, end: int) -> str:
    """Bytes ``start`` to ``end`` of the log as text, beginning at a whole line; "" if unreadable."""
    try:
        with open_log(path) as fh:
            fh.seek(max(0, start - 1))
            data = fh.read(max(0, end - max(0, start - 1)))
    except OSError:
        return ""
    if start > 0:  # keep the first line only if ``start`` is where it begins
        data = data[1:] if data[:1] == b"\n" else data[data.find(b"\n") + 1:] if b"\n" in data else b""
    return data.decode("utf-8", errors="replace")


def _progress_before(followers: list[LogFollower]) -> dict[int, int]:
    """Per prompt total Y, the last processed X the log showed before the window (current process),
    the rotated file's lines first."""
    text = ""
    for f in followers:
        part = _read_range(f.path, max(0, f.offset - RECENT_BYTES), f.offset)
        text += part[:part.rfind("\n") + 1]  # a line still being written is not read
    return {y: x for x, y in progress_lines(since_last_start(text))}


def _read_log(path: Path, followers: list[LogFollower] | None, tail: int) -> tuple[LogMarkers, str, str | None] | None:
    """Markers and tail of the recent log (across its last rotation), and the lines it gained
    during the window (None when the log could not be followed from the window's start)."""
    if not path.exists():
        return None
    text, _ = read_recent_across(path)
    gained = None
    if followers is not None:
        gained = "".join(line + "\n" for f in followers for line in f.read_new().lines)
        for f in followers:
            f.close()
    return scan(since_last_start(text)), "\n".join(tail_lines(text, tail)) + "\n", gained


async def _log(req: CaptureRequest, files: _Files, followers: list[LogFollower] | None,
               before: Awaitable[dict[int, int]] | None) -> LogResult:
    if req.log is None:
        return LogResult(outcome="skipped", error="no server log given (--log or the instance's log)")
    read = await asyncio.to_thread(_read_log, req.log, followers, req.log_tail_lines)
    if read is None:
        return LogResult(outcome="failed", error=f"log not found: {req.log}")
    markers, tail, gained = read
    await files.write("log-tail.txt", tail)
    await files.write_json("log-markers.json", markers.to_dict())
    try:
        last_x = await before if before is not None else {}
    except Exception as exc:  # no baseline for the window: the markers still stand
        return LogResult(markers=markers, outcome="failed", error=f"{type(exc).__name__}: {exc}")
    return LogResult(markers=markers, gained=gained, before=last_x)


async def _versions(process: ProcessResult, files: _Files) -> VersionsResult:
    versions = await asyncio.to_thread(server_versions, process.info.get("cmdline") or [], process.info.get("exe"))
    versions["mlxwatch"] = __version__
    versions["watcher_python"] = platform.python_version()
    await files.write_json("versions.json", versions)
    return VersionsResult(versions=versions)


@dataclass
class LogWindow:
    """What the log says happened during the window."""

    advances: list[tuple[int, int]] = field(default_factory=list)  # other prompts' progress, X grown
    admissions: int = 0  # POST .../completions 200 lines: requests *admitted*, not answered

    def to_dict(self) -> dict:
        return {"prompt_progress_advances": len(self.advances),
                "last_advance": list(self.advances[-1]) if self.advances else None,
                "admissions": self.admissions}


def log_window(before: dict[int, int], gained: str, probe_totals: set[int]) -> LogWindow:
    """Read the log text written during the window by the watcher's progress rule
    (``serverlog.markers.prompt_advances``); ``before`` maps each prompt's Y to the last X seen
    before the window. Admission lines are counted apart, for the current server process only:
    they are not progress."""
    advances, _ = prompt_advances(gained.splitlines(), before, probe_totals)
    return LogWindow(advances=advances, admissions=completions_ok(since_last_start(gained)))


def _probe_totals(report: CheckReport | None, prior_probes: list[dict]) -> set[int]:
    """The prompt sizes (Y of X/Y) the capture's and the watchdog's probes were seen to have."""
    totals = {k.total for k in report.generation.keepalives} if report is not None else set()
    for prior in prior_probes:
        for k in (prior.get("generation") or {}).get("keepalives") or []:
            if isinstance(k, dict) and isinstance(k.get("total"), int):
                totals.add(k["total"])
    return totals


def _evidence(req: CaptureRequest, found: CaptureResults) -> tuple[Evidence, LogWindow | None]:
    """The classifier's evidence, assembled from the steps' results."""
    cpu, report, markers = found.cpu.window, found.probe.report, found.log.markers
    ev = Evidence(verdict=req.verdict, native_findings=list(found.sample.native_findings))
    ev.process_alive = not found.process.missing and cpu.gone_at is None
    if ev.process_alive and req.pid is not None and found.process.create_time:
        # Still the same process now (same PID and create time, not a zombie)?
        ev.process_alive = ProcessIdentity(req.pid, found.process.create_time, ()).alive()
    ev.process_statuses = cpu.statuses()
    ev.snapshots = [threads for _, threads in found.stacks.snapshots]
    ev.stacks_error = found.stacks.error
    gens = [stacks.generation_thread(t) for t in ev.snapshots]
    tid = next((g.os_thread_id for g in gens if g is not None), None)
    ev.generation_cpu = cpu.thread_cpu_percent(tid)
    ev.process_cpu = cpu.cpu_percent()
    if report is not None:
        gen = report.generation
        ev.probe_ran = True
        ev.probe_ok = report.healthy
        ev.probe_tokens = gen.tokens
        ev.probe_failure = report.failure
        done = [k.processed for k in gen.keepalives]
        ev.probe_keepalive_advanced = len(set(done)) > 1
        ev.health_status = report.health.status
        ev.models_status = report.models.status
        ev.endpoints_answered = report.health.answered or report.models.answered
    ev.log = markers
    ev.delivered_to_clients = list(found.delivery.delivery.delivered)
    ev.ranks = [RankEvidence(f.rank.rank, f.rank.host, f.rank.pid, f.rank.state,
                             [threads for _, threads in f.snapshots], target=f.rank.pid == req.pid and f.rank.local)
                for f in found.ranks.ranks]
    if found.heartbeat.window is not None:
        ev.shim = found.heartbeat.window.findings(report.generation.tokens if report is not None else 0)
    window = None
    if markers is not None and found.log.gained is not None:
        window = log_window(found.log.before, found.log.gained, _probe_totals(report, req.prior_probes))
        ev.log_progress_advanced = bool(window.advances)
        ev.log_progress_now = window.advances[-1] if window.advances else None
        ours = 1 if report is not None and report.generation.status == 200 else 0
        ev.log_admissions = max(0, window.admissions - ours)
    return ev, window


def _finish(req: CaptureRequest, steps: StepRunner, files: _Files, found: CaptureResults,
            probe_first_token: float) -> Bundle:
    """Classify and write the bundle (blocking: run in a worker thread)."""
    evidence, window = _evidence(req, found)
    classification = classify(evidence)
    cause = found.death.cause if classification.kind == "crashed" else \
        death.why_thread_died(found.log.markers) if classification.kind == "dead_thread" else None
    if cause is not None:
        classification.cause, classification.cause_summary = cause.cause, cause.summary
        classification.evidence.insert(1 if classification.kind == "crashed" else 0, f"cause: {cause.summary}")
    process = found.process.info
    manifest = {
        "created_at": datetime.now(timezone.utc).isoformat(),
        "host": socket.gethostname(),
        "mlxwatch": __version__,
        "platform": sys.platform,
        "target": {"pid": req.pid, "label": req.label, "url": req.url, "log": str(req.log) if req.log else None,
                   "create_time": process.get("create_time"), "cmdline": process.get("cmdline")},
        "verdict": req.verdict,
        "settings": {"snapshots": req.snapshots, "spacing": req.spacing, "ceiling": req.ceiling, "sudo": req.sudo,
                     "probe_first_token_timeout": probe_first_token, "probe_linger": req.probe_linger,
                     "stacks": req.stacks, "redact": req.redact},
        "duration": round(steps.now(), 3),
        "steps": [record.to_dict() for record in steps.records()],
        "cpu": {"process": evidence.process_cpu, "generation_thread": evidence.generation_cpu,
                "statuses": evidence.process_statuses},
        "log_window": window.to_dict() if window else None,
        "shim": found.heartbeat.window.to_dict() if found.heartbeat.window is not None else None,
        "versions": found.versions.versions,
        "classification": classification.to_dict(),
        "group": _group_entry(req, found),
        "kernel": found.delivery.delivery.to_dict() if req.kernel_port is not None else None,
    }
    held = found.requests
    if held.recorded:
        manifest["requests"] = manifest_entry(held.recorded, held.at if held.at is not None
                                              else held.recorded[-1].arrived_mono, held.source or "door")
    manifest = redact_json(manifest, files.redaction)  # the command line, the verdict, step errors
    markers = found.log.markers
    summary = redact_text(render_summary(manifest, list(found.stacks.snapshots), markers.to_dict() if markers else None),
                          files.redaction)
    path = files.writer.finish(manifest, summary)
    # A capture killed earlier here (`mlxwatch capture` has no start of its own that adopts it, as
    # the daemon's does) becomes <name>-incomplete: listed by `bundle list`, and pruned like any.
    adopt_partials(req.out_dir)
    prune(req.out_dir, req.keep, req.max_bytes, protect=path, keep_days=req.keep_days)
    return Bundle(path, classification, files.writer.manifest)


def _group_entry(req: CaptureRequest, found: CaptureResults) -> dict[str, Any] | None:
    """The manifest's ``group``: launcher, backend, and each rank with its state and innermost
    frame (its generation thread's in the last snapshot); None for a single server."""
    group = found.ranks.group or req.group
    if group is None:
        return None
    by_rank = {f.rank.rank: f for f in found.ranks.ranks}
    ranks = []
    for rank in group.ranks:
        finding = by_rank.get(rank.rank)
        rank = finding.rank if finding is not None else rank
        snaps = list(found.stacks.snapshots) if rank.pid == req.pid and rank.local else \
            list(finding.snapshots) if finding is not None else []
        gen = next((g for g in (stacks.generation_thread(t) for _, t in reversed(snaps)) if g is not None), None)
        innermost = (gen.frames[0].where if gen.frames else "?") if gen is not None else \
            ("no generation thread" if snaps else None)
        ranks.append({**rank.to_dict(), "innermost": innermost, "snapshots": len(snaps),
                      "stacks": "stacks/" if rank.pid == req.pid and rank.local else f"ranks/rank-{rank.rank}/stacks/"})
    launcher = None if group.launcher is None else {"pid": group.launcher.pid, "cmdline": list(group.launcher.cmdline)}
    entry: dict[str, Any] = {"launcher": launcher, "backend": group.backend, "hosts": list(group.hosts),
                             "hostfile": group.hostfile, "ranks": ranks}
    if group.launcher_gone:  # named in the bundle: nothing will end these ranks but a restart of them all
        entry.update(launcher_gone=True, orphaned=group.orphan_note())
    return entry


async def _snapshot_schedule(snapshots: int, spacing: float) -> AsyncIterator[int]:
    """Snapshot numbers 1..snapshots on a fixed schedule (0, spacing, 2*spacing...), for py-spy
    and shim stacks alike: a slow dump does not push the next ones, and the window ends when
    the CPU window does."""
    started = time.monotonic()
    for i in range(1, snapshots + 1):
        wait = started + (i - 1) * spacing - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        yield i
