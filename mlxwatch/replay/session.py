"""One replay: send recorded requests to a server, in order and with their timing, and judge
delivery the way the daemon does.

The requests go through a front door of the replay's own (``mlxwatch.front``, on a free
loopback port, recording), so every token each one gets is counted by the daemon's ledger, and
the daemon's rules decide: requests in flight and no token to anyone for ``stall_timeout``
(``evidence.door.stall_of``) make the server suspect at once, and the probe that follows
(``probes.run_check``, its first-token wait cut at ``stall_timeout`` as the daemon's is behind
a door) decides through the verdict policy (``verdict.policy.Detection``: the stall is the
first failure, so a failed probe with nothing delivered meanwhile is the verdict; a token
delivered meanwhile makes it slow, never hung). Nothing here is a second judge::

    outcome = await replay(requests, url, ReplayOptions(speed=2.0))
    outcome.hung, outcome.after_seq, outcome.verdict_after_s

The bodies sent are the recorded bytes; the door passes them on as they are (with its own
``Host`` and ``Content-Length``, as it did when they were recorded).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import httpx

from mlxwatch.capture.requests import StoredRequest
from mlxwatch.config import FrontConfig, ProbeConfig
from mlxwatch.evidence import Window
from mlxwatch.evidence.door import DoorSource, stall_of
from mlxwatch.front import wire
from mlxwatch.front.door import FrontDoor
from mlxwatch.front.recorder import RecordedRequest
from mlxwatch.probes import run_check
from mlxwatch.probes.check import make_client
from mlxwatch.replay.options import ReplayOptions
from mlxwatch.verdict.policy import Detection

LOOK_EVERY = 0.1  # seconds between looks at the door's ledger
NOT_SENT = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "expect", "te",
                      "upgrade", "trailer", "proxy-connection"})  # this hop's own: the client sets them


@dataclass(frozen=True)
class Answer:
    """What one replayed request got."""

    seq: int
    status: int | None
    bytes_in: int
    error: str | None = None


@dataclass(frozen=True)
class ReplayOutcome:
    hung: bool
    reason: str  # the verdict's reason, or why there was none
    sent: int  # requests sent, all rounds
    rounds: int  # rounds begun
    after_seq: int | None = None  # the last request sent before delivery stopped (its recorded seq)
    in_flight: tuple[int, ...] = ()  # requests in flight at the verdict (recorded seqs)
    verdict_after_s: float | None = None  # from the round's first request to the verdict
    quiet_s: float | None = None  # how long nothing had been delivered at the verdict
    unreachable: str | None = None  # the server could not be reached: the replay could not run
    answers: tuple[Answer, ...] = ()
    recorded: tuple[RecordedRequest, ...] = field(default=(), repr=False)  # what the door passed, at the verdict
    recorded_at: float | None = None


async def replay(requests: Sequence[StoredRequest], url: str, opts: ReplayOptions,
                 on_round: Callable[[int], None] | None = None) -> ReplayOutcome:
    """Send ``requests`` to ``url`` (``opts.repeat`` rounds, each after the last one ended) and
    judge delivery; see the module docstring."""
    door = FrontDoor("replay", url, _door_config(requests, opts))
    await door.start()
    host, port = door.address
    base = f"http://{host}:{port}"
    sent = 0
    answers: list[Answer] = []
    try:
        async with replay_client(opts) as client:
            for round_no in range(1, opts.repeat + 1):
                if on_round is not None:
                    on_round(round_no)
                outcome = await _round(door, client, base, url, requests, opts, answers)
                sent += outcome.sent
                if outcome.hung or outcome.unreachable:
                    return replace(outcome, sent=sent, rounds=round_no, answers=tuple(answers))
        return ReplayOutcome(False, f"delivery never stopped: {sent} request(s) in {opts.repeat} round(s) all "
                                    "answered by the daemon's rules", sent, opts.repeat, answers=tuple(answers))
    finally:
        await door.stop(drain=0.5)


def replay_client(opts: ReplayOptions) -> httpx.AsyncClient:
    """The client that sends the recorded requests: none of httpx's own headers (``Accept``,
    ``Accept-Encoding``, ``User-Agent``) are added to what was recorded (an adversarial review:
    every replayed request carried all three, and ``Accept-Encoding`` changes what a server
    sends); httpx still sets the hop's own (``Host``, ``Content-Length``)."""
    client = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(opts.request_timeout),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
    client.headers.clear()
    return client


def _door_config(requests: Sequence[StoredRequest], opts: ReplayOptions) -> FrontConfig:
    """The replay's door, its limits raised to the recorded requests: with the defaults' a body
    over ``front.max_body`` (recorded by the shim, which has none, or a door set higher) got 413
    from this door, never reached the server, and the replay said "not reproduced"."""
    d = FrontConfig()
    bodies = [len(r.body) for r in requests]
    heads = [len(r.method) + len(r.target) + sum(len(k) + len(v) + 4 for k, v in r.headers) + 256 for r in requests]
    return FrontConfig(listen=("127.0.0.1", 0), stall_timeout=opts.stall_timeout,
                       request_stall_timeout=opts.request_timeout, record=True,
                       max_body=max([d.max_body, *bodies]), max_header=max([d.max_header, *heads]),
                       max_buffered=max(d.max_buffered, sum(bodies)),
                       record_max_bytes=max(d.record_max_bytes, sum(bodies)))


async def _round(door: FrontDoor, client: httpx.AsyncClient, base: str, url: str,
                 requests: Sequence[StoredRequest], opts: ReplayOptions, answers: list[Answer]) -> ReplayOutcome:
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    first_t = requests[0].t
    sent_at: dict[int, float] = {}  # recorded seq -> when it was sent (monotonic)
    tasks: list[asyncio.Task[Answer]] = []

    async def sender() -> None:
        for req in requests:
            wait = started + (req.t - first_t) / opts.speed - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            sent_at[req.seq] = time.monotonic()
            tasks.append(loop.create_task(_send(client, base, req)))

    detection = Detection(failures_needed=ProbeConfig.failures, grace_ceiling=ProbeConfig.grace_ceiling)
    detection.success()  # the server answered before the replay began (or the user says it serves)
    source = DoorSource(door=lambda: door, stall_timeout=lambda: opts.stall_timeout,
                        first_token_timeout=lambda: opts.first_token_timeout)
    probed: set[object] = set()  # stall episodes a probe has answered: one probe per episode, as the daemon
    sending = loop.create_task(sender())
    probe_client = make_client()
    try:
        while True:
            await asyncio.sleep(LOOK_EVERY)
            unreachable = next((a for t in tasks if t.done() and (a := t.result()).status == 503
                                and a.error == wire.UNREACHABLE), None)
            if unreachable is not None:
                return ReplayOutcome(False, "", len(sent_at), 1, unreachable=f"the server at {url} did not answer")
            verdict = await _judge(door, probe_client, url, opts, detection, source, probed)
            if verdict is not None:
                reason, quiet_since = verdict
                recorded, recorded_at = door.recorded() or (), time.monotonic()
                in_flight = tuple(sorted(_unanswered(tasks, sent_at)))
                door.fail_in_flight("replay: the server is hung (mlxwatch verdict)")
                before = [seq for seq, at in sent_at.items() if at <= quiet_since]
                return ReplayOutcome(True, reason, len(sent_at), 1, after_seq=max(before) if before else None,
                                     in_flight=in_flight, verdict_after_s=round(time.monotonic() - started, 2),
                                     quiet_s=round(time.monotonic() - quiet_since, 2),
                                     recorded=tuple(recorded), recorded_at=recorded_at)
            if sending.done() and all(t.done() for t in tasks) and not door.view().in_flight:
                return ReplayOutcome(False, "", len(sent_at), 1)
    finally:
        sending.cancel()
        for task in tasks:
            task.cancel()
        done = await asyncio.gather(sending, *tasks, return_exceptions=True)
        answers += [a for a in done if isinstance(a, Answer)]
        await probe_client.aclose()


def _unanswered(tasks: list[asyncio.Task[Answer]], sent_at: dict[int, float]) -> set[int]:
    answered = {t.result().seq for t in tasks if t.done() and not t.cancelled() and t.exception() is None}
    return set(sent_at) - answered


async def _judge(door: FrontDoor, client: httpx.AsyncClient, url: str, opts: ReplayOptions, detection: Detection,
                 source: DoorSource, probed: set[object]) -> tuple[str, float] | None:
    """The daemon's decision on what the door sees now: a (reason, quiet since) verdict, or None."""
    now = time.monotonic()
    stall = stall_of(door.view(), now, opts.stall_timeout)
    if stall is None or stall.key in probed:
        return None
    probed.add(stall.key)
    detection.suspect()
    detection.stall_seen()  # the stall is the first failure: the probe that follows decides
    report = await run_check(client, url, first_token_timeout=min(opts.stall_timeout, opts.first_token_timeout),
                             timeout=opts.probe_timeout, endpoint_timeout=opts.endpoint_timeout)
    end = time.monotonic()
    seen = await source.look(Window(stall.since if stall.since is not None else now, end, report))
    if report.healthy:
        detection.success()
        return None
    if detection.failure(end, [], list(seen.delivered)):
        return f"{stall.reason}; then the probe: {report.reason}", stall.since if stall.since is not None else now
    return None


async def _send(client: httpx.AsyncClient, base: str, req: StoredRequest) -> Answer:
    # As the door received them: its bytes decoded as Latin-1 (httpx would encode a str as ASCII).
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in req.headers if k.lower() not in NOT_SENT]
    try:
        async with client.stream(req.method, base + req.target, headers=headers, content=req.body) as response:
            got = 0
            tail = b""
            async for chunk in response.aiter_raw():
                got += len(chunk)
                tail = (tail + chunk)[-4096:]
            code = wire.UNREACHABLE.encode() if response.status_code == 503 and wire.UNREACHABLE.encode() in tail \
                else None
            return Answer(req.seq, response.status_code, got, code.decode() if code else None)
    except httpx.HTTPError as exc:
        return Answer(req.seq, None, 0, f"{type(exc).__name__}: {exc}")

