"""Kernel sight: the bytes the server sent on every client connection (``mlxwatch.host.sockets``),
read as evidence. No config, no change to the server or its clients, no root.

A connection's history, reading by reading, says what the server did for that client:

- its **first segment** is the response's head (mlx-lm writes status and headers in one write,
  measured: 248 bytes in one segment on 0.31.3 and 0.32.2): the request was admitted, nothing
  more. A livelocked server admits requests and sends heads;
- after the head, writes of at most ``KEEPALIVE_BYTES`` a segment are ``: keepalive X/Y``
  comments (23 bytes measured), sent while a prompt is processed: **progress**, which holds a
  verdict only up to ``grace_ceiling``, so a livelock that writes keepalives is still called;
- larger writes are token events (about 350 bytes a segment measured): **delivered**. Where the
  kernel gives no segment count (macOS), an advance of ``TOKEN_BYTES`` or more is a delivery.

Connections of the daemon itself (its probes, the front door) are left out: the probe judges its
own stream, the door counts its own tokens. A connection first seen between two readings is only
a baseline (what it got before is unknown), so a short answer sent and closed between two
readings is not seen: nothing is inferred from what is not seen.

What stays hidden: a request that has arrived and got nothing yet (a non-streaming generation
sends everything at its end). While such requests wait and the server uses CPU
(``BUSY_CPU``), the work may be real: ``hidden_work`` withholds the early end of a probe's wait.
A server that idles (a blocked thread, 0 % CPU) or is stopped hides nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

import psutil

from mlxwatch.evidence import Evidence, Seeing, Stall, Window
from mlxwatch.host.sockets import Connection, KernelCounters, Reading

KEEPALIVE_BYTES = 64  # mean bytes per segment at or below which a write is a keepalive comment
TOKEN_BYTES = 128  # without segment counts: an advance of at least this much is a token event
BUSY_CPU = 0.10  # of one core: a server this busy with requests waiting may be working on them
PENDING_AFTER = 1.0  # seconds a request may wait for its head before it counts as waiting
KEPT_EVENTS = 2000
POLL_SUSPECT = 1.0  # seconds between readings while a probe waits or the instance is suspect
POLL_HEALTHY = 5.0  # ... otherwise (a stall needs quiet_window of no flow: this only delays seeing it)


@dataclass
class _Conn:
    first_seen: float
    bytes_sent: int
    segments: int | None
    headed_at: float | None  # when its head was first seen sent
    bytes_received: int = 0  # what the client sent: a request has arrived once this is above 0
    token_at: float | None = None  # when tokens were last seen sent on it


@dataclass(frozen=True)
class _Flow:
    at: float
    kind: str  # "tokens" | "keepalive"
    size: int


@dataclass
class KernelSource:
    """One instance's view of the kernel's counters (``counters`` is shared by all instances)."""

    counters: KernelCounters
    port: int
    quiet_window: Callable[[], float]  # probe.quiet_window (a reload may change it)
    server_pid: Callable[[], int | None] = lambda: None
    clock: Callable[[], float] = time.monotonic
    name: str = "kernel"
    conns: dict[tuple, _Conn] = field(default_factory=dict)
    flows: deque[_Flow] = field(default_factory=lambda: deque(maxlen=KEPT_EVENTS))
    last_reading: Reading | None = None
    cpu: tuple[float, float] | None = None  # (time.monotonic(), the server's CPU seconds) at the last reading
    cpu_busy: float | None = None  # share of a core used between the last two readings

    def due(self, now: float, suspect: bool) -> bool:
        """Time for a new reading? Quickly while a probe waits or the instance is suspect, at a
        low rate otherwise (a stall needs ``quiet_window`` of no flow: this only delays seeing it)."""
        if self.last_reading is None:
            return True
        return now - self.last_reading.at >= (POLL_SUSPECT if suspect else POLL_HEALTHY)

    async def prime(self) -> None:
        return None

    async def look(self, window: Window) -> Evidence:
        quick = window.suspect or window.probe is not None
        if self.due(window.end, quick):
            max_age = None if quick else POLL_HEALTHY / 2
            shared = self.counters.fresh(self.port, max_age)  # another instance's dump, read in place
            if shared is not None:
                self.take(replace(shared, at=window.end))
            else:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self.counters.executor, self.sample, window.end, max_age)
        return self.answer(window)

    # --- reading (blocking)

    def sample(self, at: float | None = None, max_age: float | None = None) -> Reading:
        """A reading, dated ``at`` (the window's end it was taken for) on the watcher's clock.
        While healthy, a dump up to ``max_age`` s old that another instance asked for serves
        (measured: 10 healthy instances reading their own dumps cost 0.6 % of a core)."""
        reading = replace(self.counters.read(self.port, max_age), at=self.clock() if at is None else at)
        self.take(reading)
        return reading

    def take(self, reading: Reading) -> None:
        """Fold one reading into the connections' histories."""
        self.last_reading = reading
        if reading.error:
            return
        at, seen = reading.at, {}
        for c in reading.connections:
            if c.own:
                continue
            seen[c.key] = self._advance(c, at)
        self.conns = seen
        self._measure_cpu(at)

    def _advance(self, c: Connection, at: float) -> _Conn:
        before = self.conns.get(c.key)
        segments = c.segments_out
        if before is None:
            return _Conn(at, c.bytes_sent, segments, at if c.bytes_sent > 0 else None, c.bytes_received)
        grown = c.bytes_sent - before.bytes_sent
        if grown > 0:
            if before.headed_at is None:
                before.headed_at = at  # its head (and maybe more, unknown how much): an admission
            else:
                flow = _Flow(at, self._kind(grown, before.segments, segments), grown)
                self.flows.append(flow)
                if flow.kind == "tokens":
                    before.token_at = at
        before.bytes_sent, before.segments, before.bytes_received = c.bytes_sent, segments, c.bytes_received
        return before

    @staticmethod
    def _kind(grown: int, segments_before: int | None, segments_now: int | None) -> str:
        if segments_before is not None and segments_now is not None and segments_now > segments_before:
            return "tokens" if grown / (segments_now - segments_before) > KEEPALIVE_BYTES else "keepalive"
        return "tokens" if grown >= TOKEN_BYTES else "keepalive"

    def _measure_cpu(self, at: float) -> None:
        pid = self.server_pid()
        if pid is None:
            self.cpu = self.cpu_busy = None
            return
        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_STOPPED:
                self.cpu, self.cpu_busy = None, 0.0
                return
            times = proc.cpu_times()
            used = times.user + times.system
        except (psutil.Error, OSError):
            self.cpu = self.cpu_busy = None
            return
        real = time.monotonic()  # CPU seconds against real seconds, whatever clock dates the readings
        if self.cpu is not None and real > self.cpu[0]:
            self.cpu_busy = max(0.0, used - self.cpu[1]) / (real - self.cpu[0])
        self.cpu = (real, used)

    # --- answering (no I/O)

    def _pace_signs(self) -> dict:
        """For the cadence: the requests owed a first token (when each arrived, its size, a
        stream or not), and when the last keepalive and the last tokens were sent (monotonic)."""
        owed = [{"arrived": c.headed_at if c.headed_at is not None else c.first_seen,
                 "request_bytes": c.bytes_received, "streamed": c.headed_at is not None}
                for c in self.conns.values() if c.token_at is None and c.bytes_received > 0]
        last = {kind: next((f.at for f in reversed(self.flows) if f.kind == kind), None)
                for kind in ("keepalive", "tokens")}
        return {"owed": owed, "last_keepalive": last["keepalive"], "last_token": last["tokens"]}

    def answer(self, window: Window) -> Evidence:
        reading = self.last_reading
        if reading is None or reading.error:
            why = reading.error if reading else "no reading yet"
            return Evidence(notes=(f"kernel sight unavailable ({why}): judging by the probe's rules",),
                            detail={"kernel": {"unavailable": why}})
        now = window.end
        inside = [f for f in self.flows if window.start < f.at <= now]
        tokens = [f for f in inside if f.kind == "tokens"]
        keepalives = [f for f in inside if f.kind == "keepalive"]
        span = f"in the last {now - window.start:.0f}s"
        delivered = (f"kernel: {sum(f.size for f in tokens)} bytes of tokens sent to clients {span}",) if tokens else ()
        progress = (f"kernel: {len(keepalives)} keepalive write(s) to clients and no token {span}",) \
            if keepalives and not tokens else ()
        last_flow = self.flows[-1].at if self.flows else None
        streams = [c for c in self.conns.values() if c.headed_at is not None]
        waiting = [c for c in self.conns.values() if c.headed_at is None and now - c.first_seen >= PENDING_AFTER]
        hidden = None
        if waiting and self.cpu_busy is not None and self.cpu_busy >= BUSY_CPU:
            hidden = (f"{len(waiting)} request(s) waiting with nothing sent yet while the server uses "
                      f"{self.cpu_busy:.0%} of a core (a non-streaming answer is sent whole at its end)")
        stall = None
        quiet_window = self.quiet_window()
        # Owed a byte: streams whose head went out, and (with the server idle, so not working on
        # them) requests still waiting for their head: a blocked thread admits nothing new.
        idle = self.cpu_busy is not None and self.cpu_busy < BUSY_CPU
        owed = [c.headed_at for c in streams if c.headed_at is not None] + \
            ([c.first_seen for c in waiting] if idle else [])
        if owed and not hidden:
            quiet_since = max(last_flow or 0.0, min(owed))
            if now - quiet_since >= quiet_window:
                what = f"{len(streams)} client stream(s) open" if streams else ""
                if idle and waiting:
                    what += (" and " if what else "") + (f"{len(waiting)} request(s) waiting for an answer while "
                                                         f"the server idles ({self.cpu_busy:.0%} of a core)")
                reason = (f"kernel: {what}, and no byte sent to any client for {now - quiet_since:.0f}s "
                          f"(probe.quiet_window {quiet_window:g}s)")
                stall = Stall(reason, key=("kernel", quiet_since), source=self.name, since=quiet_since,
                              event="kernel_stall", journal={"reason": reason, "streams": len(streams),
                                                             "waiting": len(waiting) if idle else 0})
        detail = {"kernel": {"connections": len(self.conns), "streams": len(streams), "waiting": len(waiting),
                             "last_flow_ago": None if last_flow is None else round(now - last_flow, 1),
                             "cpu": None if self.cpu_busy is None else round(self.cpu_busy, 3),
                             **self._pace_signs()}}
        return Evidence(delivered=delivered, progress=progress, stall=stall, last_flow=last_flow, sees_all=True,
                        hidden_work=hidden, detail=detail)


def build(seeing: Seeing) -> KernelSource | None:
    """Kernel sight for the instance's port, where the daemon reads the kernel's counters and
    the instance does not turn it off (``instances[].kernel``)."""
    if seeing.kernel is None or seeing.inst().kernel == "off":
        return None
    return KernelSource(seeing.kernel, seeing.inst().port, lambda: seeing.inst().probe.quiet_window,
                        server_pid=seeing.server_pid, clock=seeing.clock)
