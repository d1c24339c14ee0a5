"""The front door: a pass-through in front of one server that sees every token it delivers.

Clients talk to the door; the door forwards each request to the server and each response
back, byte for byte, chunk by chunk as it arrives. Because it stands in the path it knows,
per request, when the first and latest token reached the client, and it can end a request
loudly when the server has stopped delivering instead of letting the client read an empty
200::

    door = FrontDoor("main", "http://127.0.0.1:8080", cfg.front)
    await door.start()                     # binds cfg.listen (FrontError if it cannot)
    door.view()                            # DeliveryView: who is waiting, who got tokens
    door.set_gate(Gate.RESTARTING)         # new requests: 503 + Retry-After, or held up to cfg.hold
    door.fail_in_flight("server hung")     # every request in flight ends with an explicit error
    door.set_gate(Gate.OPEN)
    door.take_stalled_requests()           # requests the door failed alone (no token while others flowed)
    door.recorded()                        # front.record: the recent requests, exact bodies (front.recorder)
    await door.stop(drain=5.0)

The HTTP is ``http1`` (asyncio's transports, httptools' parser): each chunk from the server is
written to the client in the callback that receives it, a client that does not read pauses the
reads from the server, and a client that goes away cancels its request, which closes the request
to the server at once. The watchdog side (counting tokens, the stall sweep) is guarded: a bug
there is logged and never stops bytes from flowing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import json
import logging
import math
import resource
from dataclasses import dataclass, replace
from typing import Any

from mlxwatch.clock import Clock
from mlxwatch.config import FrontConfig
from mlxwatch.errors import FrontError
from mlxwatch.front import http1, wire
from mlxwatch.front.delivery import (
    CANCELLED, FAILED_LOUDLY, OK, REFUSED_RESTARTING, REJECTED, TIMEOUT, DeliveryView, Ledger, Observations,
    RequestView,
)
from mlxwatch.front.recorder import RecordedRequest, Recorder
from mlxwatch.front.tokens import MAX_BODY_READ, StreamReader, body_tokens, finish_reason
from mlxwatch.host.memory import give_back

log = logging.getLogger(__name__)

RETRY_AFTER = 5  # seconds a refused client is told to wait when no restart is under way (and the least once overdue)
# While the server restarts, Retry-After is what the restart is still expected to take
# (``retry_after``): the openai SDK retries a 503 twice by default, each after Retry-After, so a
# fixed 5 s carried a client through 10 s of a gate closed 17-22 s (issue 29).
RETRY_AFTER_MAX = 60  # the openai SDK honours up to 60 s (1.x; 120 s in 3.x, and refuses to retry beyond)
FIRST_RESTART_GUESS = 30.0  # a restart's length before this door measured one (at most startup_timeout)
RESTARTS_KEPT = 5  # the restarts measured lately: the longest of them is the one expected
ERROR_WRITE_TIMEOUT = 5.0  # writing the final error to a client that does not read: then cut
MAX_HEADER_COUNT = 100  # header fields per request (their total size is cfg.max_header; clients send ~10)
# Clients that take their time sending a request are cut off, as nginx does (client_header_timeout,
# client_body_timeout, keepalive_timeout: 60, 60 and 75 s): a connection that never completes its
# request must not hold a file descriptor and buffers for ever (the daemon shares its descriptors
# with the door, and a few hundred such connections would starve its probes).
HEAD_TIMEOUT = 60.0  # from the connection to a complete request head: the whole head
BODY_TIMEOUT = 60.0  # from the start of a request body to its end: the whole body (not per read)
KEEPALIVE_TIMEOUT = 75.0  # an idle keep-alive connection (also a partial next request)
MIN_CONNECTIONS, MAX_CONNECTIONS = 32, 4096  # the cap on open client connections: bounds of
FDS_PER_CONNECTION, FDS_KEPT = 2, 128  # ... (open-files limit - kept for the daemon) / fds per connection
GIVE_BACK_AFTER = 32 * 1024**2  # request body bytes let go before freed memory is given back to the system
GIVE_BACK_DELAY = 1.0  # ... at most once per this many seconds
ADDRESS_SHARE = 0.75  # of the cap, the most one client address may hold: the rest stays for others
# Request headers the door does not pass on: the client's own Host and length belong to its hop;
# the door has read the body whole (and answered Expect: 100-continue itself).
_NOT_FORWARDED = frozenset({"host", "content-length", "expect"})


class Gate(enum.Enum):
    """Whether new requests go through: OPEN, or RESTARTING (refused or held while it lasts)."""

    OPEN = "open"
    RESTARTING = "restarting"


@dataclass
class _Live:
    """One request the door is serving: the task talking to the server, and why it was failed."""

    fid: str
    conn: http1.ClientConnection | None = None  # the client's connection
    task: asyncio.Task | None = None  # the task serving it: cancelled to end its exchange with the server
    sse: StreamReader | None = None
    failure: tuple[str, str] | None = None  # (message, code) once the door decided to fail it
    replayed: bool = False
    replay_due: bool = False  # failed by the verdict with nothing sent to its client: held to be sent again
    final_at: int | None = None  # the client's byte offset where the answer was whole (final SSE event, or body)
    tracking: bool = True  # False after a bug in counting: bytes keep flowing, tokens stop counting
    status: int | None = None  # the server's answer status, once its head came
    finish_reason: str | None = None  # a non-streaming answer's, read when it is recorded


@dataclass(frozen=True)
class _Parsed:
    generation: bool
    stream: bool
    max_tokens: int | None


class FrontDoor:
    """A pass-through for one instance; see the module docstring."""

    def __init__(self, name: str, upstream: str, cfg: FrontConfig, *, clock: Clock | None = None,
                 startup_timeout: float | None = None) -> None:
        self.name = name
        self._upstream = upstream.rstrip("/")
        self._cfg = cfg
        self._clock = clock or Clock()
        self._ledger = Ledger(self._clock.monotonic)
        self._gate = Gate.OPEN
        self._gate_changed = asyncio.Event()  # set (and replaced) at every gate change and at stop
        self._opened = 0  # how many times the gate has opened: a replay waits for the next opening
        self._closed_at: float | None = None  # when the gate closed (monotonic), while it is closed
        self._restarts: collections.deque[float] = collections.deque(maxlen=RESTARTS_KEPT)  # gate closures, s
        self._startup_timeout = startup_timeout  # the instance's probe.startup_timeout
        self._live: dict[str, _Live] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._stalled: list[RequestView] = []
        self._stopping = False
        self._server: asyncio.Server | None = None
        self._pool: http1.UpstreamPool | None = None
        self._conns: set[http1.ClientConnection] = set()
        self._per_address: dict[str, int] = {}  # admitted connections by client address
        self._buffered = 0  # request body bytes held, all connections together (front.max_buffered)
        self._let_go = 0  # request body bytes let go since memory was last given back
        self._give_back: asyncio.TimerHandle | None = None
        self._cap = MAX_CONNECTIONS
        self._monitor: asyncio.Task | None = None
        self._cut_off_said = -math.inf
        self._recorder: Recorder | None = None
        self._conn_labels: dict[http1.ClientConnection, str] = {}  # recorded connections: number and peer
        self._conn_count = 0
        self._record(cfg)

    # -- life ----------------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """The address served (the bound port when cfg.listen asked for port 0)."""
        host, port = self._cfg.listen
        if self._server is not None and self._server.sockets:
            return host, int(self._server.sockets[0].getsockname()[1])
        return host, port

    async def start(self) -> None:
        """Bind ``cfg.listen`` and serve; FrontError (one line, which the caller prefixes with
        the instance) if the address cannot be bound."""
        if self._server is not None:
            return
        host, port = self._cfg.listen
        self._stopping = False
        self._cap = connection_cap()
        try:
            self._server = await asyncio.get_running_loop().create_server(self._connection, host, port,
                                                                          reuse_address=True)
        except OSError as exc:
            raise FrontError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc  # the caller names the door
        self._pool = http1.UpstreamPool(self._upstream, connect_ahead=self._cfg.connect_ahead)
        self._monitor = self._start_monitor()

    async def stop(self, drain: float = 5.0) -> None:
        """Stop accepting; wait up to ``drain`` s for requests in flight, then fail the rest loudly.

        Returns within about ``drain + ERROR_WRITE_TIMEOUT`` s; ``start`` afterwards serves again."""
        if self._server is None:
            return
        self._stopping = True
        self._wake_gate_waiters()
        self._server.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, drain))
        if self._live:
            self._fail_all("the mlxwatch front door is stopping", wire.STOPPING)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), ERROR_WRITE_TIMEOUT + 1.0)
        if self._give_back is not None:
            self._give_back.cancel()
            self._give_back = None
        if self._monitor is not None:
            self._monitor.remove_done_callback(self._monitor_ended)
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for conn in list(self._conns):
            conn.close()  # idle keep-alive connections; the answered ones have had their answer
        if self._pool is not None:
            self._pool.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 1.0)
        for conn in list(self._conns):
            conn.abort()  # a client that does not take the rest of its answer keeps no descriptor past stop
        self._server = self._pool = self._monitor = None

    def reconfigure(self, cfg: FrontConfig) -> None:
        """Take new settings on the same address in place: requests in flight and open
        connections go on; the timeouts, hold and replay apply from now on, to them too (each is
        read when it acts), connect_ahead to the next request (off closes the connection made
        ahead); a connection keeps the size limits it was opened with. A new address needs a new
        door."""
        if cfg.listen != self._cfg.listen:
            raise ValueError(f"front door {self.name}: a new address ({cfg.listen}) needs a new door")
        self._cfg = cfg
        self._record(cfg)
        if self._pool is not None:
            self._pool.set_connect_ahead(cfg.connect_ahead)

    def _record(self, cfg: FrontConfig) -> None:
        """front.record on (a recorder, or new bounds for the one there) or off (what it held is let go)."""
        if not cfg.record:
            self._recorder, self._ledger.on_close = None, None
            self._conn_labels.clear()
        elif self._recorder is None:
            self._recorder = Recorder(cfg.record_max_age, cfg.record_max_bytes, monotonic=self._clock.monotonic,
                                      wall=self._clock.wall)
            self._ledger.on_close = self._recorded_end
        else:
            self._recorder.set_bounds(cfg.record_max_age, cfg.record_max_bytes)

    def recorded(self, until: float | None = None) -> tuple[RecordedRequest, ...] | None:
        """The requests recorded (``front.record``), arrival order, those arrived by ``until``
        (monotonic) if given; None when the door does not record."""
        if self._recorder is None:
            return None
        return self._recorder.requests(self._ledger.view(), until=until)

    @property
    def recorder(self) -> Recorder | None:
        return self._recorder

    # -- what the daemon reads and decides -------------------------------------------------------

    def view(self) -> DeliveryView:
        view = self._ledger.view()
        held = self._held_by_clients()
        return replace(view, held_by_clients=held) if held else view

    def _held_by_clients(self) -> frozenset[str]:
        """Requests whose client is slow to read (a client that read its stream slowly made the
        door journal front_stall while the server streamed to it fine: issue 36)."""
        return frozenset(fid for fid, live in self._live.items()
                         if live.conn is not None and live.conn.waiting_on_client)

    def take_observations(self) -> Observations:
        """First-token latencies and token rates of requests finished since the last call."""
        return self._ledger.take_observations()

    def set_gate(self, gate: Gate) -> None:
        if gate is self._gate:
            return
        self._gate = gate
        now = self._clock.monotonic()
        if gate is Gate.OPEN:
            self._opened += 1
            if self._closed_at is not None:
                self._restarts.append(max(0.0, now - self._closed_at))  # a restart, measured
            self._closed_at = None
        else:
            self._closed_at = now
        self._wake_gate_waiters()

    def set_startup_timeout(self, seconds: float | None) -> None:
        """The instance's probe.startup_timeout: bounds the guess of a restart's length before
        one is measured (a reload may change it)."""
        self._startup_timeout = seconds

    def expected_restart(self) -> float:
        """How long a restart (the gate closed) is expected to take: the longest of the last
        RESTARTS_KEPT measured, else FIRST_RESTART_GUESS, at most the instance's startup_timeout."""
        if self._restarts:
            return max(self._restarts)
        if self._startup_timeout is not None:
            return min(FIRST_RESTART_GUESS, self._startup_timeout)
        return FIRST_RESTART_GUESS

    def _retry_after(self) -> int:
        """Retry-After for a 503 now: while restarting, what the restart is still expected to
        take; else RETRY_AFTER."""
        if self._gate is not Gate.RESTARTING or self._closed_at is None or self._stopping:
            return RETRY_AFTER
        return retry_after(self.expected_restart(), self._clock.monotonic() - self._closed_at)

    @property
    def gate(self) -> Gate:
        return self._gate

    def fail_in_flight(self, reason: str) -> int:
        """End every request in flight now with an explicit error naming ``reason``; how many
        were failed loudly. With ``replay``, a request that has had no byte of its answer is
        not: it is held to be sent again once the gate reopens (``replaying``; failed loudly
        then only if the gate stays closed past ``hold``), and the door says how many."""
        failed = replaying = 0
        for live in list(self._live.values()):
            if self._fail(live, reason, wire.HUNG):
                replaying += live.replay_due
                failed += not live.replay_due
        if replaying:
            log.warning("front door %s: %d request(s) in flight held to be sent again once the server is back "
                        "(front.replay)", self.name, replaying)
        return failed

    @property
    def replaying(self) -> int:
        """Requests failed by the verdict that wait to be sent again (front.replay)."""
        return sum(1 for live in self._live.values() if live.replay_due)

    def take_stalled_requests(self) -> list[RequestView]:
        """Requests the door failed alone since the last call (no token for
        request_stall_timeout while others got tokens)."""
        taken, self._stalled = self._stalled, []
        return taken

    # -- failing -----------------------------------------------------------------------------------

    def _fail_all(self, message: str, code: str) -> int:
        return sum(self._fail(live, message, code) for live in list(self._live.values()))

    def _fail(self, live: _Live, message: str, code: str) -> bool:
        if live.failure is not None or live.task is None or live.task.done():
            return False
        live.failure = (message, code)  # from now on nothing more of the server's answer reaches the client
        live.replay_due = (self._cfg.replay and not live.replayed and code == wire.HUNG and live.conn is not None
                           and not live.conn.started)
        live.task.cancel()
        return True

    def _wake_gate_waiters(self) -> None:
        self._gate_changed.set()
        self._gate_changed = asyncio.Event()

    async def _wait_gate(self, timeout: float, *, after_opening: int | None = None) -> bool:
        """Wait up to ``timeout`` s for the gate to be open (for a replay: to open again after
        ``after_opening``); False if it is not, or the door is stopping."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self._stopping:
            if self._gate is Gate.OPEN and (after_opening is None or self._opened > after_opening):
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._gate_changed.wait(), left)
        return False

    # -- the stall sweep (supervised) ------------------------------------------------------------

    def _start_monitor(self) -> asyncio.Task:
        task = asyncio.create_task(self._sweep_forever(), name=f"front-{self.name}-sweep")
        task.add_done_callback(self._monitor_ended)
        return task

    def _monitor_ended(self, task: asyncio.Task) -> None:
        # A task we create is a task we watch: if the sweep ever ends on its own, say so and start it again.
        if task.cancelled() or self._server is None:
            return
        log.error("front door %s: stall sweep ended (%r); started again", self.name, task.exception())
        self._monitor = self._start_monitor()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, max(0.05, self._cfg.request_stall_timeout / 4)))  # a reconfigure may change it
            try:
                self.sweep()
                if self._recorder is not None:
                    self._recorder.trim()  # the age bound holds while no request comes
            except Exception:  # the watchdog side never stops the door
                log.exception("front door %s: stall sweep failed", self.name)

    def sweep(self) -> list[RequestView]:
        """Fail each request with no token for request_stall_timeout while others got tokens."""
        timeout = self._cfg.request_stall_timeout
        failed = []
        held = self._held_by_clients()  # their client, not the server, holds their tokens back
        for view in self._ledger.stalled(timeout):
            live = self._live.get(view.id) if view.id not in held else None
            if live is not None and self._fail(live, f"no token for {timeout:g} s while other requests "
                                                     "received tokens (mlxwatch front door)", wire.STALLED):
                failed.append(view)
        self._stalled.extend(failed)
        return failed

    # -- serving -----------------------------------------------------------------------------------

    def _connection(self) -> asyncio.Protocol:
        """A protocol for a new client connection; one over the cap is closed at once."""
        if len(self._conns) >= self._cap:
            self.cut_off(f"{len(self._conns)} connections open, the cap", None)
            return _Closed()
        conn = http1.ClientConnection(self, http1.Limits(
            max_header=self._cfg.max_header, max_header_count=MAX_HEADER_COUNT, max_body=self._cfg.max_body,
            head_timeout=HEAD_TIMEOUT, body_timeout=BODY_TIMEOUT, keepalive_timeout=KEEPALIVE_TIMEOUT))
        self._conns.add(conn)
        return conn

    def admit(self, conn: http1.ClientConnection) -> bool:
        """Whether a new connection's address may hold one more: at most ADDRESS_SHARE of the
        cap (4,200 connections from one address took every slot: issue 29)."""
        held = self._per_address.get(conn.address, 0)
        if held >= max(1, int(self._cap * ADDRESS_SHARE)):
            self._conns.discard(conn)
            self.cut_off(f"{held} connections open from {conn.address}, its share of the cap", None)
            return False
        self._per_address[conn.address] = held + 1
        conn.admitted = True
        return True

    @property
    def buffered(self) -> int:
        """Request body bytes the door holds now, all connections together."""
        return self._buffered

    def hold(self, nbytes: int) -> http1.Answer | None:
        """Take ``nbytes`` more of request bodies, or the 503 that refuses them: what the door
        holds, all connections together, stays within front.max_buffered (20 connections of
        16 MiB each took the daemon from 79 to 415 MB: issue 29)."""
        if self._buffered + nbytes > self._cfg.max_buffered:
            return http1.error_answer(503, f"the mlxwatch front door holds {self._buffered} bytes of request "
                                           f"bodies, its limit is {self._cfg.max_buffered} (front.max_buffered); "
                                           "try again shortly", wire.DOOR_FULL, retry_after=1, close=True)
        self._buffered += nbytes
        return None

    def let_go(self, nbytes: int) -> None:
        """``nbytes`` of request bodies are no longer held; after GIVE_BACK_AFTER of them, the
        freed memory is given back to the system (glibc's malloc kept it: 366 MB stayed with
        the daemon after 20 connections of 16 MiB closed, issue 29)."""
        self._buffered = max(0, self._buffered - nbytes)
        self._let_go += nbytes
        if self._let_go >= GIVE_BACK_AFTER and self._give_back is None and self._server is not None:
            self._give_back = asyncio.get_running_loop().call_later(GIVE_BACK_DELAY, self._giving_back)

    def _giving_back(self) -> None:
        self._give_back, self._let_go = None, 0
        give_back()

    def closed(self, conn: http1.ClientConnection) -> None:
        self._conns.discard(conn)
        self._conn_labels.pop(conn, None)
        if conn.admitted:
            conn.admitted = False
            left = self._per_address.get(conn.address, 0) - 1
            if left > 0:
                self._per_address[conn.address] = left
            else:
                self._per_address.pop(conn.address, None)

    def refused(self, answer: http1.Answer, why: str) -> http1.Answer:
        """A request refused before it was read whole: too large or malformed (rejected), or
        too slow (timeout: a 408)."""
        self._ledger.count(TIMEOUT if answer.status == 408 else REJECTED)
        return answer

    async def serve(self, conn: http1.ClientConnection, request: http1.Request) -> None:
        """Serve one complete request: refuse or hold it while the gate is closed, else forward it."""
        if self._gate is not Gate.OPEN or self._stopping:
            if not await self._wait_gate(self._cfg.hold):
                self._ledger.count(REFUSED_RESTARTING)
                conn.answer(self._refusal())
                return
        path = request.target.split("?", 1)[0]
        parsed = _parse(request.method, path, request.body)
        fid = self._ledger.open(request.method, path, stream=parsed.stream, max_tokens=parsed.max_tokens,
                                prompt_bytes=len(request.body), generation=parsed.generation, body=request.body)
        live = _Live(fid, conn)
        self._live[fid] = live
        if self._recorder is not None:
            self._record_arrival(fid, conn, request, parsed)
        self._idle.clear()
        try:
            await self._serve(conn, request, parsed, live)
        except Exception:  # a bug, or a client gone mid-write: never an empty answer, never a flight left open
            log.exception("front door %s: request %s failed", self.name, fid)
            if not conn.started:
                conn.answer(http1.error_answer(502, "the mlxwatch front door failed to relay this request",
                                               wire.UNREACHABLE))
            else:
                conn.abort()
        finally:
            self._live.pop(fid, None)
            if self._ledger.get(fid) is not None:  # a flight left open would look like a stall forever
                self._ledger.close(fid, FAILED_LOUDLY)
            if not self._live:
                self._idle.set()

    def abandoned(self) -> None:
        """A client closed its connection with a request sent in part (a head or body cut
        short): it went away first, so it is counted cancelled."""
        self._ledger.count(CANCELLED)

    def _record_arrival(self, fid: str, conn: http1.ClientConnection, request: http1.Request,
                        parsed: _Parsed) -> None:
        assert self._recorder is not None
        try:
            label = self._conn_labels.get(conn)
            if label is None:
                self._conn_count += 1
                peer = conn.transport.get_extra_info("peername") if conn.transport is not None else None
                where = f" {peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else ""
                label = self._conn_labels[conn] = f"c{self._conn_count}{where}"
            self._recorder.arrived(fid, label, request.method, request.target, request.headers, request.body,
                                   stream=parsed.stream, max_tokens=parsed.max_tokens)
        except Exception:  # the recorder is evidence: a bug there never stops a request
            log.exception("front door %s: recording request %s failed", self.name, fid)

    def _recorded_end(self, view: RequestView, outcome: str) -> None:
        """The ledger closed a flight: what came back goes to its recorded request."""
        if self._recorder is None:
            return
        live = self._live.get(view.id)
        try:
            status = live.status if live is not None else None
            finish = None
            if live is not None:
                finish = live.finish_reason or (live.sse.finish_reason if live.sse is not None else None)
            gone = outcome == CANCELLED or (live is not None and live.conn is not None and live.conn.gone)
            self._recorder.ended(view, outcome, status=status, finish_reason=finish, client_gone=gone)
        except Exception:
            log.exception("front door %s: recording the end of %s failed", self.name, view.id)

    def cut_off(self, why: str, after: float | None) -> None:
        """A connection closed by the door before any request went through: counted as timeout
        when it took longer than ``after`` s to send its request, else rejected (over a cap);
        said at most once a minute (a flood must not flood the log)."""
        self._ledger.count(TIMEOUT if after is not None else REJECTED)
        now = self._clock.monotonic()
        if now - self._cut_off_said >= 60.0:
            self._cut_off_said = now
            log.warning("front door %s: closed a client connection: %s%s (said at most once a minute)",
                        self.name, why, f" in {after:g}s" if after is not None else "")

    def _refusal(self) -> http1.Answer:
        if self._stopping:
            return http1.error_answer(503, "the mlxwatch front door is stopping", wire.STOPPING,
                                      retry_after=RETRY_AFTER)
        return http1.error_answer(503, "the server is being restarted by mlxwatch; try again shortly",
                                  wire.RESTARTING, retry_after=self._retry_after())

    async def _serve(self, conn: http1.ClientConnection, request: http1.Request, parsed: _Parsed,
                     live: _Live) -> None:
        live.task = asyncio.current_task()  # what _fail cancels, with live.failure saying why
        while True:
            opening = self._opened
            try:
                outcome = await self._exchange(conn, request, parsed, live)
            except asyncio.CancelledError:
                if live.failure is None or conn.gone:
                    # The client went away (or the daemon stops). One that closed once its answer
                    # was whole had it: the openai SDK closes right after `data: [DONE]`, often
                    # before the server's end of the answer reached the door (issue 29).
                    whole = live.final_at is not None and conn.took(live.final_at)
                    self._ledger.close(live.fid, OK if whole else CANCELLED)
                    raise
                assert live.task is not None
                live.task.uncancel()  # the door's own cancel: the exchange is over, the client is told below
            else:
                self._ledger.close(live.fid, outcome)
                return
            message, code = live.failure
            if not conn.started:
                if live.replay_due:
                    live.replayed = True
                    back = await self._wait_gate(self._cfg.hold, after_opening=opening)
                    live.replay_due = False
                    if back:
                        live.failure = None
                        self._ledger.restart(live.fid)
                        continue
                    log.warning("front door %s: request %s not sent again: the server was not back within "
                                "front.hold (%gs); failed loudly", self.name, live.fid, self._cfg.hold)
                self._ledger.close(live.fid, FAILED_LOUDLY)
                conn.answer(http1.error_answer(503, message, code, retry_after=self._retry_after()))
                return
            self._ledger.close(live.fid, FAILED_LOUDLY)
            await self._end_loudly(conn, live, message, code)
            return

    async def _end_loudly(self, conn: http1.ClientConnection, live: _Live, message: str, code: str) -> None:
        """End a response already started: an SSE error event and a clean end for a stream; for
        any other body (its length promised) the connection is cut, which clients report."""
        if live.sse is not None and conn.framed:
            try:
                await asyncio.wait_for(self._write_error_event(conn, live, message, code), ERROR_WRITE_TIMEOUT)
                return
            except (asyncio.TimeoutError, ConnectionError):
                pass
        conn.abort()

    async def _write_error_event(self, conn: http1.ClientConnection, live: _Live, message: str, code: str) -> None:
        at_boundary = live.sse.at_boundary if live.sse is not None else True
        conn.write(wire.sse_error(message, code, at_boundary=at_boundary))
        conn.end()
        await conn.drain()

    async def _exchange(self, conn: http1.ClientConnection, request: http1.Request, parsed: _Parsed,
                        live: _Live) -> str:
        """Forward one request and stream its answer back as it arrives; the outcome."""
        assert self._pool is not None
        headers = [(k, v) for k, v in wire.end_to_end(request.headers) if k.lower() not in _NOT_FORWARDED]
        try:
            upstream = await self._pool.connect()
        except OSError as exc:
            conn.answer(http1.error_answer(503, f"the server at {self._upstream} did not answer "
                                                f"({exc.strerror or exc.__class__.__name__})", wire.UNREACHABLE,
                                           retry_after=self._retry_after()))
            return FAILED_LOUDLY
        relay = _Relay(self, conn, live, parsed, head_only=request.method == "HEAD")
        conn.attach(upstream)
        try:
            upstream.send(self._pool.request_bytes(request, headers), relay, head_only=relay.head_only)
            error = await relay.done
        finally:
            conn.attach(None)
            upstream.detach()  # never reused half-read: a cancelled relay closes the server's request now
        if error is not None and not conn.started:
            if relay.status:  # its head came, held until the body was whole, which it never was
                conn.answer(http1.error_answer(502, f"the server ended its answer early ({error})",
                                               wire.TRUNCATED))
            else:
                conn.answer(http1.error_answer(503, f"the server at {self._upstream} did not answer ({error})",
                                               wire.UNREACHABLE, retry_after=self._retry_after()))
            return FAILED_LOUDLY
        if error is not None:
            live.failure = (f"the server ended the response early ({error})", wire.TRUNCATED)
        elif (live.sse is not None and live.tracking and relay.status == 200 and not live.sse.ended
              and not live.sse.errored):
            live.failure = ("the server closed the stream without [DONE] or a finish_reason", wire.TRUNCATED)
        if live.failure is not None:
            await self._end_loudly(conn, live, *live.failure)
            return FAILED_LOUDLY
        if relay.collected is not None:
            self._delivered(live, self._guarded(live, body_tokens, bytes(relay.collected)) or 0, 0)
            if self._recorder is not None:
                live.finish_reason = self._guarded(live, finish_reason, bytes(relay.collected))
        conn.end()
        if conn.eof and not (live.final_at is not None and conn.took(live.final_at)) and conn.reset:
            conn.abort()  # it shut its side before the answer was whole, and it is gone: it never read it
            return CANCELLED
        return OK

    def _count(self, live: _Live, chunk: bytes) -> int:
        if live.sse is None:
            return 0
        return self._guarded(live, live.sse.feed, chunk) or 0

    def _guarded(self, live: _Live, fn: Any, arg: Any) -> Any:
        """Call the watchdog side; a bug there stops counting for this request, never its bytes."""
        if not live.tracking:
            return None
        try:
            return fn(arg)
        except Exception:
            live.tracking = False
            log.exception("front door %s: counting tokens failed for %s; forwarding goes on", self.name, live.fid)
            return None

    def _delivered(self, live: _Live, tokens: int, nbytes: int) -> None:
        try:
            self._ledger.delivered(live.fid, tokens=tokens, nbytes=nbytes)
        except Exception:
            log.exception("front door %s: recording delivery failed for %s", self.name, live.fid)


class _Relay:
    """One answer from the server on its way to the client (an ``http1.Sink``): what one read
    from the server brings is sent to the client in one write, then counted (the client never
    waits for the door's bookkeeping).

    A non-streaming generation answer is the exception: its head is held until its body is whole
    (the server writes both at once when the generation is done, so the client waits no longer).
    Once a length is promised to the client a body cut short can only be a cut connection; held,
    a server that dies between head and body gets the client an explicit 502 instead."""

    def __init__(self, door: FrontDoor, conn: http1.ClientConnection, live: _Live, parsed: _Parsed, *,
                 head_only: bool) -> None:
        self.door, self.conn, self.live, self.parsed, self.head_only = door, conn, live, parsed, head_only
        self.done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self.status = 0
        self.collected: bytearray | None = None  # a generation's whole JSON answer, to count its tokens
        self._sent: list[bytes] | None = None  # chunks of the current read, counted once they are sent
        self._held: tuple[int, str, list[tuple[str, str]], int] | None = None  # a head sent with its whole body
        self._held_body = bytearray()

    def begin_read(self) -> None:
        self.conn.hold_writes()
        self._sent = []

    def end_read(self) -> None:
        self.conn.send_held()
        sent, self._sent = self._sent, None
        for chunk in sent or ():
            self._account(chunk)

    def on_head(self, status: int, reason: str, headers: list[tuple[str, str]], length: int | None) -> None:
        if self.live.failure is not None:
            return  # the door has failed this request: what the server sends now goes nowhere
        self.status = self.live.status = status
        ctype = next((v for k, v in headers if k.lower() == "content-type"), "")
        # an answer to HEAD has no body: no stream to judge, whatever its type says
        is_sse = not self.head_only and ctype.split(";", 1)[0].strip().lower() == "text/event-stream"
        self.live.sse = StreamReader() if is_sse else None
        if self.parsed.generation and not is_sse and 200 <= status < 300:
            self.collected = bytearray()
        out = wire.end_to_end(headers)
        if length is None and not self.head_only:  # the door frames this body itself
            out = [(k, v) for k, v in out if k.lower() != "content-length"]
        if self.collected is not None and length is not None and length <= MAX_BODY_READ and not self.head_only:
            self._held = (status, reason, out, length)
            return
        self.conn.start(status, reason, out, length=length, head_only=self.head_only)

    def _release(self) -> None:
        assert self._held is not None
        status, reason, out, length = self._held
        body, self._held, self._held_body = bytes(self._held_body), None, bytearray()
        self.conn.start(status, reason, out, length=length, head_only=False)
        if body:
            self.on_body(body)

    def on_body(self, chunk: bytes) -> None:
        if self.live.failure is not None:
            return
        if self._held is not None:
            self._held_body += chunk
            if len(self._held_body) >= self._held[3]:
                self._release()
            return
        self.conn.write(chunk)  # backpressure: a client that does not read pauses the server's side
        if self._sent is not None:
            self._sent.append(chunk)
        else:
            self._account(chunk)

    def _account(self, chunk: bytes) -> None:
        live = self.live
        tokens = self.door._count(live, chunk)
        if live.final_at is None and live.sse is not None and live.sse.ended:
            live.final_at = self.conn.written  # the final event ([DONE] or a finish_reason) has been written
        if self.collected is not None and len(self.collected) <= MAX_BODY_READ:
            self.collected += chunk
        self.door._delivered(live, tokens, len(chunk))

    def on_end(self, error: str | None) -> None:
        if self.live.failure is None:  # (a request the door failed gets nothing more of the server's)
            if self._held is not None and error is None:
                self._release()  # an empty body (a shorter one ends with an error)
            if error is None and self.live.final_at is None and (self.live.sse is None or self.live.sse.ended):
                self.live.final_at = self.conn.written  # the whole answer has been written
        if not self.done.done():
            self.done.set_result(error)


def retry_after(expected: float, closed_for: float) -> int:
    """Seconds a client refused during a restart should wait: until the restart is expected to
    be over, and a second (the SDK's retry then lands on the recovered server); once overdue, a
    quarter of the expected length, at least RETRY_AFTER; never above RETRY_AFTER_MAX."""
    left = expected - closed_for
    wait = left + 1.0 if left > 0 else max(float(RETRY_AFTER), expected / 4)
    return max(1, min(RETRY_AFTER_MAX, math.ceil(wait)))


def _parse(method: str, path: str, body: bytes) -> _Parsed:
    """Is this a generation request, does it stream, and how many tokens may it ask for."""
    generation = method == "POST" and path.rstrip("/").endswith("/completions")
    if not generation or not body:
        return _Parsed(generation, False, None)
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested too deep to read: forwarded as it is
        return _Parsed(generation, False, None)
    if not isinstance(data, dict):
        return _Parsed(generation, False, None)
    limit = data.get("max_completion_tokens", data.get("max_tokens"))
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
    return _Parsed(generation, data.get("stream") is True, limit)


class _Closed(asyncio.Protocol):
    """A connection over the cap: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


def connection_cap() -> int:
    """How many client connections the door keeps open at once: what the open-files limit
    leaves after the daemon's own needs, two descriptors per proxied request, within bounds."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, (soft - FDS_KEPT) // FDS_PER_CONNECTION))
