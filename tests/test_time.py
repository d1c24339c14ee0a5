"""Durations on the monotonic clock, the wall clock for records only: a wall-clock step (an NTP
resync, a VM without a timezone) bends no backoff, grace, budget or cooldown, and the budget
and the cooldown outlive a daemon restart, with or without a step in between.

The daemon tests watch the lab's stand-in server (see test_daemon_core.py) with a clock whose
wall reading the test steps at will, without sleeping.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import replace

import psutil
import pytest
from test_daemon_core import FAST, Running, config

from mlxwatch.capture import bundle
from mlxwatch.clock import Clock, Stamp, boot_id
from mlxwatch.config import RestartConfig
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.restart import lookagain
from mlxwatch.restart.flapguard import FlapGuard
from mlxwatch.restart.methods import OK, RestartOutcome
from mlxwatch.shim import heartbeat, layout

HOUR = 3600.0


class SteppedClock(Clock):
    """The real clocks, with the wall clock stepped by ``step`` seconds whenever the test says."""

    def __init__(self, step: float = 0.0, boot: str | None = None) -> None:
        self.step = step
        super().__init__(monotonic=time.monotonic, wall=lambda: time.time() + self.step, boot=boot or boot_id())


class FakeClock(Clock):
    """Both readings set by hand (unit tests of the rules)."""

    def __init__(self, mono: float, wall: float, boot: str = "boot-a") -> None:
        self.m, self.w = mono, wall
        super().__init__(monotonic=lambda: self.m, wall=lambda: self.w, boot=boot)


def stand_in_restart(mode_file=None):
    """A restart hook that "restarts" the stand-in: it answers again if ``mode_file`` is given."""
    async def restart(ctx):
        if mode_file is not None:
            mode_file.write_text("ok")
        return RestartOutcome(OK, "stand-in restarted")
    return restart


async def test_a_wall_clock_stepped_back_after_a_restart_leaves_the_next_backoff_as_configured(tmp_path, standin):
    """Measured: the wall clock stepped back 1 h after a restart made the next hang wait
    "backing off 3612s before restarting again". The backoff is timed on the monotonic clock."""
    (url,), mode, _ = standin("hang")
    backoff = 2.0
    cfg = config(tmp_path / "state", url, RestartConfig("command", argv=("true",), backoff=backoff, max_backoff=backoff))
    clock = SteppedClock()
    async with Running(cfg, clock=clock, restart_fn=stand_in_restart(mode)) as run:
        await run.until(lambda: "recovered" in run.events(), what="the first restart to recover")
        clock.step = -HOUR
        mode.write_text("hang")
        await run.until(lambda: "backoff" in run.events() or run.events().count("restart") >= 2,
                        what="the second restart or its backoff")
        waits = [r["wait"] for r in run.journal.records() if r["event"] == "backoff"]
        assert all(w <= backoff for w in waits), f"backed off {waits}s, configured {backoff}s"
        await run.until(lambda: run.events().count("restart") >= 2, what="the second restart")


async def test_a_wall_clock_stepped_forward_in_grace_does_not_end_the_grace(tmp_path, standin):
    """Measured: the wall clock stepped forward 1 h while a busy server was in grace gave a
    verdict after 16.9 s instead of about 44 s. Grace is timed on the monotonic clock: the
    verdict still waits for grace_ceiling after the first failure."""
    (url,), _, _ = standin("hang")
    log = tmp_path / "server.log"
    log.write_text("")
    grace = 2.5  # the bug ended it at the step: any grace of seconds tells them apart
    probe = replace(FAST, failures=2, grace_ceiling=grace)
    cfg = config(tmp_path / "state", url, probe=probe, log=log)
    clock = SteppedClock()

    async def busy_server():  # another client's long prompt, advancing all along
        for x in range(1, 100_000):
            with log.open("a") as f:
                f.write(f"Prompt processing progress: {x}/100000\n")
            await asyncio.sleep(0.05)

    writer = asyncio.create_task(busy_server())
    try:
        async with Running(cfg, clock=clock) as run:
            watcher = lambda: run.daemon.watchers["gone"]  # noqa: E731
            await run.until(lambda: watcher().detect.state == "suspect", what="the first failed probe")
            first_failure = time.monotonic()
            clock.step = HOUR
            await run.until(lambda: "verdict" in run.events(), what="the verdict")
            verdict_after = time.monotonic() - first_failure
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
    verdict = next(r for r in run.journal.records() if r["event"] == "verdict")
    assert len(verdict["failures"]) >= 3  # progress held at least one verdict back
    assert verdict_after >= grace - 0.5, f"verdict {verdict_after:.1f}s after the first failure, grace {grace}s"


@pytest.mark.parametrize("step, same_boot", [(0.0, True), (-HOUR, True), (HOUR, True), (0.0, False), (-HOUR, False)],
                         ids=["no-step", "back-1h", "forward-1h", "reboot", "reboot-back-1h"])
async def test_budget_and_cooldown_survive_a_daemon_restart_and_a_clock_step(tmp_path, standin, step, same_boot):
    """A daemon that gave up (budget spent) is stopped, the wall clock may step, the daemon
    starts again: the instance is still given up, its restart still counts in the window,
    and nothing restarts before the cooldown. On the same boot the saved monotonic readings
    decide; after a reboot the wall times, clamped so that none lies in the future."""
    (url,), _, _ = standin("hang")
    restart = RestartConfig("command", argv=("true",), budget=1, window=1800.0, backoff=0.1, cooldown=1800.0)
    cfg = config(tmp_path / "state", url, restart, probe=replace(FAST, startup_timeout=1.0))
    async with Running(cfg, clock=SteppedClock(), restart_fn=stand_in_restart()) as run:
        await run.until(lambda: "gave_up" in run.events(), what="gave_up")
    events_before = len(run.events())
    clock = SteppedClock(step, boot=None if same_boot else "another-boot")
    async with Running(cfg, clock=clock, restart_fn=stand_in_restart()) as again:
        watcher = again.daemon.watchers["gone"]
        probes = []

        def probed() -> bool:
            at = (again.daemon.state.instance("gone").get("last_probe") or {}).get("at")
            if at is not None and at not in probes:
                probes.append(at)
            return len(probes) >= 3
        await again.until(probed, what="three probes")
        now = clock.monotonic()
        assert watcher.detect.state == "gave_up"
        assert watcher.guard.restarts_in_window(now) == 1
        assert not watcher.guard.cooled_down(now)
    later = [r["event"] for r in again.journal.records()[events_before:]]
    assert "resumed" not in later and "restarting" not in later, later


def test_saved_restart_times_are_restored_by_the_boot_rule():
    """Same boot: the monotonic readings, whatever the wall clock did. Another boot: the wall
    times' ages, clamped at zero, so a time from the future counts as now and holds a window
    or a cooldown for at most its own length."""
    g = FlapGuard(budget=2, window=1800, backoff=10, max_backoff=10, cooldown=3600)
    g.record_restart(Stamp(mono=100.0, wall=1_000_000.0))
    g.give_up(Stamp(mono=110.0, wall=1_000_010.0))
    saved = g.saved(FakeClock(110.0, 1_000_010.0))

    same_boot_stepped = FakeClock(mono=120.0, wall=1_000_020.0 + 86400)  # a day forward, 10 s later
    r = FlapGuard(2, 1800, 10, 10, 3600)
    assert r.restore(saved, same_boot_stepped) == []
    assert r.restarts == [Stamp(100.0, 1_000_000.0)] and r.gave_up_at == Stamp(110.0, 1_000_010.0)
    assert r.restarts_in_window(120.0) == 1 and not r.cooled_down(120.0) and r.cooled_down(110.0 + 3600)

    rebooted_back = FakeClock(mono=5.0, wall=1_000_020.0 - 86400, boot="boot-b")  # a day back
    r = FlapGuard(2, 1800, 10, 10, 3600)
    assert r.restore(saved, rebooted_back)  # said, once
    assert [t.mono for t in r.restarts] == [5.0] and r.gave_up_at.mono == 5.0  # now, not a day ahead
    assert r.restarts[0].wall == 1_000_000.0  # the record keeps its own wall time
    assert not r.cooled_down(5.0 + 3599) and r.cooled_down(5.0 + 3600)
    assert r.restarts_in_window(5.0 + 1799) == 1 and r.restarts_in_window(5.0 + 1800) == 0

    rebooted = FakeClock(mono=5.0, wall=1_000_020.0, boot="boot-b")  # 10 s after giving up, by the wall
    r = FlapGuard(2, 1800, 10, 10, 3600)
    assert r.restore(saved, rebooted) == []
    assert [t.mono for t in r.restarts] == [-15.0] and r.gave_up_at.mono == -5.0

    journal_only = {"restarts": [1_000_000.0], "gave_up_at": None}  # rebuilt from the journal: wall times only
    r = FlapGuard(2, 1800, 10, 10, 3600)
    r.restore(journal_only, FakeClock(mono=120.0, wall=1_000_020.0))
    assert [t.mono for t in r.restarts] == [100.0] and r.gave_up_at is None


def test_a_wall_clock_step_after_the_shim_published_does_not_make_its_heartbeat_stale(tmp_path):
    """The shim's heartbeat is read by the daemon, another process: its age is timed on the
    (system-wide) monotonic clock, so a wall clock stepped forward 1 h just after the shim
    published is not "no heartbeat for 3600s" (a false stall, a probe at once, a decisive
    failure)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    me = psutil.Process()
    wall_before_step = time.time() - HOUR  # the shim read the wall clock, then it stepped 1 h forward
    data = {"format": layout.FORMAT, "pid": me.pid, "started_at": me.create_time(), "interval": 1.0,
            "published_at": wall_before_step, "published_mono": time.monotonic() - 0.5,
            "seam": {"state": "ok"}, "loop": {"tokens": 5, "steps": 5, "in_flight": 1,
                                              "quiet_since": wall_before_step - 10.0}}
    (run / f"{me.pid}.json").write_text(json.dumps(data))
    hb, problem = heartbeat.read(me.pid, None, str(run))
    assert problem is None
    assert not hb.stale and hb.age < 60
    assert 10.0 <= hb.stalled_for < 70  # 10 s quiet before publishing, then the age


@pytest.mark.parametrize("step_between, reader_step", [(-HOUR, 0.0), (0.0, 3 * HOUR), (0.0, HOUR), (0.0, -HOUR),
                                                       (HOUR, HOUR), (-HOUR, -HOUR)])
def test_status_and_the_budget_metric_count_restarts_as_the_guard_does(tmp_path, step_between, reader_step):
    """Measured: after a -1 h wall-clock step the daemon gave up after 2 restarts (the guard
    counts by the monotonic clock), but `status` showed "RESTARTS 1 of 2", and "0 of 2" under a
    clock 3 h ahead: it counted the state file's wall times against its own wall clock. Status
    and the restart-budget gauge now read the saved times by the guard's rule."""
    from test_metrics import value

    from mlxwatch.daemon.metrics import Metrics
    from mlxwatch.daemon.status import collect_status
    from mlxwatch.journal.incidents import Journal
    from mlxwatch.journal.state import StateFile

    restart = RestartConfig("command", argv=("true",), budget=2, window=1800.0)
    cfg = config(tmp_path / "state", "http://127.0.0.1:1", restart, name="gemma")
    daemon_clock = SteppedClock()
    guard = FlapGuard(budget=2, window=1800.0, backoff=1.0, max_backoff=1.0, cooldown=3600.0)
    guard.record_restart(daemon_clock.now())
    daemon_clock.step = step_between  # the wall clock steps between the two restarts
    guard.record_restart(daemon_clock.now())
    guard.give_up(daemon_clock.now())
    assert guard.exhausted(daemon_clock.monotonic()) and guard.restarts_in_window(daemon_clock.monotonic()) == 2
    state = StateFile(cfg.state_dir, Journal(cfg.state_dir).path)
    state.update("gemma", state="gave_up", **guard.saved(daemon_clock))
    state.flush()

    reader = SteppedClock(step=reader_step)  # the wall clock when status or a scrape reads it
    (inst,) = collect_status(cfg, cfg.state_dir, clock=reader)["instances"]
    assert (inst["restarts_in_window"], inst["budget"]) == (2, 2)
    metrics = Metrics(lambda: cfg, clock=reader)
    metrics.on_state("gemma", dict(state.data["instances"]["gemma"]))
    assert value(metrics.exposition(), "mlxwatch_restart_budget_remaining", server="gemma") == 0



def step_psutils_clock(monkeypatch, seconds: float) -> None:
    """Step the wall clock as psutil sees it: on Linux a process's ``create_time()`` is its start
    since boot plus the boot time read now from /proc/stat, which a clock step or an NTP
    correction moves (psutil#2526, #2541). An integer ``btime`` flips by a second as NTP slews."""
    if not hasattr(psutil, "_pslinux"):
        pytest.skip("steps psutil's Linux boot time")
    real, before = psutil._pslinux.boot_time, psutil.Process().create_time()
    monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real() + seconds)
    assert abs(psutil.Process().create_time() - before - seconds) < 0.5  # the step is seen, or this proves nothing


@pytest.mark.parametrize("step", [1.0, HOUR, -HOUR])
def test_a_wall_clock_step_does_not_make_a_live_process_look_gone(tmp_path, monkeypatch, step):
    """Measured: a live lab server was judged "exited during start" (its recorded create time no
    longer matched) and was left running, orphaned, on the lab's port; the daemon's recorded
    server, its look-again and a capture's partial-bundle owner are proven the same way."""
    recorded = ProcessIdentity.of(os.getpid())
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / bundle.WRITER).write_text(json.dumps(bundle._this_writer()))
    step_psutils_clock(monkeypatch, step)
    assert recorded.alive()
    assert ProcessIdentity.from_dict(json.loads(json.dumps(recorded.to_dict()))).alive()  # as the state file keeps it
    assert lookagain.same_process(ProcessIdentity.of(os.getpid()), recorded)
    assert bundle.partial_writer_alive(partial) is True


def test_a_process_of_another_boot_is_never_the_recorded_one():
    """On Linux a process's start counts from boot: after a reboot, a server started at the same
    moment of the boot may have the recorded PID and start. The boot is recorded with them."""
    recorded = ProcessIdentity.of(os.getpid())
    assert recorded.boot is not None and recorded.alive()
    earlier_boot = ProcessIdentity.from_dict({**recorded.to_dict(), "boot": "linux:an-earlier-boot"})
    assert not earlier_boot.alive()
    assert not lookagain.same_process(earlier_boot, recorded)


def test_an_identity_recorded_before_start_stamps_still_proves_its_process(monkeypatch):
    """A state file from an earlier mlxwatch has no ``started``: it is compared by create time,
    as before (a reused PID is still told apart)."""
    old = {k: v for k, v in ProcessIdentity.of(os.getpid()).to_dict().items() if k != "started"}
    assert ProcessIdentity.from_dict(old).alive()
    assert not ProcessIdentity.from_dict({**old, "create_time": old["create_time"] - 5}).alive()
    assert not ProcessIdentity.from_dict({**ProcessIdentity.of(os.getpid()).to_dict(), "started": 1.0}).alive()
