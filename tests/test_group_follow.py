"""Groups that are replaced or orphaned, in the fast tier: a stand-in ``mlx.launch`` group (real
processes and ports, no model: ``tests/lab/fakegroup.py``) under a supervisor that relaunches the
launcher whenever it exits (``tests/lab/keepalive.py``, as launchd's KeepAlive). The same cases on
real groups, both mlx-lm versions: ``tests/test_group_real.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from lab.daemon import probed_ok, run_daemon_until
from lab.fakegroup import FakeGroup
from mlxwatch.config import CaptureConfig, Config, InstanceConfig, ProbeConfig, RestartConfig
from mlxwatch.daemon.metrics import group_ranks
from mlxwatch.daemon.status import collect_status
from mlxwatch.evidence import Window
from mlxwatch.evidence.group import GroupSource
from mlxwatch.journal.state import StateFile
from mlxwatch.output.status import group_lines
from mlxwatch.host.process import lookup_server
from mlxwatch.host.commands import CommandResult
from mlxwatch.host.group import Group, instance_groups, refresh
from mlxwatch.restart.methods import OK, RestartContext, restart


@pytest.fixture
def fake_group(tmp_path):
    group = FakeGroup.start(tmp_path / "group")
    yield group
    group.stop()


def wait_for(condition, timeout: float, poll: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return condition()


def _alive(group: Group) -> list[str]:
    """What of ``group`` still runs (its launcher, its ranks), as text."""
    left = [r.where for r in group.ranks if r.identity is not None and r.identity.alive()]
    if group.launcher is not None and group.launcher.alive():
        left.append(f"launcher {group.launcher.pid}")
    return left


def _orphaned_and_wedged(group: FakeGroup) -> tuple[Group, Group]:
    """Kill the launcher; the supervisor's relaunch cannot bind. Returns (the orphans' group as
    the daemon knew it, the wedged relaunch)."""
    old = group.group()
    assert old is not None and not old.missing()
    os.kill(old.launcher.pid, signal.SIGKILL)
    assert wait_for(lambda: "Address already in use" in group.log_path.read_text(), 30), group.log_path.read_text()
    found = instance_groups(group.port)
    wedged = [g for g in found if g.launcher is not None and not g.launcher_gone]
    assert len(found) == 2 and len(wedged) == 1, [g.describe() for g in found]
    return refresh(old), wedged[0]


def test_orphans_are_found_by_their_group_and_named():
    """Hand-made: an orphaned group says which launcher is gone and how many ranks it left."""
    from mlxwatch.host.group import Rank
    from mlxwatch.host.process import ProcessIdentity

    launcher = ProcessIdentity(100, 1.0, ("py", "mlx.launch"))
    ranks = (Rank(0, "127.0.0.1", 101, "1.00", "running"), Rank(1, "127.0.0.1", 102, "1.00", "running"))
    group = Group(launcher, "ring", ("127.0.0.1",) * 2, None, "hostfile:x", ranks, launcher_gone=True)
    assert group.orphan_note() == "launcher PID 100 is gone; 2 ranks orphaned"
    assert group.to_dict()["orphaned"] == "launcher PID 100 is gone; 2 ranks orphaned"
    assert Group(launcher, "ring", ("127.0.0.1",) * 2, None, "hostfile:x", ranks).orphan_note() is None


@pytest.mark.parametrize("method", ["signal", "command", "launchd", "systemd"])
async def test_a_dead_launcher_every_group_on_the_port_is_ended_then_one_starts(fake_group, method, tmp_path):
    """Measured on main (real 2-rank group, 0.32.2, a relaunching supervisor): the launcher
    killed left both ranks orphaned on the port; the relaunch could not bind and never exited;
    the restart ended the two orphans only, and the service stayed down for good. Now every
    group holding or waiting for the port is ended and proven gone before the method runs (with
    ``signal``, the supervisor starts the launcher again), and one group serves again."""
    old, wedged = _orphaned_and_wedged(fake_group)
    orphaned = f"launcher PID {old.launcher.pid} is gone; 2 ranks orphaned"
    assert old.orphan_note() == orphaned
    if method == "signal":  # what the daemon's state, and so `status`, say meanwhile
        await _status_names_the_orphans(fake_group, old, orphaned, tmp_path)
    ran: list[tuple[list[str], list[str]]] = []

    async def runner(argv, timeout):
        ran.append((list(argv), _alive(old) + _alive(wedged)))  # what still ran when the method ran
        return CommandResult(list(argv), 0, b"", b"", 0.0)

    cfg = {"signal": RestartConfig("signal", grace=2.0),
           "command": RestartConfig("command", argv=("hook", "{pid}", "{launcher_pid}"), grace=2.0),
           "launchd": RestartConfig("launchd", target="com.example.mlx", uid=501, grace=2.0),
           "systemd": RestartConfig("systemd", target="mlx.service", user=True, grace=2.0)}[method]
    inst = InstanceConfig("g", fake_group.url, fake_group.log_path, restart=cfg)
    outcome = await restart(RestartContext(inst, old.rank(0).identity, None, group=old), runner=runner)
    assert outcome.result == OK and "ended 2 group(s)" in outcome.detail, outcome
    assert "2 ranks orphaned" in outcome.detail
    assert _alive(old) == [] and _alive(wedged) == []
    if method == "signal":
        assert ran == []
    else:
        assert len(ran) == 1 and ran[0][1] == [], ran  # nothing of either group ran when the method did
        if method == "command":
            assert ran[0][0] == ["hook", "", ""]  # all ended and proven gone: no PID to name
    assert await asyncio.to_thread(fake_group.wait_answers, 30)  # the supervisor's new group
    assert len(instance_groups(fake_group.port)) == 1


async def _status_names_the_orphans(fake_group: FakeGroup, old: Group, orphaned: str, tmp_path) -> None:
    """The group source's answer (the daemon saves its detail in the state file) and ``status``."""
    rank0 = old.rank(0).identity
    source = GroupSource(identity=lambda: rank0, locate=lambda: lookup_server(fake_group.url).identity)
    source.group, source.found_for, source.proven_for = old, (rank0.pid, rank0.create_time), (rank0.pid, rank0.create_time)
    evidence = await source.look(Window(0.0, 100.0, suspect=True))
    assert evidence.stall is None and f"group: {orphaned}" in evidence.notes
    config = _config(tmp_path, fake_group, ProbeConfig())
    state = StateFile(config.state_dir)
    state.update("x", state="hung", group=evidence.detail["group"])
    state.flush()
    assert collect_status(config, config.state_dir)["instances"][0]["group"]["orphaned"] == orphaned
    lines = [str(line) for line in group_lines(collect_status(config, config.state_dir)["instances"][0]["group"])]
    assert any(orphaned in line for line in lines), lines


def _config(tmp_path, group: FakeGroup, probe: ProbeConfig, grace: float = 2.0) -> Config:
    inst = InstanceConfig("x", group.url, group.log_path, probe=probe,
                          restart=RestartConfig("signal", grace=grace, backoff=0.5))
    return Config(None, (inst,), tmp_path / "state", (), CaptureConfig(snapshots=1, spacing=0.1, ceiling=20.0))


def _instance(config: Config) -> dict:
    try:
        return json.loads((config.state_dir / "state.json").read_text())["instances"]["x"]
    except (OSError, ValueError, KeyError):
        return {}


def _group_found(instance: dict) -> bool:
    return probed_ok(instance) and bool((instance.get("group") or {}).get("ranks"))


async def test_the_launcher_killed_one_incident_recovered_by_delivery(fake_group, tmp_path):
    """The daemon at rank 0's URL, `signal` restart: the launcher killed leaves orphans that
    close every request unanswered and a relaunch that cannot bind. Status names the orphans;
    one verdict, one restart that ends both groups, recovery proven by a delivery from the
    supervisor's new group, and the state follows that group. Measured on main: 13 verdicts in
    20 minutes, "recovered" naming a rank 0 that never listened, the service down throughout."""
    probe = ProbeConfig(interval=0.5, suspect_interval=0.3, first_token_timeout=1.0, timeout=2.0, failures=2,
                        endpoint_timeout=1.0, startup_timeout=20.0, quiet_window=2.0)
    config = _config(tmp_path, fake_group, probe)
    old = fake_group.group()

    def done(journal) -> bool:
        return "recovered" in [r["event"] for r in journal.records()]

    journal = await run_daemon_until(config, done, timeout=120, ready=_group_found,
                                     after_healthy=lambda: os.kill(old.launcher.pid, signal.SIGKILL))
    events = [r["event"] for r in journal.records()]
    assert events.count("verdict") == 1 and events.count("restart") == 1, events
    recovered = next(r for r in journal.records() if r["event"] == "recovered")
    assert recovered["how"] == "recovery verified by a probe"
    orphaned = f"launcher PID {old.launcher.pid} is gone; 2 ranks orphaned"
    bundle = Path(next(r for r in journal.records() if r["event"] == "captured")["bundle"])
    assert json.loads((bundle / "manifest.json").read_text())["group"]["orphaned"] == orphaned
    assert orphaned in (bundle / "summary.md").read_text()
    restarted = next(r for r in journal.records() if r["event"] == "restart")
    assert "ended 2 group(s)" in restarted["restarts"][-1]["detail"]
    # one group, and it answers: asked for up to 30 s (one 5 s request failed in 1 of 7 runs of this file on a loaded machine)
    assert len(instance_groups(fake_group.port)) == 1 and fake_group.wait_answers(30.0)


async def test_a_relaunched_group_is_followed_and_a_slow_one_draws_no_verdict(fake_group, tmp_path):
    """Rank 1 killed: the launcher ends the group, the supervisor relaunches it, and the new
    group serves slowly (first token after 1.2 s, inside the 3 s deadline). Measured on main:
    the state, status and metrics kept the dead group ("gone", rank_up 0) for minutes, and its
    dead rank 0 was a stall that cut every probe after 1 s: a verdict and a restart of the slow,
    working group. Now the state follows the new group (its launcher, both ranks running,
    rank_up 1) and its probes succeed: no verdict."""
    probe = ProbeConfig(interval=1.0, suspect_interval=1.0, first_token_timeout=3.0, timeout=5.0, failures=5,
                        endpoint_timeout=1.0, startup_timeout=20.0)
    config = _config(tmp_path, fake_group, probe)
    old = fake_group.group()
    seen: dict = {"ok_after": 0}

    def relaunch_slow() -> None:
        fake_group.set_mode("slow", "1.2")
        os.kill(old.rank(1).pid, signal.SIGKILL)

    def done(journal) -> bool:
        if "verdict" in [r["event"] for r in journal.records()]:
            return True
        inst = _instance(config)
        launcher = ((inst.get("group") or {}).get("launcher") or {}).get("pid")
        if launcher not in (None, old.launcher.pid) and "followed" not in seen:
            seen["followed"] = inst["group"]
            seen["last_probe"] = inst.get("last_probe", {}).get("at")
        if "followed" in seen and probed_ok(inst) and inst["last_probe"]["at"] != seen["last_probe"]:
            seen["ok_after"] += 1
            seen["last_probe"] = inst["last_probe"]["at"]
        return seen["ok_after"] >= 2

    journal = await run_daemon_until(config, done, timeout=90, ready=_group_found, after_healthy=relaunch_slow)
    events = [r["event"] for r in journal.records()]
    assert "verdict" not in events, events
    followed = seen["followed"]
    new = fake_group.group()
    assert new is not None and followed["launcher"]["pid"] == new.launcher.pid
    assert [r["pid"] for r in followed["ranks"]] == [r.pid for r in new.ranks]
    assert [state for _, _, state in group_ranks(_instance(config)["group"])] == ["running", "running"]
    assert collect_status(config, config.state_dir)["instances"][0]["group"]["launcher_pid"] == new.launcher.pid


async def test_jaccl_ranks_get_sigterm_before_sigkill(tmp_path):
    """A SIGKILLed JACCL process is reported to leave RDMA unusable until the Mac restarts
    (exo-explore/exo PR #1889): with `restart.signal: SIGKILL`, a JACCL group's ranks are sent
    SIGTERM first (each rank here records it); a ring group's get SIGKILL as configured."""
    for backend, expected in (("jaccl", ["rank 0 SIGTERM", "rank 1 SIGTERM"]), ("ring", [])):
        group = FakeGroup.start(tmp_path / backend, backend=backend)
        try:
            found = group.group()
            assert found is not None and found.backend == backend
            method = RestartConfig("signal", signal_name="SIGKILL", grace=2.0)
            inst = InstanceConfig("g", group.url, group.log_path, restart=method)
            outcome = await restart(RestartContext(inst, found.rank(0).identity, None, group=found))
            assert outcome.result == OK and _alive(found) == [], outcome
            assert sorted(group.signals()) == expected, (backend, group.signals())
        finally:
            group.stop()
