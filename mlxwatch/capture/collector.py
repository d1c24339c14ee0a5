"""Capture an evidence bundle from a live (possibly hung) server, within a hard time ceiling.

Steps, each with its own timeout, none able to abort another (a failed step is recorded with
its error and the bundle is still written)::

    phase 1, together:  stack snapshots (py-spy, spaced in time) | CPU sampling | one probe
    phase 2:            macOS sample / spindump / crash reports | log tail and markers | versions
    then:               classification, summary.md, manifest.json, rename into place

Usage::

    bundle = await capture_bundle(CaptureRequest(pid=1234, out_dir=Path("bundles"), url=url))
    print(bundle.path, bundle.classification.kind)
"""

from __future__ import annotations

import asyncio
import os
import platform
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Awaitable, Callable

from mlxwatch import __version__
from mlxwatch.capture import macos, pyspy
from mlxwatch.capture.bundle import BundleWriter, prune
from mlxwatch.capture.classify import Classification, Evidence, classify
from mlxwatch.capture.commands import Runner, run_command
from mlxwatch.capture.procstats import ProcessWindow, describe_process, sample_process
from mlxwatch.capture.summary import render_summary
from mlxwatch.capture.versions import server_versions
from mlxwatch.process import ProcessIdentity
from mlxwatch.serverlog import read_recent, scan, since_last_start, tail_lines

DUMP_TIMEOUT = 10.0
FINISH_RESERVE = 2.0  # seconds of the ceiling kept for classifying and writing

StepCallback = Callable[[str, str], None]  # (step name, "start" | outcome)


@dataclass
class CaptureRequest:
    pid: int | None  # None: no server process could be found (it is gone)
    out_dir: Path
    label: str | None = None
    url: str | None = None
    log: Path | None = None
    snapshots: int = 3
    spacing: float = 2.0
    ceiling: float = 60.0
    sudo: bool = False
    log_tail_lines: int = 400
    probe_first_token_timeout: float = 10.0
    probe_timeout: float = 20.0
    prior_probes: list[dict] = field(default_factory=list)  # the watchdog's failed probes
    keep: int = 50
    max_bytes: int = 2 * 1024**3


@dataclass
class Bundle:
    path: Path
    classification: Classification
    manifest: dict[str, Any]


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
        self.writer = BundleWriter(req.out_dir, req.label or f"pid-{req.pid}")
        self.steps: list[_Step] = []
        self.snapshots: list[tuple[float, list[pyspy.ThreadStack]]] = []
        self.stacks_error: str | None = None
        self.window = ProcessWindow()
        self.report: Any = None
        self.markers_before = None
        self.markers = None
        self.process: dict = {}
        self.versions: dict = {}

    def now(self) -> float:
        return time.monotonic() - self.t0

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


async def capture_bundle(req: CaptureRequest, *, runner: Runner = run_command, on_step: StepCallback | None = None) -> Bundle:
    """Capture, classify and write one bundle. Raises only if the bundle itself cannot be written."""
    cap = _Capture(req, runner, on_step)
    cap.markers_before = scan(since_last_start(read_recent(req.log))) if req.log else None
    await cap.step("process", lambda rec: _process(cap, rec))
    window_seconds = max(0.5, (req.snapshots - 1) * req.spacing + 0.5)
    await cap.phase(
        cap.step("stacks", lambda rec: _stacks(cap, rec)),
        cap.step("cpu", lambda rec: _cpu(cap, rec, window_seconds)),
        cap.step("probe", lambda rec: _probe(cap, rec)),
    )
    await cap.phase(
        cap.step("sample", lambda rec: _sample(cap, rec)),
        cap.step("spindump", lambda rec: _spindump(cap, rec)),
        cap.step("crash_reports", lambda rec: _crash_reports(cap, rec)),
        cap.step("log", lambda rec: _log(cap, rec)),
        cap.step("versions", lambda rec: _versions(cap, rec)),
    )
    return _finish(cap)


async def _process(cap: _Capture, rec: _Step) -> None:
    if cap.req.pid is None:
        cap.process = {"pid": None, "errors": {"process": "no server process found"}}
        rec.outcome, rec.error = "failed", "no server process found (nothing listening on the port)"
        return
    cap.process = describe_process(cap.req.pid)
    cap.writer.write_json("process.json", cap.process)
    if "process" in cap.process["errors"]:
        rec.outcome, rec.error = "failed", f"no process with PID {cap.req.pid}"


async def _stacks(cap: _Capture, rec: _Step) -> None:
    req = cap.req
    if req.pid is None or "process" in cap.process.get("errors", {}):
        rec.outcome, rec.error = "skipped", "no process to inspect"
        cap.stacks_error = rec.error
        return
    exe = pyspy.find_py_spy()
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
    for i in range(1, req.snapshots + 1):
        if i > 1:
            await asyncio.sleep(req.spacing)
        at = cap.now()
        result = await cap.runner(pyspy.dump_command(exe, req.pid, as_json=True, native=False, sudo=req.sudo), DUMP_TIMEOUT)
        nonblocking = False
        if not result.ok and not _missing_or_denied(result.error):
            # A SIGSTOPped target cannot be suspended again ("Failed to suspend process" or
            # "Failed to get stack traces"); --nonblocking reads it anyway.
            nonblocking = True
            result = await cap.runner(pyspy.dump_command(exe, req.pid, as_json=True, native=False, nonblocking=True, sudo=req.sudo), DUMP_TIMEOUT)
        if not result.ok:
            errors.append(f"snapshot {i}: {result.error}")
            continue
        try:
            threads = pyspy.parse_dump_json(result.stdout.decode("utf-8", "replace"))
        except ValueError as exc:
            errors.append(f"snapshot {i}: unreadable py-spy JSON: {exc}")
            continue
        cap.snapshots.append((at, threads))
        cap.writer.write(f"stacks/pyspy-{i}.json", result.stdout)
        text = await cap.runner(pyspy.dump_command(exe, req.pid, as_json=False, native=native and not nonblocking,
                                                   nonblocking=nonblocking, sudo=req.sudo), DUMP_TIMEOUT)
        header = f"# py-spy dump {i} at +{at:.2f}s ({datetime.now(timezone.utc).isoformat()})" \
                 f"{' --native' if native and not nonblocking else ''}{' --nonblocking' if nonblocking else ''}\n"
        cap.writer.write(f"stacks/pyspy-{i}.txt", header + (text.stdout.decode("utf-8", "replace") if text.ok else f"# failed: {text.error}\n"))
    if errors:
        cap.stacks_error = "; ".join(errors)
        rec.error = cap.stacks_error
        rec.outcome = "failed" if not cap.snapshots else "ok"


def _missing_or_denied(error: str | None) -> bool:
    text = (error or "").lower()
    return any(w in text for w in ("not found", "no such process", "permission denied", "operation not permitted"))


async def _cpu(cap: _Capture, rec: _Step, seconds: float) -> None:
    if cap.req.pid is None:
        rec.outcome, rec.error = "skipped", "no process to inspect"
        return
    cap.window = await sample_process(cap.req.pid, seconds)
    cap.writer.write_json("procstats.json", cap.window.to_dict())
    if cap.window.errors:
        rec.error = "; ".join(cap.window.errors)


async def _probe(cap: _Capture, rec: _Step) -> None:
    from mlxwatch.probes import make_client, run_check

    if cap.req.prior_probes:
        cap.writer.write_json("probes-before.json", cap.req.prior_probes)
    if not cap.req.url:
        rec.outcome, rec.error = "skipped", "no URL given (--url or --instance)"
        return
    async with make_client() as client:
        cap.report = await run_check(client, cap.req.url, first_token_timeout=cap.req.probe_first_token_timeout,
                                     timeout=cap.req.probe_timeout, endpoint_timeout=5.0)
    cap.writer.write_json("probe.json", cap.report.to_dict())
    if not cap.report.healthy:
        rec.error = f"probe: {cap.report.reason}"  # evidence, not a step failure


async def _sample(cap: _Capture, rec: _Step) -> None:
    if not macos.is_macos():
        rec.outcome, rec.error = "skipped", "sample: not available on this OS (macOS only)"
        return
    if not macos.tool_available("sample"):
        rec.outcome, rec.error = "skipped", "sample: not found"
        return
    out = cap.writer.tool_output("native/sample.txt")
    result = await cap.runner(macos.sample_command(cap.req.pid, out), macos.SAMPLE_SECONDS + 15)
    _register_tool_output(cap, rec, "native/sample.txt", result)


async def _spindump(cap: _Capture, rec: _Step) -> None:
    if not macos.is_macos():
        rec.outcome, rec.error = "skipped", "spindump: not available on this OS (macOS only)"
        return
    if os.geteuid() != 0 and not cap.req.sudo:
        rec.outcome, rec.error = "skipped", "spindump needs root: run as root or set capture.sudo"
        return
    out = cap.writer.tool_output("native/spindump.txt")
    result = await cap.runner(macos.spindump_command(cap.req.pid, out, sudo=cap.req.sudo and os.geteuid() != 0),
                              macos.SAMPLE_SECONDS + 30)
    _register_tool_output(cap, rec, "native/spindump.txt", result)


def _register_tool_output(cap: _Capture, rec: _Step, relname: str, result) -> None:
    """Tools that write their own file: list it in the manifest (or record why there is none)."""
    cap.writer.adopt(relname)
    if not result.ok:
        rec.outcome, rec.error = "failed", result.error


async def _crash_reports(cap: _Capture, rec: _Step) -> None:
    if not macos.is_macos():
        rec.outcome, rec.error = "skipped", "crash reports: macOS only"
        return
    since = cap.process.get("create_time") or macos.since_default()
    for path in macos.recent_crash_reports(cap.req.pid, since):
        cap.writer.copy(f"crash/{path.name}", path)


async def _log(cap: _Capture, rec: _Step) -> None:
    if cap.req.log is None:
        rec.outcome, rec.error = "skipped", "no server log given (--log or the instance's log)"
        return
    if not cap.req.log.exists():
        rec.outcome, rec.error = "failed", f"log not found: {cap.req.log}"
        return
    text = read_recent(cap.req.log)
    cap.markers = scan(since_last_start(text))
    cap.writer.write("log-tail.txt", "\n".join(tail_lines(text, cap.req.log_tail_lines)) + "\n")
    cap.writer.write_json("log-markers.json", cap.markers.to_dict())


async def _versions(cap: _Capture, rec: _Step) -> None:
    cap.versions = server_versions(cap.process.get("cmdline") or [], cap.process.get("exe"))
    cap.versions["mlxwatch"] = __version__
    cap.versions["watcher_python"] = platform.python_version()
    cap.writer.write_json("versions.json", cap.versions)


def _evidence(cap: _Capture) -> Evidence:
    ev = Evidence()
    ev.process_alive = "process" not in cap.process.get("errors", {}) and cap.window.gone_at is None
    if ev.process_alive and cap.req.pid is not None and cap.process.get("create_time"):
        # Still the same process now (same PID and create time, not a zombie)?
        ev.process_alive = ProcessIdentity(cap.req.pid, cap.process["create_time"], ()).alive()
    ev.process_statuses = cap.window.statuses()
    ev.snapshots = [threads for _, threads in cap.snapshots]
    ev.stacks_error = cap.stacks_error
    gens = [pyspy.generation_thread(t) for t in ev.snapshots]
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
    if cap.markers and cap.markers_before:
        ev.log_progress_advanced = cap.markers.progress_count > cap.markers_before.progress_count
        ev.log_completions_advanced = cap.markers.completion_count > cap.markers_before.completion_count + (1 if ev.probe_ran else 0)
    return ev


def _finish(cap: _Capture) -> Bundle:
    req = cap.req
    evidence = _evidence(cap)
    classification = classify(evidence)
    manifest = {
        "created_at": datetime.now(timezone.utc).isoformat(),
        "host": socket.gethostname(),
        "mlxwatch": __version__,
        "platform": sys.platform,
        "target": {"pid": req.pid, "label": req.label, "url": req.url, "log": str(req.log) if req.log else None,
                   "create_time": cap.process.get("create_time"), "cmdline": cap.process.get("cmdline")},
        "settings": {"snapshots": req.snapshots, "spacing": req.spacing, "ceiling": req.ceiling, "sudo": req.sudo},
        "duration": round(cap.now(), 3),
        "steps": [s.to_dict() for s in cap.steps],
        "cpu": {"process": evidence.process_cpu, "generation_thread": evidence.generation_cpu,
                "statuses": evidence.process_statuses},
        "versions": cap.versions,
        "classification": classification.to_dict(),
    }
    summary = render_summary(manifest, cap.snapshots, cap.markers.to_dict() if cap.markers else None)
    path = cap.writer.finish(manifest, summary)
    prune(req.out_dir, req.keep, req.max_bytes, protect=path)
    return Bundle(path, classification, cap.writer.manifest)
