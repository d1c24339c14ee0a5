"""Groups without a real group: the launcher's command line, a group's identity, the
collective_wait classification and the restart hook's group fields, from hand-made values."""

from __future__ import annotations

import json
from dataclasses import replace

from mlxwatch.capture.classify import Evidence, RankEvidence, classify
from mlxwatch.config import InstanceConfig, RestartConfig
from mlxwatch.host.group import Group, Rank, is_launcher, parse_launcher
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.restart.methods import RestartContext, custom_command
from mlxwatch.stacks import Frame, ThreadStack


def test_launcher_command_lines():
    """-n repeats the hosts; --hosts lists them; a hostfile (relative to the launcher's directory)
    names them and may set the backend; the server command follows `--`."""
    assert is_launcher(["/v/bin/python3", "/v/bin/mlx.launch", "-n", "2"])
    assert is_launcher(["python", "-m", "mlx._distributed_utils.launch"])
    assert not is_launcher(["/v/bin/python3", "/v/bin/mlx_lm.server"])
    args = parse_launcher(["py", "/v/bin/mlx.launch", "-n", "2", "--backend", "ring", "--starting-port", "9",
                           "--env=A=1", "--", "/v/bin/mlx_lm.server", "--host", "127.0.0.1"])
    assert args.hosts == ["127.0.0.1", "127.0.0.1"] and args.backend == "ring"
    assert args.command == ["/v/bin/mlx_lm.server", "--host", "127.0.0.1"]
    args = parse_launcher(["py", "/v/bin/mlx.launch", "--hosts", "127.0.0.1,mac2", "--verbose", "/v/bin/mlx_lm.server"])
    assert args.hosts == ["127.0.0.1", "mac2"] and args.command == ["/v/bin/mlx_lm.server"]


def test_hostfile_hosts_and_backend(tmp_path):
    (tmp_path / "hosts.json").write_text(json.dumps({"backend": "jaccl", "hosts": [
        {"ssh": "mac1", "ips": ["10.0.0.1"]}, {"ssh": "mac2", "ips": ["10.0.0.2"]}]}))
    args = parse_launcher(["py", "/v/bin/mlx.launch", "--hostfile", "hosts.json", "/v/bin/mlx_lm.server"],
                          cwd=str(tmp_path))
    assert args.hosts == ["mac1", "mac2"] and args.backend == "jaccl"
    assert args.hostfile == str(tmp_path / "hosts.json")


def _group(start1: str = "10.00") -> Group:
    launcher = ProcessIdentity(100, 1.0, ("py", "mlx.launch"), started=5.0, boot="b")
    return Group(launcher, "ring", ("127.0.0.1", "mac2"), None, "hostfile:x",
                 (Rank(0, "127.0.0.1", 101, "9.00", "running"), Rank(1, "mac2", 7, start1, "running")))


def test_a_rank_replaced_is_not_the_same_group():
    """Same launcher, same ranks: the same group; a rank with another start (a PID reused, or a
    rank restarted behind our back) is not."""
    assert _group().same_group(_group())
    assert not _group().same_group(_group(start1="11.00"))
    assert not _group().same_group(None)


def test_restart_hook_gets_the_group():
    cfg = RestartConfig("command", argv=("/bin/restart", "{pid}", "{launcher_pid}", "{pids}", "{hosts}"))
    ctx = RestartContext(InstanceConfig("g", "http://127.0.0.1:8080", restart=cfg),
                         ProcessIdentity(101, 1.0, ()), None, group=_group())
    assert custom_command(cfg, ctx) == ["/bin/restart", "101", "100", "101,7", "127.0.0.1,mac2"]
    single = replace(ctx, group=None)
    assert custom_command(cfg, single) == ["/bin/restart", "101", "", "", ""]


def _thread(*frames: tuple[str, str]) -> ThreadStack:
    return ThreadStack("Thread-1 (_generate)", 1, True, False,
                       [Frame(name, file, 1) for name, file in frames])


WAITING = _thread(("ResponseGenerator._share_object", "mlx_lm/server.py"), ("ResponseGenerator._generate", "mlx_lm/server.py"))
BLOCKED = _thread(("Condition.wait", "threading.py"), ("FaultyBatchGenerator.next", "fault_server.py"),
                  ("ResponseGenerator._generate", "mlx_lm/server.py"))


def _evidence(rank1_state: str, rank1_stacks: list) -> Evidence:
    return Evidence(probe_ran=True, snapshots=[[WAITING]] * 3, process_cpu=60.0,
                    ranks=[RankEvidence(0, "127.0.0.1", 101, "running", target=True),
                           RankEvidence(1, "127.0.0.1", 102, rank1_state, rank1_stacks)])


def test_collective_wait_names_the_rank_that_is_not_in_it():
    """Rank 0 in the collective; rank 1 stopped (even with a stack inside the collective), gone,
    without a generation thread, or blocked elsewhere: collective_wait, culprit rank 1."""
    for state, stacks, says in [("stopped", [[WAITING]] * 3, "is stopped"), ("gone", [], "is gone"),
                                ("running", [[]] * 3, "no generation thread"),
                                ("running", [[BLOCKED]] * 3, "elsewhere")]:
        c = classify(_evidence(state, stacks))
        assert (c.kind, c.culprit_rank, c.confidence) == ("collective_wait", 1, "high"), (state, c)
        assert any(says in line for line in c.evidence)


def test_every_rank_in_the_collective_blames_none():
    """Both ranks waiting in the collective and running: nothing to blame; rank 0 alone decides
    (here a livelock, as before groups)."""
    c = classify(_evidence("running", [[WAITING]] * 3))
    assert c.kind != "collective_wait" and c.culprit_rank is None
    assert classify(Evidence(probe_ran=True, snapshots=[[WAITING]] * 3, process_cpu=60.0)).kind == "livelock"


def test_rank0_that_left_a_non_batched_generation_is_the_culprit():
    """Measured on both versions (a seeded stream to a group, its client gone after 5 events):
    rank 0 waits for the next request in `_share_object` while rank 1, still inside the
    non-batched generation (`_serve_single`), waits idle in the model step. Rank 0 left it
    (mlx-lm raises NotImplementedError on rank 0 alone): before this rule the bundle blamed
    rank 1 as a rank that 'skipped or repeated a step'."""
    single = ThreadStack("Thread-1 (_generate)", 1, False, False, [
        Frame("generate_step", "mlx_lm/generate.py", 472), Frame("stream_generate", "mlx_lm/generate.py", 734),
        Frame("ResponseGenerator._serve_single", "mlx_lm/server.py", 1097),
        Frame("ResponseGenerator._generate", "mlx_lm/server.py", 905)])
    between = ThreadStack("Thread-1 (_generate)", 1, False, False, single.frames[2:])  # measured: snapshot 1
    c = classify(_evidence("running", [[between], [single], [single]]))
    assert (c.kind, c.culprit_rank, c.confidence) == ("collective_wait", 0, "high"), c
    assert any("left a non-batched generation" in line for line in c.evidence), c.evidence
    # measured in a full run: rank 0's first snapshot still inside the generation (it notices the
    # disconnect at its next token), then waiting for the next request: still rank 0
    ev = _evidence("running", [[single]] * 3)
    ev.snapshots = [[ThreadStack("Thread-1 (_generate)", 1, False, False, single.frames)], [WAITING], [WAITING]]
    c = classify(ev)
    assert (c.kind, c.culprit_rank, c.confidence) == ("collective_wait", 0, "high"), c
    # rank 1 inside a batched model step while rank 0 waits in the next pass's exchange: rank 0
    # went round its loop without the step (measured: a livelock on rank 0 alone; this case
    # blamed rank 1, "went astray", before that was measured)
    batched = ThreadStack("Thread-1 (_generate)", 1, False, False, single.frames[:2] + single.frames[3:])
    c = classify(_evidence("running", [[batched]] * 3))
    assert (c.culprit_rank, c.confidence) == (0, "high"), c


def test_group_judgement_from_rank_states():
    """A stopped, gone or zombie rank, or one whose generation thread died, is a hung group
    naming it; a rank whose host did not answer is no evidence; all running: not hung."""
    from mlxwatch.evidence.group import judge_group

    running = _group().ranks
    assert not judge_group(running).hung
    for state in ("stopped", "gone", "zombie"):
        judged = judge_group([running[0], replace(running[1], state=state)])
        assert (judged.hung, judged.culprit_rank) == (True, 1) and judged.reason.startswith("rank 1 on mac2")
    judged = judge_group(running, dead_generation={1})
    assert (judged.hung, judged.culprit_rank) == (True, 1) and "generation thread died" in judged.reason
    judged = judge_group([running[0], replace(running[1], state="unknown")])
    assert not judged.hung and judged.unknown == (1,) and "no evidence" in judged.reason


async def test_a_stopped_rank_is_a_stall_that_ends_a_probes_wait(monkeypatch):
    """Rank 1 stopped: the group source's answer is a stall, journaled as `group_stall`, that a
    probe waiting for its first token need not wait out (cut_after 0: nothing can come until
    the rank runs); all ranks running: no stall, the group in the detail for status."""
    from mlxwatch.evidence import Window
    from mlxwatch.evidence import group as source

    found = _group()
    monkeypatch.setattr(source, "find_group", lambda pid, **kw: found)
    monkeypatch.setattr(source, "refresh", lambda g: replace(g, ranks=(g.ranks[0], replace(g.ranks[1], state="stopped"))))
    rank0 = ProcessIdentity(101, 9.0, ("python", "mlx_lm.server"), started=9.0, boot="b")
    looks = source.GroupSource(lambda: rank0)
    first = await looks.look(Window(0.0, 1.0, suspect=True))
    assert first.stall is None and first.detail["group"]["ranks"][1]["state"] == "running"
    later = await looks.look(Window(0.0, 1.0 + source.POLL_SUSPECT, suspect=True))
    assert later.stall is not None and later.stall.event == "group_stall" and later.stall.cut_after == 0.0
    assert later.stall.journal["culprit_rank"] == 1 and "rank 1 on mac2 (PID 7) is stopped" in later.stall.reason


def test_a_rank_that_steps_without_entering_the_collective_is_the_culprit():
    """Measured on main (a livelock on rank 0 alone, both versions): rank 0 in `_share_object`
    and rank 1 in `PromptProcessingBatch.prompt`, idle, in every snapshot; the bundle said
    "culprit rank 1, medium: rank 1 skipped or repeated a step". Both passed the exchange
    before that step together, so rank 0 went round without entering the step's collective:
    rank 0, high confidence when the stacks agree; medium when they do not (one snapshot of
    rank 1, or rank 0 seen elsewhere too)."""
    waiting = ThreadStack("Thread-1 (_generate)", 1, False, False, [
        Frame("ResponseGenerator._share_object", "mlx_lm/server.py", 595),
        Frame("ResponseGenerator._generate", "mlx_lm/server.py", 1014)])
    prompt = ThreadStack("Thread-1 (_generate)", 1, False, False, [
        Frame("PromptProcessingBatch.prompt", "mlx_lm/generate.py", 1229),
        Frame("BatchGenerator._next", "mlx_lm/generate.py", 1886),
        Frame("ResponseGenerator._generate", "mlx_lm/server.py", 1014)])
    ev = _evidence("running", [[prompt]] * 3)
    ev.snapshots = [[waiting]] * 3
    c = classify(ev)
    assert (c.kind, c.culprit_rank, c.confidence) == ("collective_wait", 0, "high"), c
    assert any("went round its loop without entering the collective" in line for line in c.evidence), c.evidence
    ev.ranks[1].snapshots = [[prompt]]
    assert (classify(ev).culprit_rank, classify(ev).confidence) == (0, "medium")


def test_the_rank_that_exited_is_the_culprit_by_the_launchers_log():
    """Measured on main: rank 1 exited while a request was in flight, mlx.launch ended rank 0,
    and the group was journaled with culprit_rank 0 (the lowest rank not running). The launcher
    logs each rank's end in order, those it ended itself with SIGTERM's code: rank 1 first."""
    from mlxwatch.evidence.group import judge_group
    from mlxwatch.host.group import launcher_exits

    r0, r1 = _group().ranks
    ranks = [replace(r0, state="zombie"), replace(r1, state="gone")]
    assert judge_group(ranks).culprit_rank == 0  # without the log: the lowest, as before
    log = ("\x1b[33m[WARN] Node with rank 1 exited with code -6 \x1b[0m\n"
           "\x1b[33m[WARN] Node with rank 0 exited with code -15 \x1b[0m\n")
    assert launcher_exits(log) == [1, 0]
    judged = judge_group(ranks, exited=launcher_exits(log))
    assert (judged.hung, judged.culprit_rank) == (True, 1) and "exited" in judged.reason
    # the launcher's own ending logged first still names the rank that exited on its own
    assert launcher_exits("Node with rank 0 was killed\nNode with rank 1 exited with code 1\n") == [1, 0]
    # a rank that runs again is no culprit, whatever an old line says
    assert judge_group([r0, r1], exited=[1]).hung is False
