"""``mlxwatch demo``: the whole job on a machine with no server configured.

Makes a tiny random model, starts a real ``mlx_lm.server`` through the fault wrapper on a free
loopback port, runs the real watchdog on it with a fast config, switches a livelock on, and
shows detection, the bundle and its classification, the restart and the recovery. Then it
stops the server it started (by its PID only) and removes the model; the bundle and the
journal are kept so they can be read afterwards. Ctrl-C or SIGTERM at any point, the server's
start included, stops that server too and removes the whole directory (``Terminated`` for
SIGTERM, KeyboardInterrupt for Ctrl-C). It prints nothing itself: it tells a
``DemoProgress`` (``mlxwatch.output.demo.DemoView``) each step, and returns a ``DemoResult``::

    result = run_demo(DemoView(console), keep=False)
    render_demo_report(result, console)
    sys.exit(0 if result.ok else 1)
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Iterator, Protocol

from mlxwatch.config import (
    CaptureConfig,
    Config,
    InstanceConfig,
    ProbeConfig,
    RestartConfig,
    state_dir_for,
)
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.errors import Terminated, UsageError
from mlxwatch.journal.incidents import Journal

DEMO_PROBE = ProbeConfig(interval=2.0, first_token_timeout=3.0, timeout=6.0, failures=2, grace_ceiling=30.0,
                         endpoint_timeout=2.0, startup_timeout=90.0)
HEALTHY_WAIT, INCIDENT_WAIT = 60.0, 240.0


def demo_config(server_dir: Path, url: str, log: Path, pid_file: Path, state_dir: Path) -> Config:
    """The fast config the demo watches with; restart = relaunch the lab server it owns."""
    restart = RestartConfig(method="command", argv=(sys.executable, "-m", "mlxwatch._lab.relaunch", str(server_dir)),
                            timeout=120.0, backoff=5.0)
    inst = InstanceConfig("demo", url, log, pid_file, DEMO_PROBE, restart)
    return Config(None, (inst,), state_dir, (), CaptureConfig(snapshots=3, spacing=1.0, ceiling=30.0))


class DemoProgress(Protocol):
    """Who hears each step of the demo as it happens (the CLI's ``DemoView``)."""

    def log_handler(self) -> logging.Handler: ...
    def starting(self, mlx_lm_version: str) -> None: ...
    def server_started(self, pid: int, url: str, log: Path) -> None: ...
    def never_healthy(self) -> None: ...
    def fault_on(self) -> None: ...
    def recovered(self, seconds: float) -> None: ...
    def not_recovered(self) -> None: ...


@dataclass(frozen=True)
class DemoResult:
    """How the demo ended and what it left on disk."""

    ok: bool
    records: list[dict[str, Any]]  # the demo instance's journal records, oldest first
    state_dir: Path
    journal: Path
    kept: Path | None  # the server dir (its log and the model), with --keep
    summary_head: str | None  # the bundle's summary.md before its thread stacks


def run_demo(progress: DemoProgress, keep: bool = False) -> DemoResult:
    if importlib.util.find_spec("mlx_lm") is None:
        raise UsageError("demo: needs mlx-lm in this environment: pip install 'mlxwatch[demo]'")
    from mlxwatch._lab.server import SPEC_NAME, LabServer, server_version

    workdir = Path(tempfile.mkdtemp(prefix="mlxwatch-demo-"))
    server_dir, state_dir = workdir / "server", workdir / "state"
    server: LabServer | None = None
    finished = False
    with _terminate_as_interrupt():
        try:
            progress.starting(server_version(sys.executable))
            server = LabServer.start(sys.executable, server_dir)
            progress.server_started(server.pid, server.url, server.log_path)
            config = demo_config(server_dir, server.url, server.log_path, server.pid_file, state_dir)
            ok = asyncio.run(_watch(progress, config, server))
            finished = True
        finally:
            with _signals_held():
                # The server recorded in lab.json (by PID and create time), whoever started it last:
                # us, or the restart hook. An interrupted LabServer.start has ended its own already.
                if server is None and (server_dir / SPEC_NAME).exists():
                    server = LabServer.load(server_dir)
                if server is not None:
                    server.stop()
                if not keep:  # interrupted: no report names the directory, so none of it is kept
                    shutil.rmtree(server_dir if finished else workdir, ignore_errors=True)
    return demo_result(Journal(state_dir), state_dir, server_dir if keep else None, ok)


@contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the demo the way Ctrl-C does at that moment (``asyncio.run`` cancels the
    watch, elsewhere KeyboardInterrupt), so that the cleanup runs; it surfaces as ``Terminated``."""
    terminated = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        nonlocal terminated
        terminated = True
        on_sigint = signal.getsignal(signal.SIGINT)
        if callable(on_sigint):
            on_sigint(signum, frame)
        else:  # SIGINT ignored (a background job): still stop
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    except KeyboardInterrupt:
        if terminated:
            raise Terminated from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def _signals_held() -> Iterator[None]:
    """The cleanup is not cut short: SIGINT and SIGTERM arriving meanwhile are delivered after it."""
    held = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


async def _watch(progress: DemoProgress, config: Config, server) -> bool:
    handler = progress.log_handler()
    logger = logging.getLogger("mlxwatch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    stop = asyncio.Event()
    daemon = Daemon(config, state_dir_for(config))
    runner = asyncio.create_task(daemon.run(stop))
    journal = Journal(state_dir_for(config))
    try:
        if not await _until(lambda: _state(daemon) == "healthy" and _last_ok(daemon), HEALTHY_WAIT):
            progress.never_healthy()
            return False
        progress.fault_on()
        server.set_fault("spin")
        t0 = time.monotonic()
        recovered = await _until(lambda: any(r["event"] == "recovered" for r in journal.records()), INCIDENT_WAIT)
        if recovered:
            progress.recovered(time.monotonic() - t0)
        else:
            progress.not_recovered()
        return recovered
    finally:
        stop.set()
        await runner
        logger.removeHandler(handler)


def _state(daemon: Daemon) -> str | None:
    watcher = daemon.watchers.get("demo")
    return watcher.detect.state if watcher else None


def _last_ok(daemon: Daemon) -> bool:
    probe = daemon.instance_state("demo").get("last_probe") or {}
    return bool(probe.get("ok"))


async def _until(predicate, timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.25)
    return False


def demo_result(journal: Journal, state_dir: Path, kept: Path | None = None, ok: bool = True) -> DemoResult:
    """The demo's records from ``journal`` and the head of its last bundle's summary."""
    records = [r for r in journal.records() if r.get("instance") == "demo"]
    bundle = records[-1].get("bundle") if records else None
    head = None
    if bundle:
        head = (Path(bundle) / "summary.md").read_text().split("## Generation thread")[0].strip()
    return DemoResult(ok, records, state_dir, journal.path, kept, head)
