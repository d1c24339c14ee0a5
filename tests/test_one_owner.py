"""One owner of state, and a supervisor that notices a silent watcher (issue "One house").

- The policy owns every transition of an incident: an impossible one is refused, said once.
- The journal's fsynced appends run in its writer thread, never on the event loop.
- A watcher that stops showing life (its cycle never ends) is reported: ``status``, one
  ``watcher_stuck`` record per episode, and the last-probe metric stops moving.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from pathlib import Path

from mlxwatch.config import CaptureConfig, Config, InstanceConfig, ProbeConfig, RestartConfig
from mlxwatch.daemon import watcher as watcher_module
from mlxwatch.daemon.metrics import Metrics
from mlxwatch.daemon.status import collect_status, status_exit_code
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.journal import incidents as journal_module
from mlxwatch.journal.incidents import Event, Journal
from mlxwatch.verdict import policy

FAST = ProbeConfig(interval=0.2, suspect_interval=0.1, first_token_timeout=0.5, timeout=1.0, failures=1,
                   endpoint_timeout=0.3, startup_timeout=30.0)


def closed_port() -> str:
    """A loopback address nothing listens on (every probe refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def config(state_dir: Path) -> Config:
    return Config(None, (InstanceConfig("gone", closed_port(), None, None, FAST, RestartConfig()),), state_dir, (),
                  CaptureConfig(snapshots=1, spacing=0.1, ceiling=5.0))


async def until(predicate, task: asyncio.Task, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if task.done():
            task.result()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# --- the policy owns the transitions


def test_the_policy_refuses_an_impossible_transition_and_says_so_once():
    """Measured on main: the watcher set ``detect.state`` itself in nine places, so nothing
    stopped "recovering" from a server never judged hung. Now the policy refuses it: the state
    stays, the refusal is told once (the watcher logs it), nothing raises."""
    told: list[str] = []
    d = policy.Detection(failures_needed=2, grace_ceiling=60.0, on_refused=told.append)
    assert d.recovering() == policy.STARTING and d.state == policy.STARTING
    assert d.recovering() == policy.STARTING
    assert d.capturing() == policy.STARTING  # nothing is captured before a verdict
    assert len(told) == 2 and "recovering" in told[0] and "starting" in told[0]
    # the legal path is walked as before
    assert d.failure(0.0, []) is False and d.failure(1.0, []) is True and d.state == policy.HUNG
    assert d.failure(2.0, []) is False and d.state == policy.HUNG  # an incident is open: no new verdict
    assert (d.capturing(), d.restarting(), d.recovering(), d.recovered()) == (
        policy.CAPTURING, policy.RESTARTING, policy.RECOVERING, policy.HEALTHY)
    assert d.failures == 0


def test_no_one_outside_the_policy_writes_its_state():
    """The state is the policy's: a write from outside is an error, and the watcher has none."""
    d = policy.Detection(failures_needed=2, grace_ceiling=60.0)
    try:
        d.state = policy.HUNG  # type: ignore[misc]
    except AttributeError:
        pass
    else:
        raise AssertionError("the policy's state was written from outside")
    source = Path(watcher_module.__file__).read_text()
    assert not re.search(r"detect\.(state|failures)\s*=[^=]", source)


# --- the journal writes off the event loop


async def test_journal_appends_run_off_the_event_loop_in_order(tmp_path, monkeypatch):
    """Measured on main: every fsynced append ran on the event loop's thread, contradicting
    "nothing blocks the event loop". Now a writer thread appends them, in order, and the
    daemon's stop writes what is queued."""
    real = journal_module.append_record
    appended: list[tuple[str, threading.Thread]] = []

    def append(path, record):
        appended.append((record["event"], threading.current_thread()))
        real(path, record)

    monkeypatch.setattr(journal_module, "append_record", append)
    cfg = config(tmp_path / "state")
    stop = asyncio.Event()
    daemon = Daemon(cfg, cfg.state_dir, heartbeat=3600.0)
    task = asyncio.create_task(daemon.run(stop))
    await until(lambda: any(e == Event.AWAITING_RECOVERY for e, _ in appended), task, "awaiting_recovery")
    stop.set()
    await asyncio.wait_for(task, 30)
    loop_thread = threading.current_thread()
    assert appended and all(thread is not loop_thread for _, thread in appended), \
        [(e, t.name) for e, t in appended if t is loop_thread]
    events = [r["event"] for r in Journal(cfg.state_dir).records()]
    assert events[0] == "daemon_start" and events[-1] == "interrupted"  # the last one, queued at stop, is on disk
    assert events.index("verdict") < events.index("capturing") < events.index("awaiting_recovery")


# --- a silent watcher is noticed


def last_probe(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("mlxwatch_last_probe_timestamp_seconds", {"server": "gone"}) or 0.0


async def test_a_watcher_whose_cycle_never_completes_is_reported_stuck(tmp_path, monkeypatch):
    """Measured on main: a watcher whose cycle awaited forever stayed "healthy" in status, with
    nothing in the journal and no metric showing it. Now, within its promise (sleep + probe
    timeout + endpoint timeout) plus the slack, status says stuck (exit 1), the journal has one
    watcher_stuck record, and the last-probe timestamp stops moving."""
    hang = asyncio.Event()
    real_cycle = watcher_module.InstanceWatcher.cycle

    async def cycle(self):
        if hang.is_set():
            await asyncio.Event().wait()  # a cycle that never completes, and never raises
        await real_cycle(self)

    monkeypatch.setattr(watcher_module.InstanceWatcher, "cycle", cycle)
    cfg = config(tmp_path / "state")
    stop = asyncio.Event()
    daemon = Daemon(cfg, cfg.state_dir, heartbeat=0.2, liveness_slack=0.5)
    task = asyncio.create_task(daemon.run(stop))
    try:
        await until(lambda: daemon.instance_state("gone").get("last_probe"), task, "a first probe")
        metrics = Metrics(lambda: cfg, daemon.state)
        daemon.state.observers.append(metrics.on_state)
        await until(lambda: last_probe(metrics) > 0, task, "the probe metric")
        hang.set()
        hung_at = time.monotonic()
        bound = FAST.interval * 1.1 + FAST.timeout + FAST.endpoint_timeout + 0.5 + 0.2  # promise + slack + heartbeat
        await until(lambda: "stuck" in daemon.instance_state("gone"), task, "the watcher to be reported stuck")
        assert time.monotonic() - hung_at < bound + 10.0  # generous: the machine is loaded
        await until(lambda: collect_status(cfg, cfg.state_dir)["instances"][0]["state"] == "stuck", task,
                    "status to show it (the state file is written within 0.5 s)")
        status = collect_status(cfg, cfg.state_dir)
        assert status_exit_code(status) == 1
        frozen = last_probe(metrics)
        await asyncio.sleep(1.0)  # several heartbeats: still one record, and no probe meanwhile
        assert last_probe(metrics) == frozen
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    stuck = [r for r in Journal(cfg.state_dir).records() if r["event"] == "watcher_stuck"]
    assert len(stuck) == 1 and stuck[0]["instance"] == "gone"


async def test_a_watcher_that_returns_without_being_stopped_is_supervised_as_a_crash(tmp_path, monkeypatch):
    """Measured on main: a watcher whose run() returned ended its task silently; the instance
    was never probed again. Now it is a watcher error: journaled and started again."""
    runs = {"n": 0}
    real_run = watcher_module.InstanceWatcher.run

    async def run(self):
        runs["n"] += 1
        if runs["n"] == 1:
            return  # silently, without stop
        await real_run(self)

    monkeypatch.setattr(watcher_module.InstanceWatcher, "run", run)
    cfg = config(tmp_path / "state")
    stop = asyncio.Event()
    daemon = Daemon(cfg, cfg.state_dir, heartbeat=3600.0)
    task = asyncio.create_task(daemon.run(stop))
    try:
        await until(lambda: daemon.instance_state("gone").get("last_probe"), task, "probes after the silent return")
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    errors = [r for r in Journal(cfg.state_dir).records() if r["event"] == "watcher_error"]
    assert len(errors) == 1 and "returned without being stopped" in errors[0]["error"]
