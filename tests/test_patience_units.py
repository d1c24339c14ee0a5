"""Patience that fits the server (issue 33): the cadence learns a server's pace and judges its
silences by it (docs/deciding.md#patience), alone and through the real watcher and policy."""

from __future__ import annotations

import json
import time

import pytest

from mlxwatch.config import ProbeConfig
from mlxwatch.evidence import Evidence, Stall, Window
from mlxwatch.evidence.cadence import PRIOR_CHUNK, Cadence, Estimate, Speed
from mlxwatch.evidence.sight import Sight
from mlxwatch.host.connections import Connection
from mlxwatch.host.sockets import Reading
from mlxwatch.verdict.policy import Detection
from mlxwatch.journal.incidents import Journal
from lab.daemon import remember_pace
from test_delivery_units import StandIn, _events, _last_probe_ok, _run_until
from test_sight_units import _daemon

pytestmark = pytest.mark.usefixtures("kernel_read_often")  # a wait that is not the point

KIB16 = 16 * 1024  # the request of a ~3,600-token prompt (JSON, ~4.5 bytes a token)


def _stream(arrived: float, request_bytes: int = KIB16) -> dict:
    return {"arrived": arrived, "request_bytes": request_bytes, "streamed": True}


def _learned(chunk: float, **kw) -> Cadence:
    speed = Speed(chunk=Estimate(chunk, chunk / 20, 10), step=Estimate(0.05, 0.005, 10), **kw)
    return Cadence(speed, quiet_window=8.0, grace_ceiling=600.0)


def test_the_prior_is_a_minute_a_chunk_until_anything_is_learned():
    speed = Speed()
    chunk, basis = speed.chunk_time()
    assert chunk == PRIOR_CHUNK and "prior" in basis
    speed.chunk_tokens = 512  # a smaller --prefill-step-size: still a minute, erring patient
    assert speed.chunk_time()[0] == PRIOR_CHUNK


def test_a_stream_reading_a_long_prompt_may_be_silent_a_chunk_not_the_quiet_window():
    """Measured: 12 ms a token (25 s a 2,048-token chunk), one client streaming a 3,600-token
    prompt: a verdict 22 s after the request. Learned at 25 s a chunk, 22 s of silence is
    within its pace; the same silence from an idle server is not."""
    cadence = _learned(25.0)
    pace = cadence.judge(100.0 + 22.0, None, {"kernel": {"owed": [_stream(100.0)], "streams": 1}})
    assert pace.allows(122.0, 100.0)
    assert "reading a prompt of ~5,461 tokens" == pace.owes and "~25 s a chunk" in pace.basis
    assert not pace.allows(100.0 + 60.0, 100.0)  # past 1.5 chunks with no sign: a stall
    idle = cadence.judge(122.0, None, {"kernel": {"owed": [], "streams": 0}})
    assert not idle.allows(122.0, 100.0) and idle.allows(107.0, 100.0)  # quiet_window alone


def test_each_sign_of_reading_buys_the_next_chunk_and_a_hang_mid_read_is_called():
    cadence = _learned(25.0)
    owed = {"kernel": {"owed": [_stream(0.0)], "streams": 1}}
    assert cadence.judge(70.0, 50.0, owed).allows(70.0, 50.0)  # a keepalive at 50 s: the next chunk due by ~87 s
    assert not cadence.judge(95.0, 50.0, owed).allows(95.0, 50.0)  # nothing since: the read hung


def test_a_prompt_the_log_announces_is_due_its_next_chunk_and_done_reading_owes_a_token():
    """The report's shape: the prompt finished reading (N/N), then nothing reached anyone while
    the loop stepped, and other prompts' progress went on (the July 17 capture). The token the
    finished prompt owes its stream (matched by size: 16 KiB, 3,600 tokens) is overdue after a
    few steps and a chunk; progress then holds no verdict. A prompt no stream matches (the
    daemon's own probe, 25 tokens) owes nothing the kernel could see."""
    cadence = _learned(25.0)
    stream = _stream(5.0)
    log = {"followed": True, "open": {3600: (2048, 10.0)}, "completed": []}
    reading = cadence.judge(30.0, 10.0, {"log": log, "kernel": {"owed": [stream], "streams": 1}})
    assert reading.owes == "reading a 3,600-token prompt (2,048 read)" and reading.allows(30.0, 10.0)
    done = {"followed": True, "open": {9000: (4096, 60.0)}, "completed": [(40.0, 3600)]}
    early = cadence.judge(50.0, 40.0, {"log": done, "kernel": {"owed": [stream], "streams": 1}})
    assert early.overdue is None
    late = cadence.judge(90.0, 60.0, {"log": done, "kernel": {"owed": [stream], "streams": 1}})
    assert late.overdue and "finished reading 50s ago" in late.overdue
    probe_done = {"followed": True, "open": {}, "completed": [(40.0, 25)]}
    assert cadence.judge(90.0, 60.0, {"log": probe_done, "kernel": {"owed": [stream], "streams": 1}}).overdue is None


def test_with_the_log_a_stream_not_yet_announced_is_still_reading_its_first_chunk():
    """Measured (real server, the lab's patience test): with the log followed, a stream whose
    prompt the log had not announced yet (its first chunk takes 25 s) counted as announced,
    because the probe's own prompt had just been logged: a verdict 38 s after the request."""
    cadence = _learned(25.0)
    probe_line = {"followed": True, "open": {}, "completed": [(12.0, 25)]}
    pace = cadence.judge(30.0, 12.0, {"log": probe_line, "kernel": {"owed": [_stream(10.0)], "streams": 1}})
    assert pace.allows(30.0, 12.0) and pace.owes.startswith("reading a prompt")


def test_a_non_streamed_answer_is_hidden_work_until_its_reading_and_max_tokens_steps():
    """While the server computes: its prompt's reading and --max-tokens decode steps. While it
    idles (a blocked server takes nothing up): the reading and a few steps."""
    cadence = _learned(2.0)
    owed = {"kernel": {"owed": [{"arrived": 0.0, "request_bytes": 3000, "streamed": False}], "streams": 0,
                       "cpu": 0.9}}
    pace = cadence.judge(10.0, None, owed)
    assert pace.hidden and pace.due is not None
    # 1,000 tokens at ~3 s a 2,048-token chunk, then 512 steps of ~0.07 s: about 38 s
    assert 30.0 < pace.due < 50.0
    assert cadence.judge(pace.due + 1, None, owed).hidden is None
    idle = {"kernel": {**owed["kernel"], "cpu": 0.0}}
    assert cadence.judge(1.0, None, idle).hidden and cadence.judge(3.0, None, idle).hidden is None


def test_speed_is_learned_from_probes_log_and_keepalives_and_kept_as_json():
    cadence = Cadence()
    cadence.probe_done(0.3, [0.05, 0.06, 0.2], prompt_tokens=25)
    assert cadence.speed.probe_read == 0.3 / 25 and cadence.speed.step is not None
    cadence.probe_done(3.0, [0.05], prompt_tokens=25)  # queued behind a long prompt: no news of the speed
    assert cadence.speed.probe_read == 0.3 / 25 * 1.02
    assert cadence.speed.step.mean == 0.05  # the shortest gap: a step alone
    assert "probes" in cadence.speed.chunk_time()[1]
    cadence.judge(1.0, None, {"log": {"token_seconds": [25.0 / 2048]}})
    assert cadence.speed.chunk is not None and abs(cadence.speed.chunk.mean - 25.0) < 1e-6
    cadence.judge(3.0, None, {"kernel": {"keepalive_gaps": [24.0]}})  # two keepalives on a stream, no token between
    assert cadence.speed.chunk.samples == 2
    kept = Speed.from_dict(json.loads(json.dumps(cadence.speed.to_dict())))
    assert kept.chunk is not None and kept.chunk.samples == 2 and kept.chunk_time() == cadence.speed.chunk_time()


def test_a_damaged_saved_speed_is_the_prior_never_an_error():
    for bad in (None, "x", {"chunk": {"mean": "NaN", "dev": 1}}, {"chunk": {"mean": float("nan"), "dev": 1}},
                {"chunk": {"mean": -1, "dev": 1}}, {"chunk_tokens": "many"}, {"step": [1, 2]}):
        speed = Speed.from_dict(bad)
        assert speed.chunk is None and speed.step is None and speed.chunk_tokens == 2048


def test_the_command_line_gives_the_chunk_and_max_tokens():
    speed = Speed()
    speed.take_cmdline(["mlx_lm.server", "--model", "m", "--prefill-step-size", "512", "--max-tokens=2000"])
    assert (speed.chunk_tokens, speed.max_tokens) == (512, 2000)
    speed.take_cmdline(["mlx_lm.server", "--prefill-step-size", "0"])
    assert (speed.chunk_tokens, speed.max_tokens) == (2048, 512)


class _Kernel:
    """The kernel's stall as the kernel source reports it, with the detail the cadence reads."""

    name = "kernel"

    def __init__(self, since: float, owed: list[dict]) -> None:
        self.since, self.owed = since, owed

    async def look(self, window: Window) -> Evidence:
        stall = Stall("kernel: 1 client stream(s) open, and no byte sent", key=("kernel", self.since),
                      source="kernel", since=self.since, event="kernel_stall")
        return Evidence(stall=stall, last_flow=self.since, sees_all=True,
                        detail={"kernel": {"owed": self.owed, "streams": 1}})

    async def prime(self) -> None:
        return None


async def test_sight_voids_a_kernel_stall_within_the_pace_and_keeps_one_past_it():
    sight = Sight([_Kernel(100.0, [_stream(100.0)])], _learned(25.0))
    within = await sight.look(Window(100.0, 120.0))
    assert within.stall is None and any(p.startswith("pace: reading a prompt") for p in within.progress)
    past = await sight.look(Window(100.0, 170.0))
    assert past.stall is not None and not any(p.startswith("pace:") for p in past.progress)


class _Reading:
    """A client stream reading a long prompt: its head, then a keepalive (23 bytes, one segment)
    every ``every`` seconds while ``reading``; nothing once it hangs."""

    def __init__(self, every: float) -> None:
        self.every, self.started, self.reading = every, None, True
        self.sent, self.segments, self.last = 248, 1, 0.0

    def __call__(self, ports) -> Reading:
        now = time.monotonic()
        if self.started is not None:
            while self.reading and now - self.last >= self.every:
                self.sent, self.segments, self.last = self.sent + 23, self.segments + 1, self.last + self.every
        conns = (Connection(9, ("127.0.0.1", 40000), (0,), self.sent if self.started else 0,
                            KIB16 if self.started else 0, self.segments),) if self.started else ()
        return Reading(now, conns)

    def start(self) -> None:
        self.started = self.last = time.monotonic()  # type: ignore[assignment]


def _daemon_that_learned(tmp_path, server: StandIn, kernel, chunk: float):
    """The daemon at a fast config (quiet_window 1 s), its state file holding a pace an earlier
    run learned: ``chunk`` seconds a chunk."""
    probe = ProbeConfig(interval=60.0, suspect_interval=1.0, first_token_timeout=30.0, timeout=60.0,
                        quiet_window=1.0, endpoint_timeout=0.5, startup_timeout=30.0)
    daemon, journal, state = _daemon(tmp_path, probe, server, kernel)
    remember_pace(state, chunk)
    return daemon, journal, state


async def test_a_long_prompt_read_in_silent_chunks_draws_no_verdict_and_a_hang_mid_read_does(tmp_path):
    """Measured on main before this change (scaled down 8 times: quiet_window 1 s, a chunk
    3 s): a stream reading a long prompt, with nothing but a keepalive between its chunks, drew
    a kernel stall after the quiet window and a verdict. Now the server's learned pace (kept in
    the state file from an earlier run) allows a chunk's silence; when the keepalives stop (the
    read hung), the stall and the verdict come within about one chunk's bound. Run at a chunk of
    2 s (twice the quiet window) for four chunks (over two and a half chunk bounds of 3 s)."""
    server, kernel = StandIn(), _Reading(every=2.0)
    daemon, journal, state = _daemon_that_learned(tmp_path, server, kernel, chunk=2.0)
    seen: dict[str, float] = {}

    def run(j: Journal) -> bool:
        now = time.monotonic()
        if "from" not in seen and _last_probe_ok(state):
            kernel.start()
            server.delay, seen["from"] = None, now  # the probe queues behind the read
        if "from" in seen and kernel.reading and now - seen["from"] > 8.5:
            assert "kernel_stall" not in _events(j) and "verdict" not in _events(j), _events(j)
            kernel.reading, seen["hung"] = False, now
        return "verdict" in _events(j)

    await _run_until(daemon, journal, run, timeout=60)
    assert "hung" in seen, _events(journal)
    assert time.monotonic() - seen["hung"] < 20.0
    verdict = next(r for r in journal.records() if r["event"] == "verdict")
    assert "nothing sent to any client" in verdict["failures"][-1]


async def test_a_bundle_that_finds_the_server_busy_is_looked_at_again_and_never_restarted(tmp_path):
    """Measured: the bundle taken before the restart said ``busy``, the look-again ended its
    probe on the 8 s quiet in the middle of a chunk, and the restart went ahead; the client's
    answer was lost. Now the verdict is looked at again for a chunk of the server's pace: a sign
    of work (a keepalive here) closes the incident as not hung, ``slow`` is said, nothing is
    restarted."""
    from mlxwatch.capture import Bundle
    from mlxwatch.capture.classify import Classification
    from mlxwatch.config import RestartConfig
    from mlxwatch.daemon.supervisor import Daemon
    from mlxwatch.host.process import ServerLookup
    from mlxwatch.host.sockets import KernelCounters
    from test_delivery_units import _config

    server, kernel = StandIn(), _Reading(every=3.0)
    restarted = tmp_path / "restarted"

    async def busy(request):
        kernel.reading, kernel.last = True, time.monotonic()  # mid-chunk: its next keepalive in 3 s
        return Bundle(tmp_path / "bundle", Classification("busy", "low", ["process CPU busy"]), {})

    probe = ProbeConfig(interval=60.0, suspect_interval=0.5, first_token_timeout=30.0, timeout=60.0,
                        quiet_window=1.0, endpoint_timeout=0.5, startup_timeout=30.0)
    cfg = _config(tmp_path, probe, RestartConfig("command", argv=(
        "python3", "-c", f"open({str(restarted)!r}, 'w').write('x')"), backoff=0.1))
    daemon = Daemon(cfg, cfg.state_dir, shared_overrides={
        "make_client": server.client, "capture_fn": busy, "lookup_fn": lambda *a, **k: ServerLookup(),
        "kernel": KernelCounters(kernel, max_age=0.0)})
    journal = Journal(cfg.state_dir)
    state = cfg.state_dir / "state.json"
    remember_pace(state, 3.0)

    def run(j: Journal) -> bool:
        if _last_probe_ok(state) and server.delay is not None:
            server.delay, kernel.reading = None, False
            kernel.start()  # a stream open, and nothing on it: a verdict after its pace
        return "closed" in _events(j) or "restarting" in _events(j)

    await _run_until(daemon, journal, run, timeout=60)
    events = _events(journal)
    assert "closed" in events and "restarting" not in events, events
    closed = next(r for r in journal.records() if r["event"] == "closed")
    assert "found it busy" in closed["reason"], closed
    assert "slow" in events and not restarted.exists()


def test_doctor_prints_the_learned_pace_and_the_prior_before_anything_is_learned():
    from mlxwatch.config import InstanceConfig
    from mlxwatch.doctor import pace_finding

    inst = InstanceConfig("big", "http://127.0.0.1:9")
    prior = pace_finding(inst, None)
    assert prior.status == "skip" and "the prior (nothing learned yet)" in prior.message
    learned = {"url": inst.url, "cadence": Speed(chunk=Estimate(25.0, 1.0, 6), step=Estimate(0.08, 0.01, 9)).to_dict()}
    found = pace_finding(inst, learned)
    assert found.status == "ok" and "learned from its chunks" in found.message and "decode step ~0.08 s" in found.message
    assert pace_finding(InstanceConfig("big", "http://127.0.0.1:10"), learned).status == "skip"  # another server's


def test_status_says_what_the_server_owes_and_by_when():
    from mlxwatch.daemon.status import _pace_status
    from mlxwatch.output.status import pace_line

    due = time.mktime((2026, 12, 7, 23, 4, 10, 0, 0, -1))
    saved = {"owes": "reading a 3,618-token prompt (2,048 read)", "basis": "~25 s a chunk, learned from its chunks",
             "due": due, "floor": 8.0, "hidden": None, "overdue": None}
    line = pace_line(_pace_status(saved))
    assert line == ("waiting for: reading a 3,618-token prompt (2,048 read) (~25 s a chunk, learned from its "
                    "chunks); next sign due by 23:04:10")
    assert pace_line(_pace_status({**saved, "overdue": "a prompt finished reading 40s ago"})).startswith("overdue:")
    assert _pace_status({"owes": "x\x1b[31m", "due": float("nan")}) == {
        "owes": "x?[31m", "basis": None, "due": None, "floor": None, "hidden": None, "overdue": None}


async def test_the_verdict_record_says_what_the_silence_was_held_against(tmp_path):
    """status and the journal say what the daemon waited for: the verdict carries the learned
    pace and what the server owed at the last look."""
    server, kernel = StandIn(), _Reading(every=3.0)
    daemon, journal, state = _daemon_that_learned(tmp_path, server, kernel, chunk=2.0)

    def run(j: Journal) -> bool:
        if server.delay is not None and _last_probe_ok(state):
            kernel.reading = False
            kernel.start()
            server.delay = None
        return "verdict" in _events(j)

    await _run_until(daemon, journal, run, timeout=60)
    verdict = next(r for r in journal.records() if r["event"] == "verdict")
    assert verdict["pace"]["learned"]["basis"] == "learned from its chunks"  # kept from the earlier run
    assert "owed" in verdict["pace"]


def test_requests_that_keep_arriving_at_a_hung_server_do_not_keep_its_pace_ahead():
    """Measured (bench/sight_detection, a livelock with an app sending a small streamed request
    every 2 s): each new request got its own prompt's reading from its arrival, so the next
    sign was always due later, and no verdict came in 4 minutes. The reading is anchored at the
    first request owed and the last sign since."""
    cadence = _learned(25.0)
    owed = [_stream(100.0 + 2 * i, request_bytes=300) for i in range(30)]  # 60 s of arrivals, ~100 tokens each
    pace = cadence.judge(160.0, 90.0, {"kernel": {"owed": owed, "streams": 30}})
    assert not pace.allows(160.0, 100.0)  # 30 small prompts are not a minute of reading
    early = cadence.judge(101.0, 90.0, {"kernel": {"owed": owed[:1], "streams": 1}})
    assert early.owes == "reading a prompt of ~100 tokens" and early.allows(101.0, 100.0)
    # Those that arrive after the first one's reading was due add nothing to it: the quiet
    # window is what is left (measured: 84 s for a livelock with an app, bench.sight_detection).
    later = cadence.judge(109.0, 90.0, {"kernel": {"owed": owed[:5], "streams": 5}})
    assert later.allows(107.0, 100.0) and not later.allows(109.0, 100.0)


def test_a_client_that_retries_does_not_renew_the_pace():
    """Measured (the real long-run test): a livelock with a client retrying every 2 s drew no
    verdict in a minute: each retry was a new request, owed its own reading and a few steps
    from its arrival. One episode of owing runs from the first of them until a sign of work."""
    cadence = _learned(2.0)
    retry = [{"arrived": 100.0 + 2 * i, "request_bytes": 3000, "streamed": False} for i in range(20)]
    paces = [cadence.judge(100.5 + 2 * i, 90.0, {"kernel": {"owed": [retry[i]], "streams": 0, "cpu": 0.0}})
             for i in range(20)]
    assert paces[0].hidden and not paces[-1].hidden  # 40 s of retries: the first one's allowance is long over
    fresh = Cadence(Speed(chunk=Estimate(2.0, 0.1, 10), step=Estimate(0.05, 0.005, 10)))
    fresh.judge(100.5, 90.0, {"kernel": {"owed": [retry[0]], "streams": 0, "cpu": 0.0}})
    after_sign = fresh.judge(138.2, 137.5, {"kernel": {"owed": [retry[19]], "streams": 0, "cpu": 0.0}})
    assert after_sign.hidden  # a sign of work began a new episode: the new request's own allowance


def test_a_probe_whose_prompt_the_server_had_cached_is_no_sample():
    """Measured (the lab's livelock-after-N/N test): the probe's prompt never changes, so the
    server's prompt cache held all but a token of it, its first token came at once, and a 25 s
    chunk was taken for 5 s: a verdict in the middle of a read."""
    cadence = Cadence()
    cadence.probe_done(0.02, [0.01], prompt_tokens=25, cached_tokens=24)
    assert cadence.speed.probe_read is None and cadence.speed.chunk_time()[0] == PRIOR_CHUNK
    cadence.probe_done(1.2, [0.01], prompt_tokens=25, cached_tokens=0)
    assert cadence.speed.probe_read == 1.2 / 25



def test_two_chunks_read_from_the_log_in_one_go_are_timed_by_their_stamps(tmp_path):
    """Measured on the real server (CI's shared lab): a 3,007-token prompt's chunk lines, 1.6 s
    apart, were read in one poll (the daemon reads the log every 2 s while healthy), timed 0 s
    apart, and taught nothing: the pace stayed the prior (a minute a chunk), and a livelock with
    an app streaming was called 123 s after it began. The lines' own stamps time them."""
    from lab.evidence import LogLooks
    from mlxwatch.evidence.log import ProgressTracker

    log = tmp_path / "server.log"
    log.write_text("")
    looks = LogLooks(ProgressTracker(log))
    looks.prime()
    with log.open("a") as fh:
        fh.write("2026-12-07 04:48:44,690 - INFO - Prompt processing progress: 2048/3007\n"
                 "2026-12-07 04:48:46,323 - INFO - Prompt processing progress: 3006/3007\n"
                 "2026-12-07 04:48:46,329 - INFO - Prompt processing progress: 3007/3007\n")
    detail = looks.observe(None).detail
    (sample,) = detail["log"]["token_seconds"]
    assert abs(sample - 1.633 / 958) < 1e-6
    cadence = Cadence()
    cadence.judge(1.0, None, detail)
    assert cadence.speed.chunk is not None and abs(cadence.speed.chunk.mean - 1.633 / 958 * 2048) < 1e-3
    with log.open("a") as fh:  # lines without a stamp (another logging format): timed by the reads
        fh.write("Prompt processing progress: 2048/5000\nPrompt processing progress: 4096/5000\n")
    assert looks.observe(None).detail["log"]["token_seconds"] == []


def test_prompts_read_together_are_timed_by_all_their_tokens(tmp_path):
    """mlx-lm reads a chunk of every waiting prompt in one batch step. Measured (three agents'
    3,600-token prompts at 12 ms a token): a line of each prompt every 87 s; timed by one
    prompt's 2,048 tokens the pace was 42 ms a token, three times the server's, and a hang
    among non-streamed answers would have waited three times too long."""
    from lab.evidence import LogLooks
    from mlxwatch.evidence.log import ProgressTracker

    log = tmp_path / "server.log"
    log.write_text("")
    looks = LogLooks(ProgressTracker(log))
    looks.prime()
    with log.open("a") as fh:
        for stamp, x in (("05:21:24,549", 2048), ("05:22:51,549", 3590)):
            for y in (3590, 3608, 3600):
                fh.write(f"2026-12-07 {stamp} - INFO - Prompt processing progress: {min(x, y)}/{y}\n")
    (first, *_) = looks.observe(None).detail["log"]["token_seconds"]
    assert abs(first - 87.0 / (3590 - 2048 + 2 * 2048)) < 1e-4  # the step read the other two prompts' chunks too


def test_prompts_read_together_owe_their_next_line_after_a_chunk_of_each(tmp_path):
    """Three prompts announced by one step (their lines logged together) are read a chunk each
    in the next: the next line is due after three chunks' time, not one (one chunk of 25 s
    would have called a verdict in the middle of a 75 s step)."""
    from lab.evidence import LogLooks
    from mlxwatch.evidence.log import ProgressTracker

    log = tmp_path / "server.log"
    log.write_text("")
    looks = LogLooks(ProgressTracker(log))
    looks.prime()
    with log.open("a") as fh:
        fh.write("2026-12-07 05:20:00,000 - INFO - Prompt processing progress: 2048/9000\n")  # left mid-read
        for y in (3590, 3608, 3600):
            fh.write(f"2026-12-07 05:21:24,549 - INFO - Prompt processing progress: 2048/{y}\n")
    detail = looks.observe(None).detail
    assert detail["log"]["together"] == [3590, 3600, 3608]
    cadence = _learned(25.0)
    chunk = cadence.speed.chunk_time()[0]
    pace = cadence.judge(looks.t, None, detail)
    assert pace.due is not None and abs(pace.due - looks.t - (1542 + 1560 + 1552) / 2048 * chunk) < 1e-6
    assert pace.owes == "reading 3 prompts, a chunk of each a step"


def test_keepalives_of_two_streams_are_no_chunk():
    """Measured (bench.patience, hangs mid-prefill): a hung prompt's last keepalive, a restart,
    and the next prompt's first keepalive three minutes later were taken for one chunk: 184 s
    "a chunk" learned, and the next hang waited that long. Only two keepalives on one stream
    time a chunk."""
    from test_evidence import conn, looks, source

    hung, nxt = 5000, 5001
    src = source([conn(hung, 0, 0)], [conn(hung, 248, 1)], [conn(hung, 248 + 23, 2)],  # head, a keepalive
                 [conn(nxt, 0, 0)], [conn(nxt, 248, 1)], [conn(nxt, 248 + 23, 2)],  # another stream, later
                 [conn(nxt, 248 + 46, 3)])  # ... its second keepalive
    got = looks(src, 1.0, 2.0, 3.0, 180.0, 181.0, 182.0, 206.0)
    assert got.detail["kernel"]["keepalive_gaps"] == [24.0]
    cadence = Cadence()
    cadence.judge(206.0, None, got.detail)
    assert cadence.speed.chunk is not None and cadence.speed.chunk.mean == 24.0


def test_a_prompt_is_never_timed_across_a_server_restart(tmp_path):
    """A prompt hung mid-read, the server restarted, and the next prompt of its size (the same
    request sent again) is read: its first line is no chunk after the hung one's (minutes
    apart), however much else was read between them, and the hung prompt is no longer open."""
    from lab.evidence import LogLooks
    from mlxwatch.evidence.log import ProgressTracker

    log = tmp_path / "server.log"
    log.write_text("")
    looks = LogLooks(ProgressTracker(log))
    looks.prime()
    with log.open("a") as fh:
        fh.write("2026-12-07 05:20:00,000 - INFO - Prompt processing progress: 2048/3608\n")
    assert looks.observe(None).detail["log"]["open"].keys() == {3608}
    with log.open("a") as fh:
        fh.write("2026-12-07 05:23:00,000 - INFO - Starting httpd at 127.0.0.1 on port 8080...\n"
                 "2026-12-07 05:23:10,000 - INFO - Prompt processing progress: 900/900\n"
                 "2026-12-07 05:23:30,000 - INFO - Prompt processing progress: 2048/3608\n")
    detail = looks.observe(None).detail["log"]
    assert detail["token_seconds"] == [] and list(detail["open"]) == [3608]
    with log.open("a") as fh:  # the same size again, in the same process: a new request, no chunk
        fh.write("2026-12-07 05:23:40,000 - INFO - Prompt processing progress: 700/700\n"
                 "2026-12-07 05:24:30,000 - INFO - Prompt processing progress: 2048/3608\n")
    assert looks.observe(None).detail["log"]["token_seconds"] == []


def test_a_probes_hint_slower_than_the_prior_is_its_own_bound_with_no_margin():
    """Measured (bench.patience under load): the lab's probes hinted 88 s a chunk of a server
    reading 25 s chunks; with 1.5 hints (132 s) a hang mid-read was called 132 s after it began.
    Past the prior (the largest models' pace) the hint is its own bound: it is already doubled."""
    speed = Speed(probe_read=88.0 / 2048 / 2)
    assert speed.chunk_time() == (88.0, "from its probes' first tokens")
    assert speed.chunk_typical() == 44.0  # what the probes measured, not doubled
    fast = Speed(probe_read=10.0 / 2048 / 2)
    assert fast.chunk_time()[0] == 15.0 and fast.chunk_typical() == 5.0
    near = Speed(probe_read=50.0 / 2048 / 2)  # 1.5 hints pass the prior, the hint does not: the prior
    assert near.chunk_time()[0] == PRIOR_CHUNK


def test_a_server_slower_than_the_prior_is_given_its_second_chunk():
    """Measured (bench.patience, 30 ms a token, the process idle, one streamed 3,608-token
    prompt): the probes had measured 30 ms a token, the bound was capped at the prior (60 s a
    chunk), and the second chunk (1,560 tokens) was due 45.7 s after the first; it was logged
    47.7 s after it, 1 s after the verdict, and the answer was lost."""
    cadence = Cadence(Speed(probe_read=0.030), quiet_window=8.0, grace_ceiling=600.0)
    log = {"followed": True, "open": {3608: (2048, 62.0)}, "completed": []}
    detail = {"log": log, "kernel": {"owed": [_stream(0.0)], "streams": 1}}
    pace = cadence.judge(62.0 + 47.7, 62.0, detail)
    assert pace.allows(62.0 + 47.7, 62.0) and pace.owes == "reading a 3,608-token prompt (2,048 read)"
    assert "~61 s a chunk" in pace.basis
    assert not cadence.judge(62.0 + 150.0, 62.0, detail).allows(62.0 + 150.0, 62.0)  # a hang mid-read: still called


def test_an_apps_small_prompts_running_late_on_a_computing_server_get_as_long_again_not_a_chunk():
    """Measured (bench.sight_detection, the app streaming a 5-word prompt every 2 s, the
    livelock that computes): the probes hinted 8.6 s a chunk (25.8 s its bound); ten new small
    prompts were owed 6 s of reading, and running late while the process computed bought them a
    whole chunk more: the verdict came 54-56 s after the onset (goal 30 s). Now as long again."""
    cadence = Cadence(Speed(probe_read=0.0042), quiet_window=8.0, grace_ceiling=600.0)
    owed = [_stream(100.0 + 2 * i, 150) for i in range(10)]
    detail = {"kernel": {"owed": owed, "streams": 10, "cpu": 0.93}}
    assert cadence.judge(105.0, None, detail).allows(105.0, 100.0)  # the quiet window
    late = cadence.judge(112.0, None, detail)  # the first prompt's reading, late while computing: 1.3 s
    assert not late.allows(112.0, 100.0), late
    big = _learned(25.0)  # a full chunk owed: a chunk more, as before
    one = {"kernel": {"owed": [_stream(0.0)], "streams": 1, "cpu": 0.9}}
    assert big.judge(60.0, None, one).allows(60.0, 0.0) and not big.judge(80.0, None, one).allows(80.0, 0.0)


def test_a_finished_prompt_is_overdue_after_what_the_prompts_read_meanwhile_take_not_a_chunk():
    """Measured (bench.sight_detection, 0.31.3, the livelock that computes, the app streaming a
    5-word prompt every 2 s): each app prompt was read (logged ``N/N``) and got no token, and the
    next app prompt being read added a whole chunk to the token's allowance (23.6 s at a fresh
    daemon's hinted pace): the verdict came 48-50 s after the onset (goal 30 s). The prompts read
    meanwhile take what their tokens take."""
    cadence = Cadence(Speed(probe_read=0.003838), quiet_window=8.0, grace_ceiling=600.0)
    cadence.last_token = 99.0
    owed = [_stream(100.0 + 2 * i, 150) for i in range(11)]  # the last, at 120 s, is being read
    log = {"followed": True, "open": {}, "completed": [(100.5 + 2 * i, 20) for i in range(10)]}
    pace = cadence.judge(121.0, 120.5, {"log": log, "kernel": {"owed": owed, "streams": 11}})
    assert pace.overdue and "finished reading 20s ago" in pace.overdue, pace
    assert pace.allows(121.0, 120.5)  # the prompt being read still has its reading: the overdue token decides


def test_a_stream_first_seen_past_its_head_is_matched_to_the_prompt_the_log_read():
    """Measured (bench.patience, livelock after a long prefill, the daemon healthy and reading
    the kernel every 5 s): the agent's stream was first seen with its head already out, its
    request's size was not kept, it matched no prompt the log read, and the token its finished
    prompt owed was never overdue: the livelock was called 147 s after its onset (goal 60 s)."""
    from test_evidence import conn, looks, source

    src = source([conn(5000, 248, 1, received=14_600)], [conn(5000, 248 + 23, 2, received=14_600)])
    got = looks(src, 1.0, 2.0)
    (owed,) = got.detail["kernel"]["owed"]
    assert owed["request_bytes"] == 14_600 and owed["streamed"]
    cadence = _learned(25.0)
    detail = {**got.detail, "log": {"followed": True, "open": {}, "completed": [(3.0, 3608)], "token_seconds": []}}
    pace = cadence.judge(3.0 + 8.0 + 1.0, None, detail)  # the floor (quiet_window 8 s) past the N/N
    assert pace.overdue is not None and "finished reading" in pace.overdue


def test_three_long_prompts_read_together_at_the_slowest_row_are_held_at_the_defaults():
    """Measured (bench.patience, 60 ms a token, not streamed, the process idle): three 3,600-token
    prompts read together send nothing to anyone for ~650 s (a step of 369 s reads a chunk of
    each); `grace_ceiling` (then 10 min) ended both the answers' allowance and the policy's hold:
    a verdict at 610 s, 0 of 3 answered, twice. At the defaults both hold past the answers."""
    ceiling = ProbeConfig().grace_ceiling
    speed = Speed(chunk=Estimate(123.0, 123.0 / 20, 10), step=Estimate(0.06, 0.006, 10))
    cadence = Cadence(speed, quiet_window=ProbeConfig().quiet_window, grace_ceiling=ceiling)
    owed = [{"arrived": 0.0, "request_bytes": KIB16, "streamed": False} for _ in range(3)]
    log = {"followed": True, "open": {y: (2048, 369.0) for y in (3590, 3600, 3608)}, "completed": [],
           "together": [3590, 3600, 3608]}
    for now in (300.0, 640.0, 700.0):  # before and after the step's lines; the answers come at ~650 s
        detail = {"kernel": {"owed": owed, "streams": 0, "cpu": 0.0}, **({"log": log} if now > 369 else {})}
        pace = cadence.judge(now, 369.0 if now > 369 else None, detail)
        assert pace.hidden and pace.allows(now, 0.0), (now, pace)
    detect = Detection(ProbeConfig().failures, ceiling)
    detect.success()
    assert not any(detect.failure(30.0 + 10 * i, ["3 non-streamed answers may be in the making"]) for i in range(68))
