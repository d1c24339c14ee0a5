"""Kernel sight in the daemon, with the kernel's readings given by the test: the rules of
docs/deciding.md ("Kernel sight") end to end through the real watcher, policy and journal."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from mlxwatch.config import ProbeConfig
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.host.process import ServerLookup
from mlxwatch.host.sockets import KernelCounters
from mlxwatch.journal.incidents import Journal
from lab.evidence import KernelAnswers, KernelShows
from mlxwatch.config import RestartConfig
from mlxwatch.restart.methods import OK, RestartOutcome
from lab.daemon import remember_pace
from test_delivery_units import StandIn, _capture_nothing, _config, _events, _last_probe_ok, _run_until

pytestmark = pytest.mark.usefixtures("kernel_read_often")  # a wait that is not the point


def _daemon(tmp_path, probe: ProbeConfig, server: StandIn, kernel, restart_cfg: RestartConfig = RestartConfig(),
            **overrides):
    cfg = _config(tmp_path, probe, restart_cfg)
    daemon = Daemon(cfg, cfg.state_dir, shared_overrides={
        "make_client": server.client, "capture_fn": _capture_nothing, "lookup_fn": lambda *a, **k: ServerLookup(),
        "kernel": KernelCounters(kernel, max_age=0.0), **overrides})
    return daemon, Journal(cfg.state_dir), cfg.state_dir / "state.json"


async def _restarted(ctx) -> RestartOutcome:
    return RestartOutcome(OK, "restarted (a stand-in)")


RESTART = RestartConfig("command", argv=("true",), backoff=0.0)
# One instance probed every second, a failure confirmed at once, nothing flowing for 1 s ends a wait.
QUICK = ProbeConfig(interval=1.0, suspect_interval=0.4, first_token_timeout=30.0, timeout=60.0,
                    quiet_window=1.0, endpoint_timeout=0.5, startup_timeout=30.0)


async def _hung_once_healthy(tmp_path, server: StandIn, hang, timeout: float) -> tuple[float, dict]:
    """Run a daemon (``QUICK``, no client stream) until its verdict, ``hang()`` called once the
    first probe passed: the seconds from then to the verdict, and the verdict's record."""
    daemon, journal, state = _daemon(tmp_path, QUICK, server, KernelShows(streams=0))
    seen: dict[str, float] = {}

    def hung(j: Journal) -> bool:
        if "from" not in seen and _last_probe_ok(state):
            hang()
            seen["from"] = time.monotonic()
        return "verdict" in _events(j)

    await _run_until(daemon, journal, hung, timeout=timeout)
    took = time.monotonic() - seen["from"]
    return took, next(r for r in journal.records() if r["event"] == "verdict")


async def test_nothing_flowing_anywhere_ends_a_probes_wait_after_the_quiet_window(tmp_path):
    """A server nobody else uses hangs: without kernel sight each probe waits out its
    first-token timeout (30 s here, 45 s at the defaults); with it, the wait ends once nothing
    has been sent to any client for quiet_window."""
    server = StandIn()
    took, verdict = await _hung_once_healthy(tmp_path, server, lambda: setattr(server, "delay", None), timeout=40)
    assert took < 15.0
    assert "nothing sent to any client" in verdict["failures"][-1]


async def test_a_failure_the_quiet_window_ended_is_confirmed_at_once_not_after_suspect_interval(tmp_path):
    """Measured at the defaults with no client traffic (bench/sight_detection): 42-50 s from a
    hang to its verdict, 10 s of it the wait of suspect_interval between a probe that had
    already watched nothing flow anywhere for quiet_window and the probe confirming it. Now the
    confirming probe goes at once (suspect_interval 6 s here)."""
    sent: list[float] = []

    class Counted(StandIn):
        async def handle(self, request):
            if request.url.path == "/v1/chat/completions":
                sent.append(time.monotonic())
            return await super().handle(request)

    server, kernel = Counted(), KernelShows(streams=0)
    probe = ProbeConfig(interval=8.0, suspect_interval=6.0, first_token_timeout=30.0, timeout=60.0,
                        quiet_window=1.0, endpoint_timeout=0.5, startup_timeout=30.0)
    daemon, journal, state = _daemon(tmp_path, probe, server, kernel)
    seen: dict[str, int] = {}

    def hung(j: Journal) -> bool:
        if "from" not in seen and _last_probe_ok(state):
            server.delay, seen["from"] = None, len(sent)
        return "verdict" in _events(j)

    await _run_until(daemon, journal, hung, timeout=60)
    first, confirming = sent[seen["from"]:seen["from"] + 2]
    assert confirming - first < 4.5  # its 1 s wait and at once: not 1 s and 6 s
    verdict = next(r for r in journal.records() if r["event"] == "verdict")
    assert len(verdict["failures"]) == 2 and all("nothing sent to any client" in f for f in verdict["failures"])


class _Tokens(httpx.AsyncByteStream):
    """A probe's stream: ``first`` tokens ``every`` seconds apart, then (``stop``) nothing, or [DONE]."""

    def __init__(self, first: int, every: float, stop: bool) -> None:
        self.first, self.every, self.stop = first, every, stop

    async def __aiter__(self):
        for _ in range(self.first):
            yield f"data: {json.dumps({'choices': [{'delta': {'content': 'x'}}]})}\n\n".encode()
            await asyncio.sleep(self.every)
        if self.stop:
            await asyncio.sleep(3600)
        yield b"data: [DONE]\n\n"


class _FirstTokenThenNothing(StandIn):
    """Healthy until ``livelock``: then each stream gets its prompt's first token and nothing more."""

    livelock = False

    async def handle(self, request):
        if request.url.path != "/v1/chat/completions" or not self.livelock:
            return await super().handle(request)
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Tokens(1, 0.0, True))


async def test_a_probe_given_one_token_then_nothing_is_cut_short_not_left_to_its_whole_timeout(tmp_path):
    """Measured (bench.patience, the report's shape at 12 ms a token): the probe read with the
    prompt's last chunk got its first token, then nothing, and waited out the whole stream's
    timeout (90 s): the verdict came 60.5 s after the onset (goal 60 s). Nothing flowing
    anywhere, the probe's own stream included, ends its wait as it does before a first token."""
    server = _FirstTokenThenNothing()
    took, verdict = await _hung_once_healthy(tmp_path, server, lambda: setattr(server, "livelock", True), timeout=70)
    assert took < 20.0  # not the stream's 60 s timeout
    assert "1 tokens, then nothing; the wait ended early" in verdict["failures"][0], verdict["failures"]


async def test_a_probes_own_slow_tokens_are_flow_its_wait_is_not_cut(tmp_path):
    """The kernel leaves the daemon's own connections out, so a probe whose own tokens come
    slowly (0.5 s apart, 6 s in all) while no client is served must not be cut at the quiet
    window (1 s) counted from its sending: its own tokens are the flow (before, the wait was
    cut only until a first token came)."""
    class Slow(StandIn):
        async def handle(self, request):
            if request.url.path != "/v1/chat/completions":
                return await super().handle(request)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=_Tokens(8, 0.5, False))

    server = Slow()
    daemon, journal, state = _daemon(tmp_path, QUICK, server, KernelShows(streams=0))

    def probed(j: Journal) -> bool:
        try:
            last = json.loads(state.read_text())["instances"]["x"].get("last_probe") or {}
        except (OSError, ValueError, KeyError):
            return False
        return last.get("tokens") == 8 or "suspect" in _events(j)

    await _run_until(daemon, journal, probed, timeout=60)
    assert "verdict" not in _events(journal) and "suspect" not in _events(journal), _events(journal)


async def test_tokens_the_kernel_sees_sent_to_other_clients_make_it_slow_never_hung(tmp_path):
    """Every probe fails its deadline, but another client's stream keeps receiving token events:
    the server works (slow); when that stream stops too, the verdict comes."""
    server, kernel = StandIn(), KernelShows(streams=1)
    probe = ProbeConfig(interval=0.5, suspect_interval=0.3, first_token_timeout=0.5, timeout=1.0, quiet_window=1.0,
                        endpoint_timeout=0.5, startup_timeout=30.0)
    daemon, journal, state = _daemon(tmp_path, probe, server, kernel)
    seen: dict[str, object] = {}

    def phases(j: Journal) -> bool:
        if "slow_from" not in seen:
            if _last_probe_ok(state):
                kernel.flowing, server.delay, seen["slow_from"] = True, None, time.monotonic()
            return False
        if "stop_from" not in seen:
            if time.monotonic() - seen["slow_from"] > 4.0:  # type: ignore[operator]
                seen["while_slow"] = _events(j)
                kernel.flowing, seen["stop_from"] = False, time.monotonic()
            return False
        return "verdict" in _events(j)

    await _run_until(daemon, journal, phases, timeout=40)
    assert "verdict" not in seen["while_slow"] and "slow" in seen["while_slow"], seen["while_slow"]
    slow = next(r for r in journal.records() if r["event"] == "slow")
    assert any("bytes of tokens sent to clients" in line for line in slow["evidence"])


async def test_client_streams_left_without_a_byte_are_a_stall_and_the_next_probe_decides(tmp_path):
    """An app's stream stops receiving bytes while the daemon's next probe is far off (interval
    60 s): the stall is seen within the quiet window, journaled, and the probe it brings at once
    is decisive (the stall was the first failure)."""
    server, kernel = StandIn(), KernelShows(streams=1)
    probe = ProbeConfig(interval=60.0, suspect_interval=10.0, first_token_timeout=30.0, timeout=60.0,
                        quiet_window=1.0, endpoint_timeout=0.5, startup_timeout=30.0)
    daemon, journal, state = _daemon(tmp_path, probe, server, kernel)
    # A pace learned earlier (1 s a chunk): else the first probe's time to first token hints at
    # it, and on a loaded machine that hint let the open stream read a prompt for 12 to 38 s.
    remember_pace(state, 1.0)
    seen: dict[str, float] = {}

    def stalled(j: Journal) -> bool:
        if "from" not in seen and _last_probe_ok(state):
            kernel.flowing = True  # the app's tokens flow a while, then the server hangs
            server.delay, seen["from"] = None, time.monotonic()
        if "from" in seen and kernel.flowing and time.monotonic() - seen["from"] > 1.0:
            kernel.flowing = False
        return "verdict" in _events(j)

    await _run_until(daemon, journal, stalled, timeout=40)
    assert time.monotonic() - seen["from"] < 20.0  # not the 60 s interval, nor two 30 s waits
    events = _events(journal)
    assert events.index("kernel_stall") < events.index("verdict")
    stall = next(r for r in journal.records() if r["event"] == "kernel_stall")
    assert "1 client stream(s) open, and no byte sent to any client" in stall["reason"]
    assert next(r for r in journal.records() if r["event"] == "verdict")["failures"].__len__() == 1


async def test_the_look_again_counts_an_answer_that_lands_while_its_probe_waits(tmp_path):
    """Measured with the openai SDK not streaming: the look-again's probe was sent, the clients
    got their 3 answers 1.3-5.4 s later, and the look-again logged "nothing sent to any client
    for 18s" and restarted anyway. An answer sent whole while it waits is a delivery: nothing
    is restarted (the incident closes as recovered)."""
    server, kernel = StandIn(), KernelAnswers()
    probe = ProbeConfig(interval=1.0, suspect_interval=0.4, first_token_timeout=30.0, timeout=60.0,
                        quiet_window=3.0, endpoint_timeout=0.5, startup_timeout=30.0)
    restarts: list[object] = []

    async def restart(ctx) -> RestartOutcome:
        restarts.append(ctx)
        return await _restarted(ctx)

    daemon, journal, state = _daemon(tmp_path, probe, server, kernel, RESTART, restart_fn=restart)
    seen: dict[str, float] = {}

    def phases(j: Journal) -> bool:
        if "from" not in seen and _last_probe_ok(state):
            server.delay, seen["from"] = None, time.monotonic()
        events = _events(j)
        if "captured" in events and "answer_at" not in seen:
            seen["answer_at"] = time.monotonic() + 1.3  # the look-again's probe is on its way by then
        if "answer_at" in seen and "answered" not in seen and time.monotonic() >= seen["answer_at"]:
            kernel.answer()
            seen["answered"] = 1
        return "recovered" in events or "restart" in events

    await _run_until(daemon, journal, phases, timeout=60)
    events = _events(journal)
    assert "restart" not in events and not restarts, events
    recovered = next(r for r in journal.records() if r["event"] == "recovered")
    assert "answers again" in recovered["how"], recovered


async def test_recovery_is_verified_by_answers_to_clients_while_the_probe_still_fails(tmp_path):
    """Measured: `not_recovered` ("not healthy 600s after the restart") while 6 requests were
    answered, then a second restart killed 3 more. Answers to clients after the restart verify
    it, as a probe's would, and at once: the recovery's probe stops waiting at the first
    (measured: recovered 30 s after the restart, the probe's first-token timeout, while the
    answers flowed from its first second)."""
    server, kernel = StandIn(), KernelAnswers()
    probe = ProbeConfig(interval=1.0, suspect_interval=0.4, first_token_timeout=30.0, timeout=60.0,
                        quiet_window=1.0, endpoint_timeout=0.5, startup_timeout=8.0)
    daemon, journal, state = _daemon(tmp_path, probe, server, kernel, RESTART, restart_fn=_restarted)
    seen: dict[str, float] = {}

    def phases(j: Journal) -> bool:
        if "from" not in seen and _last_probe_ok(state):
            server.delay, seen["from"] = None, time.monotonic()
        events = _events(j)
        if "restart" in events and time.monotonic() - seen.get("answered", 0.0) > 1.0:
            kernel.answer()  # the restarted server answers its clients, slowly for the probe
            seen["answered"] = time.monotonic()
        return "recovered" in events or "not_recovered" in events

    await _run_until(daemon, journal, phases, timeout=60)
    events = _events(journal)
    assert "recovered" in events and "not_recovered" not in events, events
    recovered = next(r for r in journal.records() if r["event"] == "recovered")
    assert "answer(s) to clients completed" in recovered["how"], recovered
    restart = next(r for r in journal.records() if r["event"] == "restart")
    assert recovered["ts"] - restart["ts"] < 15.0, (restart["ts"], recovered["ts"])  # not the probe's 30 s


async def test_status_shows_what_kernel_sight_sees(tmp_path):
    """Measured (issue 33): the text status never mentioned kernel sight, and `status --json`
    said only "kernel_sight": "ok". Now both say what it sees per instance: client streams,
    requests waiting for an answer, and when a byte last went to any client."""
    from mlxwatch.daemon.status import collect_status
    from mlxwatch.output.status import status_lines

    server, kernel = StandIn(), KernelShows(streams=2, flowing=True)
    probe = ProbeConfig(interval=0.5, suspect_interval=0.3, first_token_timeout=5.0, timeout=10.0,
                        endpoint_timeout=0.5, startup_timeout=30.0)
    daemon, journal, state = _daemon(tmp_path, probe, server, kernel)
    seen: dict[str, float] = {}

    def watched(j: Journal) -> bool:
        if "from" not in seen and _last_probe_ok(state):
            seen["from"] = time.monotonic()
        return "from" in seen and time.monotonic() - seen["from"] > 3.0

    await _run_until(daemon, journal, watched, timeout=40)
    status = collect_status(_config(tmp_path, probe), tmp_path / "state")
    [inst] = status["instances"]
    assert inst["kernel_sight"] == "ok"
    kernel_seen = inst["kernel"]
    assert (kernel_seen["streams"], kernel_seen["waiting"]) == (2, 0), kernel_seen
    assert time.time() - kernel_seen["last_flow_at"] < 30, kernel_seen
    lines = [t.plain for t in status_lines(status, 200)]
    assert any(line.startswith("  kernel sight: 2 client stream(s), 0 request(s) waiting, last byte to a client ")
               for line in lines), lines


def test_the_startup_line_says_a_stall_kernel_sight_saw_makes_one_probe_decide():
    """Found by a user (issue 33): the startup line said "2 failed probes in a row make a
    verdict", then the log said "HUNG after 1 failed probe(s)" (a stall kernel sight saw was
    the first failure). The line now says so; with kernel sight off, it does not."""
    from mlxwatch.config import InstanceConfig
    from mlxwatch.output.daemon import watch_plan

    seeing, blind = InstanceConfig("lab", "http://127.0.0.1:9"), InstanceConfig("lab", "http://127.0.0.1:9", kernel="off")
    line = watch_plan([(seeing, ServerLookup())], time.time())[0]
    assert line.endswith("2 failed probes in a row make a verdict; after a stall kernel sight saw, the one probe "
                         "that confirms it decides"), line
    assert watch_plan([(blind, ServerLookup())], time.time())[0].endswith("2 failed probes in a row make a verdict")
