"""The daemon's memory watch end to end on a loopback stand-in: the trend warns once, and the
opt-in early restart restarts the server at a quiet moment, through the restart method, once.
The stand-in's memory is read through the watcher's one seam (``read_memory``), fed a steady
growth the test sets; everything else (probes, identity, journal, restart path) is real."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from mlxwatch.config import MemoryConfig, RestartConfig
from mlxwatch.daemon import memwatch
from mlxwatch.daemon import watcher as watcher_module
from mlxwatch.host.memuse import MemoryReading
from mlxwatch.restart.methods import OK, RestartOutcome
from test_daemon_core import FAST, Running, config

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def trend_drawn_soon(monkeypatch):
    """A trend from readings over 1.5 s, not 5 s (memwatch.MIN_SPAN; test_memory_units holds the
    rule): each test here waited those 5 s for its first warning, at 200 MiB/s and 6 readings."""
    monkeypatch.setattr(memwatch, "MIN_SPAN", 1.5)


def growing(rate_mib: float, limit_mib: float = 4096):
    """A server that grows ``rate_mib`` MiB/s from 100 MiB toward ``limit_mib``, as read now."""
    start = time.monotonic()

    def read(pid: int) -> MemoryReading:
        used = int((100 + rate_mib * (time.monotonic() - start)) * MiB)
        return MemoryReading(used, "rss", int(limit_mib * MiB), int(limit_mib * MiB) - used, "cgroup /lab")
    return read


async def test_restart_early_restarts_a_growing_server_once_through_its_restart_method(tmp_path, standin, monkeypatch):
    (url,), _, proc = standin("ok")
    pid_file = tmp_path / "server.pid"
    pid_file.write_text(str(proc.pid))
    monkeypatch.setattr(watcher_module, "read_memory", growing(200.0))  # ~20 s to the limit: within 10 min
    asked = []

    async def restart_fn(ctx):
        asked.append(ctx)
        return RestartOutcome(OK, "restarted (test)")

    cfg = config(tmp_path / "state", url, RestartConfig("command", argv=("true",)), replace(FAST, interval=0.3))
    inst = replace(cfg.instances[0], pid_file=pid_file, memory=MemoryConfig(restart_early=True, restart_within=600.0))
    cfg = replace(cfg, instances=(inst,))
    async with Running(cfg, restart_fn=restart_fn) as run:
        await run.until(lambda: "memory_restart" in run.events(), timeout=30, what="an early restart")
        await run.until(lambda: (run.daemon.state.instance("gone").get("last_probe") or {}).get("ok")
                        and run.daemon.state.instance("gone").get("state") == "healthy", what="healthy again")
        await asyncio.sleep(1.0)  # more readings of the same process: no second restart
    events = run.events()
    assert events.count("memory_low") == 1 and events.count("memory_restart") == 1
    assert len(asked) == 1 and asked[0].identity is not None and asked[0].identity.pid == proc.pid
    assert "verdict" not in events  # a planned restart, not an incident
    record = next(r for r in run.journal.records() if r["event"] == "memory_restart")
    assert record["pid"] == proc.pid and record["minutes_left"] * 60 <= 600


async def test_without_restart_early_it_only_warns(tmp_path, standin, monkeypatch):
    (url,), _, proc = standin("ok")
    pid_file = tmp_path / "server.pid"
    pid_file.write_text(str(proc.pid))
    monkeypatch.setattr(watcher_module, "read_memory", growing(200.0))
    asked = []

    async def restart_fn(ctx):
        asked.append(ctx)
        return RestartOutcome(OK, "restarted (test)")

    cfg = config(tmp_path / "state", url, RestartConfig("command", argv=("true",)), replace(FAST, interval=0.3))
    cfg = replace(cfg, instances=(replace(cfg.instances[0], pid_file=pid_file),))
    async with Running(cfg, restart_fn=restart_fn) as run:
        await run.until(lambda: "memory_low" in run.events(), timeout=30, what="the warning")
        await asyncio.sleep(1.0)
        memory = run.daemon.state.instance("gone")["memory"]
    assert asked == [] and "memory_restart" not in run.events()
    assert memory["bound"] == "cgroup /lab" and 0 < memory["minutes_left"] < 1


async def test_restart_early_never_restarts_when_no_source_sees_every_client(tmp_path, standin, monkeypatch):
    """Kernel sight off and no front door: a client's stream would be invisible, so no moment is
    known to be quiet: it warns, and does not restart."""
    (url,), _, proc = standin("ok")
    pid_file = tmp_path / "server.pid"
    pid_file.write_text(str(proc.pid))
    monkeypatch.setattr(watcher_module, "read_memory", growing(200.0))
    asked = []

    async def restart_fn(ctx):
        asked.append(ctx)
        return RestartOutcome(OK, "restarted (test)")

    cfg = config(tmp_path / "state", url, RestartConfig("command", argv=("true",)), replace(FAST, interval=0.3))
    inst = replace(cfg.instances[0], pid_file=pid_file, kernel="off",
                   memory=MemoryConfig(restart_early=True, restart_within=600.0))
    async with Running(replace(cfg, instances=(inst,)), restart_fn=restart_fn) as run:
        await run.until(lambda: "memory_low" in run.events(), timeout=30, what="the warning")
        await asyncio.sleep(2.0)  # several readings within restart_within
    assert asked == [] and "memory_restart" not in run.events()
