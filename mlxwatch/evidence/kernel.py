"""Kernel sight: the bytes the server sent on every client connection (``mlxwatch.host.sockets``),
read as evidence. No config, no change to the server or its clients, no root.

A connection is read the way HTTP runs on it, reading by reading (measured on the real server,
0.31.3 and 0.32.2, with the official ``openai`` SDK):

- **idle**: connected, no byte of a request yet (``bytes_received`` 0). Owed nothing: an idle
  connection is no request (counted as one, 5 of them made a healthy server's stall alert, and
  under a livelock they hid the quiet as work: 160 s to a verdict instead of 31 s);
- **waiting**: the client sent a request (``bytes_received`` grew) and nothing of its answer
  went out yet. A non-streaming answer is written at its end, whole;
- the first bytes of an answer are its **head** when they fit one (``HEAD_BYTES``; mlx-lm writes
  status and headers in one write, 248 bytes measured): the request was admitted, nothing more
  (a livelocked server admits requests and sends heads). The connection is then a **stream**,
  owed bytes. More than a head at once is an answer **sent whole** (a non-streamed answer, or a
  head with tokens): a **delivery**, after which nothing is owed until the next request;
- after the head, writes of at most ``KEEPALIVE_BYTES`` a segment are ``: keepalive X/Y``
  comments (23 bytes measured), sent while a prompt is processed: **progress**, which holds a
  verdict only up to ``grace_ceiling``, so a livelock that writes keepalives is still called;
  larger writes are token events (about 350 bytes a segment measured): **delivered**. Where the
  kernel gives no segment count (macOS), an advance of ``TOKEN_BYTES`` or more is a delivery;
- new request bytes on the same connection (keep-alive) end the answer before them;
- **closed by the server** (mlx-lm's HTTP/1.0 server closes after every answer): the server end
  leaves a TIME_WAIT remnant, which a client that gives up does not leave. A request that was
  waiting, or a stream, whose connection the server closed was **answered**: a delivery (its last
  bytes are unseen on Linux, whose remnant keeps no counts; nettop's keeps them and they are read
  as any growth). Not when the server process is gone, or another one serves since the last
  reading: a process that dies (a crash, a restart) closes every connection;
- bytes the server wrote that wait in a connection's send queue (``Connection.unsent``) count as
  written: a client that reads slowly is owed nothing by the server, which wrote.

Connections of the daemon itself (its probes, the front door) are left out: the probe judges its
own stream, the door counts its own tokens. A connection first seen between two readings is only
a baseline (what it got before is unknown). **What stays unseen**: a connection opened and
closed between two readings. Its remnant on Linux keeps no byte counts, so an answer cannot be
told from a ``/health`` check or an error; nothing is inferred from it.

What stays hidden: a request that has arrived and got nothing yet. While such requests wait and
the server uses CPU (``BUSY_CPU``), the work may be real: ``hidden_work`` withholds the early end
of a probe's wait. A server that idles (a blocked thread, 0 % CPU) or is stopped hides nothing.
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
HEAD_BYTES = 512  # a response's head fits in this (measured: 248); more at once is an answer sent whole
BUSY_CPU = 0.10  # of one core: a server this busy with requests waiting may be working on them
PENDING_AFTER = 1.0  # seconds a request may wait for its head before it counts as waiting
KEPT_EVENTS = 2000
POLL_SUSPECT = 1.0  # seconds between readings while a probe waits or the instance is suspect
POLL_HEALTHY = 5.0  # ... otherwise (a stall needs quiet_window of no flow: this only delays seeing it)

IDLE, WAITING, STREAM, ANSWERED = "idle", "waiting", "stream", "answered"  # a connection's phase


@dataclass
class _Conn:
    """One client connection as HTTP runs on it: its phase (``IDLE``: no request; ``WAITING``:
    a request and nothing of its answer; ``STREAM``: an answer under way, owed bytes;
    ``ANSWERED``: an answer went out whole, nothing owed until the next request)."""

    first_seen: float
    written: int  # bytes the server wrote to it: sent, or waiting in its send queue
    received: int  # bytes its client sent: requests
    segments: int | None
    phase: str
    since: float  # when the phase began
    request_bytes: int = 0  # the waiting request's size: a hint of its prompt's length
    unsent: int = 0  # written, not yet taken by the client: it reads slowly
    headed_at: float | None = None  # when the answer's first bytes were seen
    token_at: float | None = None  # when tokens were last seen written to it (its prompt was read)
    keepalive_at: float | None = None  # when a keepalive was last seen written to it
    old_server: bool = False  # seen before the server's PID changed (a restart): its close is no answer


@dataclass(frozen=True)
class _Flow:
    at: float
    kind: str  # "tokens" | "keepalive" | "answer" (an answer sent whole, or ended and closed by the server)
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
    # the time between two keepalives on one stream with no token between (a chunk of its
    # prompt read), for the cadence: each given once. One stream's only: across two streams
    # (a hung prompt's last keepalive, a restart, the next prompt's first) the gap is no
    # chunk (measured: 184 s learned "a chunk" after two trials of a hang mid-prefill)
    keepalive_gaps: list[float] = field(default_factory=list)
    last_reading: Reading | None = None
    cpu: tuple[float, float] | None = None  # (time.monotonic(), the server's CPU seconds) at the last reading
    cpu_busy: float | None = None  # share of a core used between the last two readings
    server_gone: bool = False  # the server's process was gone at the last reading
    server_seen: int | None = None  # the server's PID at the last reading

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
        at = reading.at
        self._measure_cpu(at)  # first: whether the server still runs says what a close means
        pid = self.server_pid()
        if self.server_seen is not None and pid != self.server_seen:  # restarted: its connections were its own
            for old in self.conns.values():
                old.old_server = True
        self.server_seen = pid
        seen: dict[tuple, _Conn] = {}
        for c in reading.connections:
            if c.own:
                continue
            if not c.closed:
                seen[c.key] = self._advance(c, at)
            elif (conn := self.conns.get(c.key)) is not None:  # closed since the last reading: once
                self._closed(conn, c, at)
        self.conns = seen

    def _advance(self, c: Connection, at: float) -> _Conn:
        before = self.conns.get(c.key)
        if before is None:  # a baseline: what it got before is unknown
            phase = IDLE if c.bytes_received == 0 else WAITING if c.written == 0 else STREAM
            return _Conn(at, c.written, c.bytes_received, c.segments_out, phase, at,
                         # its request's size, whether its head went out yet or not (measured: a stream first
                         # seen past its head had no size, matched no prompt the log read, and a livelock
                         # after its N/N was called 147 s after its onset, not 60)
                         request_bytes=c.bytes_received if phase != IDLE else 0, unsent=c.unsent,
                         headed_at=at if phase == STREAM else None)
        if c.bytes_received > before.received:  # a request: the answer before it, if any, is over
            if before.phase != WAITING:
                before.phase, before.since, before.request_bytes, before.headed_at = WAITING, at, 0, None
                before.token_at = None
            before.request_bytes += c.bytes_received - before.received
        self._grow(before, c.written - before.written, c.segments_out, at)
        before.written, before.received, before.segments, before.unsent = \
            c.written, c.bytes_received, c.segments_out, c.unsent
        return before

    def _grow(self, conn: _Conn, grown: int, segments_now: int | None, at: float) -> None:
        """``grown`` more bytes written to ``conn`` (``segments_now``: its data segments now)."""
        if grown <= 0:
            return
        if conn.phase in (IDLE, WAITING):  # the answer's first bytes: a head, or all of it
            conn.headed_at = at
            if self._whole(grown, conn.segments, segments_now):
                self.flows.append(_Flow(at, "answer", grown))
                conn.phase, conn.since = ANSWERED, at
            else:
                conn.phase, conn.since = STREAM, at
            return
        flow = _Flow(at, self._kind(grown, conn.segments, segments_now), grown)
        self.flows.append(flow)
        if flow.kind == "tokens":
            conn.token_at = at
        elif flow.kind == "keepalive":
            if conn.keepalive_at is not None and (conn.token_at is None or conn.token_at < conn.keepalive_at):
                self.keepalive_gaps.append(at - conn.keepalive_at)
            conn.keepalive_at = at
        conn.phase = STREAM  # more after an answer that seemed whole: it was a stream after all

    def _closed(self, conn: _Conn, remnant: Connection, at: float) -> None:
        """The server closed ``conn`` (``remnant``: what is left, with its counts or none): it
        finished writing to that client."""
        if self.server_gone or conn.old_server:
            return  # a process that died (a crash, a restart) closed every connection: no answer
        if remnant.counted:  # its last bytes are known (nettop): read as any growth
            self._grow(conn, remnant.written - conn.written, remnant.segments_out, at)
        elif conn.phase in (WAITING, STREAM):  # its last bytes are unseen (Linux): an answer ended
            self.flows.append(_Flow(at, "answer", 0))

    @staticmethod
    def _whole(grown: int, segments_before: int | None, segments_now: int | None) -> bool:
        """Is a first write of ``grown`` bytes more than a head (and keepalives behind it)?"""
        beyond = grown - HEAD_BYTES
        if beyond <= 0:
            return False
        if segments_before is not None and segments_now is not None and segments_now > segments_before:
            return beyond / max(1, segments_now - segments_before - 1) > KEEPALIVE_BYTES
        return beyond >= TOKEN_BYTES

    @staticmethod
    def _kind(grown: int, segments_before: int | None, segments_now: int | None) -> str:
        if segments_before is not None and segments_now is not None and segments_now > segments_before:
            return "tokens" if grown / (segments_now - segments_before) > KEEPALIVE_BYTES else "keepalive"
        return "tokens" if grown >= TOKEN_BYTES else "keepalive"

    def _measure_cpu(self, at: float) -> None:
        pid = self.server_pid()
        self.server_gone = False
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
        except (psutil.Error, OSError) as exc:
            self.cpu = self.cpu_busy = None
            self.server_gone = isinstance(exc, psutil.NoSuchProcess)  # a zombie is one too
            return
        real = time.monotonic()  # CPU seconds against real seconds, whatever clock dates the readings
        if self.cpu is not None and real > self.cpu[0]:
            self.cpu_busy = max(0.0, used - self.cpu[1]) / (real - self.cpu[0])
        self.cpu = (real, used)

    # --- answering (no I/O)

    def _pace_signs(self) -> dict:
        """For the cadence: the requests owed a first token (when each arrived, its size, a
        stream or not), the gaps between two keepalives on one stream since the last call, and
        when tokens or an answer last went out (monotonic). A stream whose client leaves the
        server's writes unread is owed nothing."""
        owed = [{"arrived": c.since, "request_bytes": c.request_bytes, "streamed": False}
                for c in self.conns.values() if c.phase == WAITING]
        owed += [{"arrived": c.headed_at if c.headed_at is not None else c.since, "request_bytes": c.request_bytes,
                  "streamed": True} for c in self.conns.values()
                 if c.phase == STREAM and c.token_at is None and c.unsent == 0]
        # flows are kept in time order: the last that is not a keepalive is the last delivery
        last_token = next((f.at for f in reversed(self.flows) if f.kind != "keepalive"), None)
        gaps, self.keepalive_gaps = self.keepalive_gaps, []
        return {"owed": owed, "keepalive_gaps": gaps, "last_token": last_token}

    def answer(self, window: Window) -> Evidence:
        reading = self.last_reading
        if reading is None or reading.error:
            why = reading.error if reading else "no reading yet"
            return Evidence(notes=(f"kernel sight unavailable ({why}): judging by the probe's rules",),
                            detail={"kernel": {"unavailable": why}})
        now = window.end
        inside = [f for f in self.flows if window.start < f.at <= now]
        tokens = [f for f in inside if f.kind == "tokens"]
        answers = [f for f in inside if f.kind == "answer"]
        keepalives = [f for f in inside if f.kind == "keepalive"]
        span = f"in the last {now - window.start:.0f}s"
        delivered: tuple[str, ...] = \
            (f"kernel: {sum(f.size for f in tokens)} bytes of tokens sent to clients {span}",) if tokens else ()
        if answers:
            delivered += (f"kernel: {len(answers)} answer(s) to clients completed {span} (a non-streamed "
                          "answer goes out whole at its end)",)
        progress = (f"kernel: {len(keepalives)} keepalive write(s) to clients and no token {span}",) \
            if keepalives and not delivered else ()
        last_flow = self.flows[-1].at if self.flows else None
        streams = [c for c in self.conns.values() if c.phase == STREAM]
        slow_readers = [c for c in streams if c.unsent > 0]  # the server wrote; the client has not read it
        waiting = [c for c in self.conns.values() if c.phase == WAITING and now - c.since >= PENDING_AFTER]
        hidden = None
        if waiting and self.cpu_busy is not None and self.cpu_busy >= BUSY_CPU:
            hidden = (f"{len(waiting)} request(s) waiting with nothing sent yet while the server uses "
                      f"{self.cpu_busy:.0%} of a core (a non-streaming answer is sent whole at its end)")
        stall = None
        quiet_window = self.quiet_window()
        # Owed a byte: streams whose head went out (not those whose client leaves the server's
        # writes unread), and (with the server idle, so not working on them) requests still
        # waiting for their head: a blocked thread admits nothing new.
        idle = self.cpu_busy is not None and self.cpu_busy < BUSY_CPU
        owed_streams = [c for c in streams if c.unsent == 0]
        owed = [c.headed_at for c in owed_streams if c.headed_at is not None] + \
            ([c.since for c in waiting] if idle else [])
        if owed and not hidden:
            quiet_since = max(last_flow or 0.0, min(owed))
            if now - quiet_since >= quiet_window:
                what = f"{len(owed_streams)} client stream(s) open" if owed_streams else ""
                if idle and waiting:
                    what += (" and " if what else "") + (f"{len(waiting)} request(s) waiting for an answer while "
                                                         f"the server idles ({self.cpu_busy:.0%} of a core)")
                reason = (f"kernel: {what}, and no byte sent to any client for {now - quiet_since:.0f}s "
                          f"(probe.quiet_window {quiet_window:g}s)")
                stall = Stall(reason, key=("kernel", quiet_since), source=self.name, since=quiet_since,
                              event="kernel_stall", journal={"reason": reason, "streams": len(owed_streams),
                                                             "waiting": len(waiting) if idle else 0})
        detail = {"kernel": {"connections": len(self.conns), "streams": len(streams), "waiting": len(waiting),
                             "last_flow_ago": None if last_flow is None else round(now - last_flow, 1),
                             "cpu": None if self.cpu_busy is None else round(self.cpu_busy, 3),
                             "waiting_request_bytes": [c.request_bytes for c in waiting],
                             "stream_heads_ago": [round(now - c.headed_at, 1) for c in streams
                                                  if c.headed_at is not None],
                             "slow_readers": len(slow_readers), **self._pace_signs()}}
        return Evidence(delivered=delivered, progress=progress, stall=stall, last_flow=last_flow, sees_all=True,
                        hidden_work=hidden, detail=detail)


def build(seeing: Seeing) -> KernelSource | None:
    """Kernel sight for the instance's port, where the daemon reads the kernel's counters and
    the instance does not turn it off (``instances[].kernel``)."""
    if seeing.kernel is None or seeing.inst().kernel == "off":
        return None
    return KernelSource(seeing.kernel, seeing.inst().port, lambda: seeing.inst().probe.quiet_window,
                        server_pid=seeing.server_pid, clock=seeing.clock)
