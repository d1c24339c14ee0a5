"""Distributed servers: real 2-rank ``mlx.launch`` groups (ring backend, loopback), both versions.

One group per mlx-lm version is shared by these tests (``lab_group``: about a core idle); a test
whose fault ends a group starts its own. Faults are switched in rank 1 alone (the lab's injector
reads ``fault-rank1``; SIGSTOP and SIGKILL are sent to rank 1's PID).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from mlxwatch.capture import CaptureRequest, capture_bundle
from mlxwatch.config import CaptureConfig, Config, InstanceConfig, ProbeConfig, RestartConfig
from mlxwatch.host.group import RUNNING, STOPPED, find_group, read_exits, refresh
from mlxwatch.daemon.metrics import group_ranks
from mlxwatch.evidence.group import judge_group
from mlxwatch.restart.methods import OK, RestartContext, restart
from lab.daemon import probed_ok, run_daemon_until

CEILING = 30.0


def capture_request(group, out, found, **kw) -> CaptureRequest:
    return CaptureRequest(pid=found.rank(0).pid, out_dir=out, url=group.url, log=group.log_path, label="group",
                          snapshots=3, spacing=1.0, ceiling=CEILING, probe_first_token_timeout=3.0,
                          probe_timeout=5.0, group=found, **kw)


def trigger(group) -> None:
    """One request, so that every rank's batch loop takes a step (and a faulty rank its fault)."""
    try:
        httpx.post(f"{group.url}/v1/chat/completions", trust_env=False, timeout=2.0,
                   json={"messages": [{"role": "user", "content": "trigger"}], "max_tokens": 2})
    except httpx.HTTPError:
        pass


def test_group_found_from_rank0(lab_group):
    """From rank 0's PID: the launcher, the ring backend, both ranks running on 127.0.0.1, and
    the same group found twice is the same group."""
    found = lab_group.group()
    assert found is not None
    assert "mlx.launch" in found.launcher.cmdline[1]
    assert found.backend == "ring" and found.hosts == ("127.0.0.1", "127.0.0.1")
    assert [(r.rank, r.state) for r in found.ranks] == [(0, RUNNING), (1, RUNNING)]
    assert all(r.pid and r.start for r in found.ranks)
    assert found.same_group(lab_group.group())
    assert find_group(found.launcher.pid) is None  # the launcher is no rank


def test_stopped_rank_is_a_collective_wait_naming_rank1(lab_group, tmp_path):
    """Rank 1 SIGSTOPped: rank 0 waits in the collective for ever. Measured before: the bundle
    held rank 0 alone and said 'livelock, high confidence'. Now: collective_wait, culprit rank 1,
    both ranks' stacks, and the group in the manifest."""
    found = lab_group.group()
    rank1 = found.rank(1)
    os.kill(rank1.pid, signal.SIGSTOP)
    try:
        trigger(lab_group)
        bundle = asyncio.run(capture_bundle(capture_request(lab_group, tmp_path, found)))
    finally:
        os.kill(rank1.pid, signal.SIGCONT)
    c = bundle.manifest["classification"]
    assert c["kind"] == "collective_wait", c
    assert c["culprit_rank"] == 1
    ranks = {r["rank"]: r for r in bundle.manifest["group"]["ranks"]}
    assert ranks[1]["state"] == STOPPED and ranks[0]["state"] == RUNNING
    assert "_share_object" in ranks[0]["innermost"]
    assert list((bundle.path / "stacks").glob("pyspy-*.json"))
    assert list((bundle.path / "ranks" / "rank-1" / "stacks").glob("pyspy-*.json"))
    summary = (bundle.path / "summary.md").read_text()
    assert "rank 1" in summary.splitlines()[0] or "rank 1" in summary


def wait_for(condition, timeout: float, poll: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return condition()


def group_instance(group, method: RestartConfig) -> InstanceConfig:
    return InstanceConfig("group", group.url, group.log_path, restart=method)


def restart_group(group, old, method: RestartConfig = RestartConfig("signal", grace=5.0)):
    """The restart the daemon runs for the group ``old`` (found before the fault), by ``method``."""
    return asyncio.run(restart(RestartContext(group_instance(group, method), old.rank(0).identity, None, group=old)))


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_signal_restart_ends_the_whole_group_with_rank1_stopped(lab_group):
    """Measured before: SIGTERM to rank 0 while rank 1 is SIGSTOPped: rank 0 exits, rank 1 stays
    stopped, mlx.launch spins for ever and the supervisor never starts the group again. Now the
    restart continues and ends every rank, then the launcher, proves them gone, and the keep-alive
    loop's new group answers."""
    old = lab_group.group()
    os.kill(old.rank(1).pid, signal.SIGSTOP)
    outcome = restart_group(lab_group, old)
    assert outcome.result == OK, outcome
    assert not old.launcher.alive()
    assert all(not r.identity.alive() for r in old.ranks)
    assert wait_for(lambda: (g := lab_group.group()) is not None and not g.same_group(old) and not g.missing(), 120)
    assert wait_for(lab_group.answers, 60)


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_command_hook_gets_the_group(lab_group, tmp_path):
    """A command hook gets {launcher_pid}, {pids} and {hosts} besides {pid}; the old group's ranks
    it leaves running are ended after the grace (the hook here does nothing)."""
    old = lab_group.group()
    out = tmp_path / "args"
    write = "import sys; open(sys.argv[1], 'w').write(' '.join(sys.argv[2:]))"
    hook = RestartConfig("command", argv=(sys.executable, "-c", write,
                                          str(out), "{pid}", "{launcher_pid}", "{pids}", "{hosts}"), grace=1.0)
    outcome = restart_group(lab_group, old, hook)
    assert out.read_text().split() == [str(old.rank(0).pid), str(old.launcher.pid),
                                       f"{old.rank(0).pid},{old.rank(1).pid}", "127.0.0.1,127.0.0.1"]
    assert "killed ranks that outlived it" in outcome.detail
    assert all(not r.identity.alive() for r in old.ranks)
    assert wait_for(lambda: (g := lab_group.group()) is not None and not g.same_group(old) and not g.missing(), 120)


def _switch_fault(group, found, fault: str) -> None:
    """One fault in rank 1 alone, then a request so that every rank's loop takes a step; or
    ``cancel``: a client gone in the middle of a non-batched stream (a ``seed``), rank 0's fault."""
    if fault == "cancel":
        _cancel_a_seeded_stream(group)
        return
    if fault == "stopped":
        os.kill(found.rank(1).pid, signal.SIGSTOP)
    elif fault == "killed":
        os.kill(found.rank(1).pid, signal.SIGKILL)
    elif fault == "livelock0":
        group.set_fault("spin", rank=0)
    else:
        group.set_fault({"dead_thread": "die", "blocked": "block", "livelock": "spin"}[fault], rank=1)
    trigger(group)


def _cancel_a_seeded_stream(group, events: int = 5) -> None:
    """Stream a long seeded request through rank 0 and hang up after ``events`` events."""
    body = {"messages": [{"role": "user", "content": "a long story"}], "max_tokens": 400, "stream": True, "seed": 7}
    seen = 0
    with httpx.Client(trust_env=False, timeout=30) as client, \
            client.stream("POST", f"{group.url}/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen >= events:
                break


@pytest.mark.parametrize(("fault", "culprit"), [("stopped", 1), ("blocked", 1), ("livelock", 1), ("cancel", 0),
                                               ("livelock0", 0)])
def test_hung_group_verdict_bundle_and_group_restart(lab_group, tmp_path, fault, culprit):
    """Rank 1 stopped, its generation thread blocked, or livelocked; or the distributed cancel
    (measured on both versions: a client gone from a seeded stream makes rank 0 alone leave the
    generation, NotImplementedError, while rank 1 stays in its collectives; before, the bundle
    blamed rank 1); or a livelock on rank 0 alone (before: "culprit rank 1, medium: rank 1
    skipped or repeated a step"): the group delivers nothing through rank 0; the ranks' states judge a
    stopped rank hung on their own; the bundle names the culprit with both ranks' stacks; the
    group restart ends every old process and the keep-alive loop's new group answers."""
    old = lab_group.group()
    _switch_fault(lab_group, old, fault)
    judged = judge_group(refresh(old).ranks)
    assert judged.hung == (fault == "stopped") and judged.culprit_rank == (1 if fault == "stopped" else None)
    bundle = asyncio.run(capture_bundle(capture_request(lab_group, tmp_path, old)))
    c = bundle.manifest["classification"]
    assert (c["kind"], c["culprit_rank"]) == ("collective_wait", culprit), c
    assert list((bundle.path / "stacks").glob("pyspy-*.json"))
    assert list((bundle.path / "ranks" / "rank-1" / "stacks").glob("pyspy-*.json"))
    assert f"rank {culprit}" in (bundle.path / "summary.md").read_text().splitlines()[0]
    lab_group.set_fault("", rank=0)  # the new group starts healthy
    lab_group.set_fault("", rank=1)
    outcome = restart_group(lab_group, old)
    assert outcome.result == OK and "all 2 ranks and the launcher gone" in outcome.detail
    assert not old.launcher.alive() and all(not r.identity.alive() for r in old.ranks)
    assert wait_for(lambda: (g := lab_group.group()) is not None and not g.same_group(old) and not g.missing(), 120)
    assert wait_for(lab_group.answers, 60)


@pytest.mark.parametrize("fault", ["killed", "dead_thread"])
def test_rank1_exits_group_ends_and_comes_back(lab_group, fault):
    """Rank 1 killed, or its generation thread dead (measured: the rank ends, mostly aborting with
    `terminate called without an active exception`): the ranks' states judge the group hung
    while rank 1 is gone. mlx.launch ends the whole group itself when rank 1's exit is non-zero
    (rank 0 loses its peer); where it does not (seen in CI with the dead thread: rank 0 and the
    launcher still there after 60 s), the group is the hung group mlxwatch restarts, and the
    group restart ends what is left. Either way the keep-alive loop's new group answers and
    nothing of the old group stays."""
    old = lab_group.group()
    logged = lab_group.log_path.stat().st_size
    _switch_fault(lab_group, old, fault)
    assert wait_for(lambda: not old.rank(1).identity.alive(), 60)
    lab_group.set_fault("", rank=1)
    # rank 0 may already have gone with it: the launcher's log says which rank exited first
    # (measured on main: the lowest rank not running, rank 0, was named). The launcher may also
    # say nothing for minutes (seen in CI with the dead thread: rank 1 gone, rank 0 and the
    # launcher asleep, no exit line after 30 s): then rank 0 still runs, and the ranks' states
    # alone name rank 1.
    wait_for(lambda: 1 in read_exits(lab_group.log_path, logged), 30)
    ranks = refresh(old).ranks
    exited = read_exits(lab_group.log_path, logged)
    judged = judge_group(ranks, exited=exited)
    assert judged.hung and judged.culprit_rank == 1, (judged, exited, _left(lab_group, old))
    if not wait_for(lambda: not old.launcher.alive() and not old.rank(0).identity.alive(), 20):
        left = _left(lab_group, old)
        outcome = restart_group(lab_group, old)
        assert outcome.result == OK, (outcome, left)
    assert not old.launcher.alive() and all(not r.identity.alive() for r in old.ranks), _left(lab_group, old)
    assert wait_for(lambda: (g := lab_group.group()) is not None and not g.same_group(old) and not g.missing(), 120)
    assert wait_for(lab_group.answers, 60)


def _left(lab_group, old) -> str:
    """What of ``old`` is still running and what the group logged last: why it did not end."""

    def state(pid: int) -> str:
        try:
            return psutil.Process(pid).status()
        except psutil.Error:
            return "gone"
    tail = lab_group.log_path.read_text(errors="replace")[-3000:]
    return (f"launcher {old.launcher.pid} {state(old.launcher.pid)}, rank 0 {old.rank(0).pid} "
            f"{state(old.rank(0).pid)}; the group's log ends:\n{tail}")


@pytest.mark.timeout(600)
def test_the_daemon_finds_a_stopped_rank_captures_every_rank_and_restarts_the_group(lab_group, tmp_path):
    """The daemon pointed at rank 0's URL only (no group config): rank 1 stopped is a stall from
    the ranks' own states (journaled `group_stall`), the verdict's bundle says
    `collective_wait` naming rank 1 with both ranks' stacks, the `signal` restart ends the whole
    old group, and recovery is proven through rank 0 on the new group. Measured before: a bundle
    of rank 0 alone saying `livelock`, rank 0 signalled alone, rank 1 left stopped and
    mlx.launch spinning for ever."""

    old = lab_group.group()
    probe = ProbeConfig(interval=2.0, suspect_interval=1.0, first_token_timeout=4.0, timeout=8.0,
                        endpoint_timeout=2.0, startup_timeout=120.0)
    inst = InstanceConfig("group", lab_group.url, lab_group.log_path, probe=probe,
                          restart=RestartConfig("signal", grace=5.0, backoff=1.0))
    config = Config(None, (inst,), tmp_path / "state", (), CaptureConfig(snapshots=2, spacing=0.5, ceiling=40.0))

    def group_found(instance: dict) -> bool:
        return probed_ok(instance) and bool((instance.get("group") or {}).get("ranks"))

    journal = asyncio.run(run_daemon_until(
        config, lambda j: "recovered" in [r["event"] for r in j.records()], timeout=420,
        after_healthy=lambda: os.kill(old.rank(1).pid, signal.SIGSTOP), ready=group_found))
    records = journal.records()
    events = [r["event"] for r in records]
    assert events.index("group_stall") < events.index("verdict") < events.index("restart") < events.index("recovered")
    stall = next(r for r in records if r["event"] == "group_stall")
    assert stall["culprit_rank"] == 1 and "is stopped" in stall["reason"]
    captured = next(r for r in records if r["event"] == "captured")
    assert (captured["kind"], captured["confidence"]) != ("livelock", "high")
    manifest = json.loads((Path(captured["bundle"]) / "manifest.json").read_text())
    assert (manifest["classification"]["kind"], manifest["classification"]["culprit_rank"]) == ("collective_wait", 1)
    assert list((Path(captured["bundle"]) / "ranks" / "rank-1" / "stacks").glob("pyspy-*.json"))
    assert not old.launcher.alive() and all(not r.identity.alive() for r in old.ranks)
    assert wait_for(lambda: (g := lab_group.group()) is not None and not g.same_group(old) and not g.missing(), 120)


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
@pytest.mark.timeout(900)
def test_the_daemon_follows_a_relaunched_slow_group_and_brings_back_a_dead_launchers_service(lab_group, tmp_path):
    """The daemon at rank 0's URL, `signal` restart, the group under a relaunching supervisor
    (as launchd's KeepAlive). Two cases measured on main with 0.32.2, on one daemon run:

    1. Rank 1 killed: mlx.launch ends the group and the supervisor relaunches it, slow (each
       step 1.5 s). Before: the state, status and metrics kept the dead group ("gone",
       rank_up 0) for minutes, and its dead rank 0 was a stall that cut every probe after 1 s: a
       verdict and a restart of the slow, working group. Now the state follows the new group
       (its launcher, both ranks running, rank_up 1) within two healthy probes, and no verdict.
    2. The launcher killed: both ranks orphaned keep the port and close every request; the
       relaunch cannot bind (`Address already in use`) and never exits. Before: the service
       down for the 20 minutes watched, "recovered" naming a rank 0 that never listened, and a
       verdict every ~44 s. Now one verdict, one restart that ends both groups, and recovery
       proven by a delivery from the supervisor's new group, within 2 minutes of the kill."""
    old = lab_group.group()
    probe = ProbeConfig(interval=5.0, suspect_interval=5.0, failures=4, first_token_timeout=10.0, timeout=20.0,
                        endpoint_timeout=5.0, startup_timeout=120.0)
    inst = InstanceConfig("group", lab_group.url, lab_group.log_path, probe=probe,
                          restart=RestartConfig("signal", grace=5.0, backoff=1.0))
    config = Config(None, (inst,), tmp_path / "state", (), CaptureConfig(snapshots=2, spacing=0.5, ceiling=40.0))
    seen: dict = {"ok": 0}

    def instance() -> dict:
        try:
            return json.loads((config.state_dir / "state.json").read_text())["instances"]["group"]
        except (OSError, ValueError, KeyError):
            return {}

    def group_found(state: dict) -> bool:
        return probed_ok(state) and bool((state.get("group") or {}).get("ranks"))

    def relaunch_slow() -> None:
        lab_group.set_fault("slow 1.5", rank=0)  # the supervisor's new group reads it too
        seen["killed_rank1"] = True
        os.kill(old.rank(1).pid, signal.SIGKILL)

    def phases(journal) -> bool:
        state = instance()
        group = state.get("group") or {}
        probe_at = (state.get("last_probe") or {}).get("at")
        events = [r["event"] for r in journal.records()]
        if "killed_launcher" not in seen:
            if probed_ok(state) and probe_at != seen.get("probe_at") and "killed_rank1" in seen:
                seen["ok"] += 1  # a probe the new group answered (the old one is gone)
            seen["probe_at"] = probe_at
            launcher = (group.get("launcher") or {}).get("pid")
            if "relaunched" not in seen and launcher not in (None, old.launcher.pid) \
                    and [r.get("state") for r in group.get("ranks", [])] == [RUNNING, RUNNING]:
                seen["relaunched"], seen["ok_before_followed"] = dict(group), seen["ok"]
                seen["ok"] = 0
            if "relaunched" in seen and seen["ok"] >= 2 and state.get("incident") is None:
                seen["before_kill"] = events  # the slow group served; then its launcher dies
                seen["rank_up"] = [s for _, _, s in group_ranks(group)]
                lab_group.set_fault("", rank=0)
                seen["killed_launcher"] = time.monotonic()
                os.kill(seen["relaunched"]["launcher"]["pid"], signal.SIGKILL)
            return "restarting" in events  # a restart of the relaunched group fails below
        return "recovered" in events[len(seen["before_kill"]):]

    journal = asyncio.run(run_daemon_until(config, phases, timeout=720, after_healthy=relaunch_slow,
                                           ready=group_found))
    lab_group.set_fault("", rank=0)
    recovered_after = time.monotonic() - seen.get("killed_launcher", time.monotonic())
    records = journal.records()
    events = [r["event"] for r in records]
    assert events  # the journal, for the messages below
    assert "killed_launcher" in seen and "restarting" not in seen["before_kill"], (events, seen)
    # While the supervisor's new group loads (20 s and more on 0.31.3 here) the service is down:
    # a verdict then is answered by the look-again, which waits for the new group's first
    # delivery and restarts nothing. No verdict once the slow group serves.
    early = [r for r in records[:len(seen["before_kill"])] if r["event"] in ("verdict", "recovered")]
    assert [r["event"] for r in early] in ([], ["verdict", "recovered"]), early
    assert all(r["how"].endswith("(someone else restarted it) delivered") for r in early if r["event"] == "recovered")
    assert seen["ok_before_followed"] <= 2, seen  # followed within two probes of the new group
    assert seen["rank_up"] == [RUNNING, RUNNING]
    later = records[len(seen["before_kill"]):]
    assert [r["event"] for r in later].count("verdict") == 1 and [r["event"] for r in later].count("restart") == 1, \
        [r["event"] for r in later]
    recovered = next(r for r in later if r["event"] == "recovered")
    assert recovered["how"] == "recovery verified by a probe"
    assert recovered_after < 120, recovered_after
    restarted = next(r for r in later if r["event"] == "restart")
    assert "ended 2 group(s)" in restarted["restarts"][-1]["detail"], restarted["restarts"][-1]
    captured = next(r for r in later if r["event"] == "captured")
    manifest = json.loads((Path(captured["bundle"]) / "manifest.json").read_text())
    assert manifest["group"].get("orphaned", "").endswith("is gone; 2 ranks orphaned"), manifest["group"]
    assert lab_group.answers()
