"""``mlxwatch demo``: the whole job on a machine with no server configured.

Makes a tiny random model, starts a real ``mlx_lm.server`` through the fault wrapper on a free
loopback port, runs the real watchdog on it with a fast config, switches a livelock on, and
shows detection, the bundle and its classification, the restart and the recovery. Then it
stops the server it started (by its PID only) and removes the model; the bundle and the
journal are kept so they can be read afterwards.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler

from mlxwatch.config import (
    CaptureConfig,
    Config,
    InstanceConfig,
    ProbeConfig,
    RestartConfig,
)
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.errors import UsageError
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


def run_demo(console: Console, keep: bool = False) -> int:
    if importlib.util.find_spec("mlx_lm") is None:
        raise UsageError("demo: needs mlx-lm in this environment: pip install 'mlxwatch[demo]'")
    from mlxwatch._lab.server import LabServer, server_version

    workdir = Path(tempfile.mkdtemp(prefix="mlxwatch-demo-"))
    server_dir, state_dir = workdir / "server", workdir / "state"
    console.rule("mlxwatch demo")
    console.print(f"Making a tiny random model and starting a real mlx_lm.server "
                  f"(mlx-lm {server_version(sys.executable)}) on 127.0.0.1 ...")
    server = LabServer.start(sys.executable, server_dir)
    console.print(f"Server PID {server.pid} at {server.url}, log {server.log_path}")
    config = demo_config(server_dir, server.url, server.log_path, server.pid_file, state_dir)
    try:
        ok = asyncio.run(_watch(console, config, server))
    finally:
        server.stop()
        if not keep:
            shutil.rmtree(server_dir, ignore_errors=True)
    _report(console, Journal(state_dir), state_dir, server_dir if keep else None)
    return 0 if ok else 1


async def _watch(console: Console, config: Config, server) -> bool:
    handler = RichHandler(console=console, show_path=False, markup=False)
    logger = logging.getLogger("mlxwatch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    stop = asyncio.Event()
    daemon = Daemon(config, config.state_dir)
    runner = asyncio.create_task(daemon.run(stop))
    journal = Journal(config.state_dir)
    try:
        if not await _until(lambda: _state(daemon) == "healthy" and _last_ok(daemon), HEALTHY_WAIT):
            console.print("[red]the server never looked healthy; see its log[/]")
            return False
        console.print("[green]Healthy:[/] probes get tokens. Now switching on a livelock: the batch loop "
                      "keeps stepping and burning CPU, but no token reaches any client; /v1/models stays 200.")
        server.set_fault("spin")
        t0 = time.monotonic()
        recovered = await _until(lambda: any(r["event"] == "recovered" for r in journal.records()), INCIDENT_WAIT)
        if recovered:
            console.print(f"[green]Recovered[/] {time.monotonic() - t0:.1f}s after the livelock was switched on.")
        else:
            console.print("[red]no recovery within the demo's time limit[/]")
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


def _report(console: Console, journal: Journal, state_dir: Path, kept: Path | None = None) -> None:
    """What happened, and what is left on disk (``kept``: the server dir, with ``--keep``)."""
    records = [r for r in journal.records() if r.get("instance") == "demo"]
    if not records:
        console.print(f"Kept {state_dir} (journal and state); the server was stopped"
                      + (f", its log and the model are kept in {kept}." if kept else " and the model removed."),
                      markup=False, highlight=False)
        return
    last = records[-1]
    console.rule("incident")
    first = last.get("first_failure_at") or 0
    for r in records:
        at = f"+{r['ts'] - first:5.1f}s" if first else ""
        console.print(f"{at:>8}  {r['event']}", markup=False)
    console.print(f"classification: [bold]{last.get('kind')}[/] ({last.get('confidence')} confidence)")
    console.print(f"bundle:         {last.get('bundle')}", markup=False, highlight=False)
    if last.get("bundle"):
        summary = (Path(last["bundle"]) / "summary.md").read_text().split("## Generation thread")[0]
        console.print(summary.strip(), markup=False)
    if last.get("seconds_to_recovery") is not None:
        console.print(f"recovered {last['seconds_to_recovery']:.1f}s after the first failed probe")
    console.print(f"journal:        {journal.path}", markup=False, highlight=False)
    if kept:
        console.print(f"Kept {state_dir} (bundle and journal) for you to read; the server was stopped, its log "
                      f"and the model are kept in {kept}.", markup=False, highlight=False)
    else:
        console.print(f"Kept {state_dir} (bundle and journal) for you to read; the server was stopped and the "
                      "model removed.", markup=False, highlight=False)
