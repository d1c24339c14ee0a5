"""Capture an evidence bundle from a live (possibly hung) server, within a hard time ceiling.

Steps, each with its own timeout, none able to abort another (a failed step is recorded with
its error and the bundle is still written). They run side by side::

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
import inspect
import json
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable

from mlxwatch import __version__, stacks
from mlxwatch.capture import macos, pyspy
from mlxwatch.capture.bundle import BundleWriter, prune
from mlxwatch.capture.classify import Classification, Evidence, classify
from mlxwatch.capture.procstats import ProcessWindow, describe_process, sample_process
from mlxwatch.capture.redact import (
    NONE,
    PRIVATE,
    redact_bytes,
    redact_json,
    redact_text,
)
from mlxwatch.capture.summary import render_summary
from mlxwatch.capture.versions import server_versions
from mlxwatch.config import CaptureConfig, ProbeConfig
from mlxwatch.host.commands import Runner, run_command
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.serverlog.follow import LogFollower
from mlxwatch.serverlog.markers import (
    RECENT_BYTES,
    LogMarkers,
    completions_ok,
    open_regular,
    progress_lines,
    read_recent_across,
    rotated_from,
    scan,
    since_last_start,
    tail_lines,
)
from mlxwatch.shim import stacks as shim_stacks
from mlxwatch.verdict.progress import prompt_advances

DUMP_TIMEOUT = 10.0
FINISH_RESERVE = 2.0  # seconds of the ceiling kept for classifying and writing
LOG_RESERVE = 2.0  # the log is read at the latest this long before the steps are cut off
PROBE_MARGIN = 1.0  # the capture's probe waits for a first token this long past the window's end
PROBE_FLOOR = 5.0  # ...and never less than this
PROBE_LINGER = 30.0  # how long a given-up probe keeps draining its stream in the background
# The capture's own probe: the instance's timeouts, capped so that it fits the capture window.
PROBE_FIRST_TOKEN_CAP = 10.0
PROBE_TIMEOUT_CAP = 20.0

StepCallback = Callable[[str, str], None]  # (step name, "start" | outcome)


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
    keep: int = CaptureConfig.keep
    max_bytes: int = CaptureConfig.max_bytes
    keep_days: float | None = CaptureConfig.keep_days
    min_free_bytes: int = CaptureConfig.min_free_bytes  # below it: LowDiskSpace, no bundle
    verdict: str | None = None  # the watchdog's reason for judging the server hung; None: manual capture
    probe_linger: float = PROBE_LINGER  # 0: a given-up probe closes its stream at once
    stacks: str = CaptureConfig.stacks  # Python stacks from: auto (the launch shim if present, else py-spy) | pyspy | shim | sample
    redact: bool = CaptureConfig.redact  # the raw bundle's redaction (redact.PRIVATE); False: complete (NONE)


def capture_probe_timeouts(probe: ProbeConfig) -> dict[str, float]:
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


@dataclass
class _Step:
    name: str
    started: float = 0.0
    duration: float = 0.0
    outcome: str = "not run"  # ok | failed | skipped | timeout | stopped at ceiling
    error: str | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "start": round(self.started, 3), "duration": round(self.duration, 3),
                "outcome": self.outcome, "error": self.error}


class _Capture:
    """The state of one capture run: the writer, step records, and what classification needs."""

    def __init__(self, req: CaptureRequest, runner: Runner, on_step: StepCallback | None) -> None:
        self.req = req
        self.runner = runner
        self.on_step = on_step or (lambda name, state: None)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + req.ceiling
        self.writer: BundleWriter = None  # type: ignore[assignment]  # made in a worker thread
        self.steps: list[_Step] = []
        self.snapshots: list[tuple[float, list[stacks.ThreadStack]]] = []
        self.stacks_error: str | None = None
        self.window = ProcessWindow()
        self.window_seconds = max(0.5, (req.snapshots - 1) * req.spacing + 0.5)
        self.probe_first_token = min(req.probe_first_token_timeout, max(PROBE_FLOOR, self.window_seconds + PROBE_MARGIN))
        self.report: Any = None
        self.lingering: asyncio.Task | None = None
        # The log (and the file it was last rotated to) followed from the window's start; None: not measured
        self.log_followers: list[LogFollower] | None = None
        self.log_before: dict[int, int] = {}  # per prompt total Y, the last X logged before the window
        self.log_window_text: str | None = None  # what the log gained during the window
        self.markers: LogMarkers | None = None
        self.process: dict = {}
        self.versions: dict = {}
        self.native_findings: list[str] = []  # macOS sample, when py-spy cannot read the server
        self.shim_window: shim_stacks.ShimWindow | None = None  # the launch shim's heartbeat over the window
        self.redaction = PRIVATE if req.redact else NONE  # every file goes through it (write_blocking)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def write_blocking(self, relname: str, data: bytes | str) -> None:
        """The one way text enters the bundle: the redaction pass at the bundle's level, then
        the write (blocking, in a worker thread: a log or a spindump can be megabytes)."""
        self.writer.write(relname, redact_bytes(relname, data, self.redaction))

    async def write(self, relname: str, data: bytes | str) -> None:
        await asyncio.to_thread(self.write_blocking, relname, data)

    async def write_json(self, relname: str, value: Any) -> None:
        text = json.dumps(value, indent=2, sort_keys=True, default=str)  # as BundleWriter.write_json
        await asyncio.to_thread(self.write_blocking, relname, text)

    async def step(self, name: str, work: Callable[[_Step], Awaitable[None]]) -> None:
        """Run one step; record its outcome whatever happens. Cancellation (the ceiling) propagates."""
        record = _Step(name, started=self.now())
        self.steps.append(record)
        self.on_step(name, "start")
        try:
            await work(record)
            if record.outcome == "not run":
                record.outcome = "ok"
        except asyncio.CancelledError:
            record.outcome, record.error = "stopped at ceiling", f"the {self.req.ceiling:g}s capture ceiling was reached"
            raise
        except Exception as exc:  # a broken step must never cost the others
            record.outcome, record.error = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            record.duration = self.now() - record.started
            self.on_step(name, record.outcome)

    async def phase(self, *steps: Awaitable[None]) -> None:
        """Run steps together until done or until the ceiling (less the finishing reserve)."""
        tasks = [asyncio.ensure_future(s) for s in steps]
        remaining = self.deadline - FINISH_RESERVE - time.monotonic()
        if remaining <= 0:
            for task in tasks:
                task.cancel()
        else:
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for task in pending:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def after(self, tasks: list[asyncio.Future], name: str, work: Callable[[_Step], Awaitable[None]]) -> None:
        """Run a step once ``tasks`` are done, or ``LOG_RESERVE`` before the steps are cut off."""
        budget = self.deadline - FINISH_RESERVE - LOG_RESERVE - time.monotonic()
        if budget > 0:
            await asyncio.wait(tasks, timeout=budget)
        await self.step(name, work)


async def capture_bundle(req: CaptureRequest, *, runner: Runner = run_command, on_step: StepCallback | None = None) -> Bundle:
    """Capture, classify and write one bundle. Raises only if the bundle itself cannot be written.

    The returned ``Bundle.lingering`` (if not None) is a task still draining the capture probe's
    stream; the caller awaits or cancels it."""
    cap = _Capture(req, runner, on_step)
    cap.writer = await asyncio.to_thread(BundleWriter, req.out_dir, req.label or f"pid-{req.pid}", req.min_free_bytes)
    before: asyncio.Future | None = None
    try:
        if req.log is not None:
            cap.log_followers = await asyncio.to_thread(_follow_log, req.log)
            if cap.log_followers is not None:  # what the log said before the window, read beside it
                before = asyncio.ensure_future(asyncio.to_thread(_progress_before, cap.log_followers))
        await cap.step("process", lambda rec: _process(cap, rec))
        window = [
            asyncio.ensure_future(cap.step("stacks", lambda rec: _stacks(cap, rec))),
            asyncio.ensure_future(cap.step("cpu", lambda rec: _cpu(cap, rec))),
            asyncio.ensure_future(cap.step("probe", lambda rec: _probe(cap, rec))),
            asyncio.ensure_future(cap.step("heartbeat", lambda rec: shim_stacks.watch_window(cap, rec))),
        ]
        await cap.phase(
            *window,
            cap.step("sample", lambda rec: _sample(cap, rec)),
            cap.step("spindump", lambda rec: _spindump(cap, rec)),
            cap.step("crash_reports", lambda rec: _crash_reports(cap, rec)),
            cap.step("versions", lambda rec: _versions(cap, rec)),
            cap.after(window, "log", lambda rec: _log(cap, rec, before)),
        )
        bundle = await asyncio.to_thread(_finish, cap)
    except BaseException:
        if cap.lingering is not None:  # nobody will receive it: end it now
            cap.lingering.cancel()
        raise
    finally:
        if before is not None and not before.done():
            before.cancel()
    bundle.lingering = cap.lingering
    return bundle


async def _process(cap: _Capture, rec: _Step) -> None:
    if cap.req.pid is None:
        cap.process = {"pid": None, "errors": {"process": "no server process found"}}
        rec.outcome, rec.error = "failed", ("no server process could be proven at the URL (nothing listens "
                                            "there, or another program holds the port: see the verdict)")
        return
    cap.process = await asyncio.to_thread(describe_process, cap.req.pid)
    await cap.write_json("process.json", cap.process)
    if "process" in cap.process["errors"]:
        rec.outcome, rec.error = "failed", f"no process with PID {cap.req.pid}"


async def _stacks(cap: _Capture, rec: _Step) -> None:
    req = cap.req
    if req.pid is None or "process" in cap.process.get("errors", {}):
        rec.outcome, rec.error = "skipped", "no process to inspect"
        cap.stacks_error = rec.error
        return
    if req.stacks == "sample":
        rec.outcome, rec.error = "skipped", "capture.stacks is sample: no Python stacks (macOS sample is the stack source)"
        cap.stacks_error = rec.error
        return
    if req.stacks in ("shim", "auto") and (await shim_stacks.take_stacks(cap, rec, required=req.stacks == "shim")
                                           or req.stacks == "shim"):
        return  # the launch shim's faulthandler dumps (auto: py-spy when the process has no shim)
    exe = await asyncio.to_thread(pyspy.find_py_spy)
    if exe is None:
        rec.outcome, rec.error = "failed", "py-spy not found on PATH (pip install py-spy)"
        cap.stacks_error = rec.error
        return
    if pyspy.needs_root() and not req.sudo:
        rec.outcome, rec.error = "skipped", "py-spy needs root on macOS: run as root or set capture.sudo (see README)"
        cap.stacks_error = rec.error
        return
    native = pyspy.native_supported()
    errors = []
    started = time.monotonic()
    for i in range(1, req.snapshots + 1):
        # Snapshots on a fixed schedule (0, spacing, 2*spacing...): a slow dump does not push
        # the next ones, and the window ends when the CPU window does.
        wait = started + (i - 1) * req.spacing - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        at = cap.now()
        result = await cap.runner(pyspy.dump_command(exe, req.pid, as_json=True, native=False, sudo=req.sudo), DUMP_TIMEOUT)
        nonblocking = False
        if not result.ok and not _missing_or_denied(result.error):
            # A SIGSTOPped target cannot be suspended again ("Failed to suspend process" or
            # "Failed to get stack traces"); --nonblocking reads it anyway.
            nonblocking = True
            result = await cap.runner(pyspy.dump_command(exe, req.pid, as_json=True, native=False, nonblocking=True, sudo=req.sudo), DUMP_TIMEOUT)
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
        cap.snapshots.append((at, threads))
        await cap.write(f"stacks/pyspy-{i}.json", result.stdout)
        text = await cap.runner(pyspy.dump_command(exe, req.pid, as_json=False, native=native and not nonblocking,
                                                   nonblocking=nonblocking, sudo=req.sudo), DUMP_TIMEOUT)
        header = f"# py-spy dump {i} at +{at:.2f}s ({datetime.now(timezone.utc).isoformat()})" \
                 f"{' --native' if native and not nonblocking else ''}{' --nonblocking' if nonblocking else ''}\n"
        await cap.write(f"stacks/pyspy-{i}.txt", header + (text.stdout.decode("utf-8", "replace") if text.ok else f"# failed: {text.error}\n"))
    if errors:
        cap.stacks_error = "; ".join(errors)
        rec.error = cap.stacks_error
        rec.outcome = "failed" if not cap.snapshots else "ok"


def _missing_or_denied(error: str | None) -> bool:
    text = (error or "").lower()
    return any(w in text for w in ("not found", "no such process", "permission denied", "operation not permitted"))


async def _cpu(cap: _Capture, rec: _Step) -> None:
    if cap.req.pid is None:
        rec.outcome, rec.error = "skipped", "no process to inspect"
        return
    cap.window = await sample_process(cap.req.pid, cap.window_seconds)
    await cap.write_json("procstats.json", cap.window.to_dict())
    if cap.window.errors:
        rec.error = "; ".join(cap.window.errors)


async def _probe(cap: _Capture, rec: _Step) -> None:
    from mlxwatch.probes import make_client, run_check

    if cap.req.prior_probes:
        await cap.write_json("probes-before.json", cap.req.prior_probes)
    if not cap.req.url:
        rec.outcome, rec.error = "skipped", "no URL given (--url or --instance)"
        return
    extra: dict[str, Any] = {}
    if cap.req.probe_linger > 0 and "linger" in inspect.signature(run_check).parameters:
        extra["linger"] = cap.req.probe_linger
    client = make_client()
    try:
        cap.report = await run_check(client, cap.req.url, first_token_timeout=cap.probe_first_token,
                                     timeout=cap.req.probe_timeout, endpoint_timeout=5.0, **extra)
    except BaseException:
        await client.aclose()
        raise
    lingering = getattr(cap.report, "lingering", None)
    if lingering is not None:  # the stream stays open: so must the client, until the drain ends
        cap.lingering = asyncio.ensure_future(_drain_then_close(lingering, client))
    else:
        await client.aclose()
    await cap.write_json("probe.json", cap.report.to_dict())
    if not cap.report.healthy:
        rec.error = f"probe: {cap.report.reason}"  # evidence, not a step failure


async def _drain_then_close(lingering: Awaitable[Any], client: Any) -> Any:
    """Own the probe's client while its background drain runs; cancelling this cancels the drain."""
    try:
        return await lingering
    except Exception:  # the drain's outcome is nobody's evidence: the bundle is already written
        return None
    finally:
        await client.aclose()


async def _sample(cap: _Capture, rec: _Step) -> None:
    if not macos.is_macos():
        rec.outcome, rec.error = "skipped", "sample: not available on this OS (macOS only)"
        return
    if not await asyncio.to_thread(macos.tool_available, "sample"):
        rec.outcome, rec.error = "skipped", "sample: not found"
        return
    out = await asyncio.to_thread(cap.writer.tool_output, "native/sample.txt")
    result = await cap.runner(macos.sample_command(cap.req.pid, out), macos.SAMPLE_SECONDS + 15)
    await _register_tool_output(cap, rec, "native/sample.txt", result)
    # sample's call graph, read: every thread's heaviest native path (MLX/Metal threads marked)
    report = await asyncio.to_thread(
        lambda: macos.parse_sample(out.read_text(errors="replace")) if out.exists() else None)
    if report is not None:
        cap.native_findings = report.findings()
        await cap.write_json("native/sample-threads.json", {
            "process": report.process, "findings": report.findings(), "threads": [vars(t) for t in report.threads]})


async def _spindump(cap: _Capture, rec: _Step) -> None:
    if not macos.is_macos():
        rec.outcome, rec.error = "skipped", "spindump: not available on this OS (macOS only)"
        return
    if os.geteuid() != 0 and not cap.req.sudo:
        rec.outcome, rec.error = "skipped", "spindump needs root: run as root or set capture.sudo"
        return
    # The report comes on stdout and is written here: a file spindump wrote under sudo would be
    # root's, neither private nor readable by this daemon.
    result = await cap.runner(macos.spindump_command(cap.req.pid, sudo=cap.req.sudo and os.geteuid() != 0),
                              macos.SAMPLE_SECONDS + 30)
    if result.stdout:
        await cap.write("native/spindump.txt", result.stdout)
    if not result.ok:
        rec.outcome, rec.error = "failed", result.error


async def _register_tool_output(cap: _Capture, rec: _Step, relname: str, result) -> None:
    """Tools that write their own file: list it in the manifest (or record why there is none)."""
    await asyncio.to_thread(cap.writer.adopt, relname)
    if not result.ok:
        rec.outcome, rec.error = "failed", result.error


async def _crash_reports(cap: _Capture, rec: _Step) -> None:
    if not macos.is_macos():
        rec.outcome, rec.error = "skipped", "crash reports: macOS only"
        return
    since = cap.process.get("create_time") or macos.since_default()

    def collect() -> None:
        for path in macos.recent_crash_reports(cap.req.pid, since):
            with open(path, "rb") as fh:
                cap.write_blocking(f"crash/{path.name}", fh.read(16 * 1024 * 1024))

    await asyncio.to_thread(collect)


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
        with open_regular(path) as fh:
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


async def _log(cap: _Capture, rec: _Step, before: Awaitable[dict[int, int]] | None) -> None:
    if cap.req.log is None:
        rec.outcome, rec.error = "skipped", "no server log given (--log or the instance's log)"
        return
    read = await asyncio.to_thread(_read_log, cap.req.log, cap.log_followers, cap.req.log_tail_lines)
    if read is None:
        rec.outcome, rec.error = "failed", f"log not found: {cap.req.log}"
        return
    cap.markers, tail, gained = read
    await cap.write("log-tail.txt", tail)
    await cap.write_json("log-markers.json", cap.markers.to_dict())
    if before is not None:
        cap.log_before = await before
    cap.log_window_text = gained


async def _versions(cap: _Capture, rec: _Step) -> None:
    cap.versions = await asyncio.to_thread(server_versions, cap.process.get("cmdline") or [], cap.process.get("exe"))
    cap.versions["mlxwatch"] = __version__
    cap.versions["watcher_python"] = platform.python_version()
    await cap.write_json("versions.json", cap.versions)


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
    (``verdict.progress.prompt_advances``); ``before`` maps each prompt's Y to the last X seen
    before the window. Admission lines are counted apart, for the current server process only:
    they are not progress."""
    advances, _ = prompt_advances(gained.splitlines(), before, probe_totals)
    return LogWindow(advances=advances, admissions=completions_ok(since_last_start(gained)))


def _probe_totals(cap: _Capture) -> set[int]:
    """The prompt sizes (Y of X/Y) the capture's and the watchdog's probes were seen to have."""
    totals = {k.total for k in cap.report.generation.keepalives} if cap.report is not None else set()
    for prior in cap.req.prior_probes:
        for k in (prior.get("generation") or {}).get("keepalives") or []:
            if isinstance(k, dict) and isinstance(k.get("total"), int):
                totals.add(k["total"])
    return totals


def _evidence(cap: _Capture) -> tuple[Evidence, LogWindow | None]:
    ev = Evidence(verdict=cap.req.verdict, native_findings=list(cap.native_findings))
    ev.process_alive = "process" not in cap.process.get("errors", {}) and cap.window.gone_at is None
    if ev.process_alive and cap.req.pid is not None and cap.process.get("create_time"):
        # Still the same process now (same PID and create time, not a zombie)?
        ev.process_alive = ProcessIdentity(cap.req.pid, cap.process["create_time"], ()).alive()
    ev.process_statuses = cap.window.statuses()
    ev.snapshots = [threads for _, threads in cap.snapshots]
    ev.stacks_error = cap.stacks_error
    gens = [stacks.generation_thread(t) for t in ev.snapshots]
    tid = next((g.os_thread_id for g in gens if g is not None), None)
    ev.generation_cpu = cap.window.thread_cpu_percent(tid)
    ev.process_cpu = cap.window.cpu_percent()
    if cap.report is not None:
        gen = cap.report.generation
        ev.probe_ran = True
        ev.probe_ok = cap.report.healthy
        ev.probe_tokens = gen.tokens
        ev.probe_failure = cap.report.failure
        done = [k.processed for k in gen.keepalives]
        ev.probe_keepalive_advanced = len(set(done)) > 1
        ev.health_status = cap.report.health.status
        ev.models_status = cap.report.models.status
        ev.endpoints_answered = cap.report.health.answered or cap.report.models.answered
    ev.log = cap.markers
    if cap.shim_window is not None:
        ev.shim = cap.shim_window.findings(cap.report.generation.tokens if cap.report is not None else 0)
    window = None
    if cap.markers is not None and cap.log_window_text is not None:
        window = log_window(cap.log_before, cap.log_window_text, _probe_totals(cap))
        ev.log_progress_advanced = bool(window.advances)
        ev.log_progress_now = window.advances[-1] if window.advances else None
        ours = 1 if cap.report is not None and cap.report.generation.status == 200 else 0
        ev.log_admissions = max(0, window.admissions - ours)
    return ev, window


def _finish(cap: _Capture) -> Bundle:
    """Classify and write the bundle (blocking: run in a worker thread)."""
    req = cap.req
    evidence, window = _evidence(cap)
    classification = classify(evidence)
    manifest = {
        "created_at": datetime.now(timezone.utc).isoformat(),
        "host": socket.gethostname(),
        "mlxwatch": __version__,
        "platform": sys.platform,
        "target": {"pid": req.pid, "label": req.label, "url": req.url, "log": str(req.log) if req.log else None,
                   "create_time": cap.process.get("create_time"), "cmdline": cap.process.get("cmdline")},
        "verdict": req.verdict,
        "settings": {"snapshots": req.snapshots, "spacing": req.spacing, "ceiling": req.ceiling, "sudo": req.sudo,
                     "probe_first_token_timeout": cap.probe_first_token, "probe_linger": req.probe_linger,
                     "stacks": req.stacks, "redact": req.redact},
        "duration": round(cap.now(), 3),
        "steps": [s.to_dict() for s in cap.steps],
        "cpu": {"process": evidence.process_cpu, "generation_thread": evidence.generation_cpu,
                "statuses": evidence.process_statuses},
        "log_window": window.to_dict() if window else None,
        "shim": cap.shim_window.to_dict() if cap.shim_window is not None else None,
        "versions": cap.versions,
        "classification": classification.to_dict(),
    }
    manifest = redact_json(manifest, cap.redaction)  # the command line, the verdict, step errors
    summary = redact_text(render_summary(manifest, cap.snapshots, cap.markers.to_dict() if cap.markers else None),
                          cap.redaction)
    path = cap.writer.finish(manifest, summary)
    prune(req.out_dir, req.keep, req.max_bytes, protect=path, keep_days=req.keep_days)
    return Bundle(path, classification, cap.writer.manifest)
