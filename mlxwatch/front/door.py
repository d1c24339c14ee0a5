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
    await door.stop(drain=5.0)

Built on aiohttp, server and client both: one maintained library, a C HTTP parser, streaming
with backpressure (``StreamResponse.write`` drains before the door reads more from the server),
and ``handler_cancellation`` so a client that goes away cancels its handler, which closes the
request to the server at once. The watchdog side (counting tokens, the stall sweep) is
guarded: a bug there is logged and never stops bytes from flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import math
import resource
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from multidict import CIMultiDict
from yarl import URL

from mlxwatch.clock import Clock
from mlxwatch.config import FrontConfig
from mlxwatch.errors import FrontError
from mlxwatch.front import wire
from mlxwatch.front.delivery import (
    CANCELLED, FAILED_LOUDLY, OK, REFUSED_RESTARTING, REJECTED, DeliveryView, Ledger, Observations,
    RequestView,
)
from mlxwatch.front.tokens import MAX_BODY_READ, StreamReader, body_tokens

log = logging.getLogger(__name__)

RETRY_AFTER = 5  # seconds a refused client is told to wait while the server restarts
ERROR_WRITE_TIMEOUT = 5.0  # writing the final error to a client that does not read: then cut
MAX_HEADER_COUNT = 100  # header fields per request (their total size is cfg.max_header): bounds what aiohttp
# holds while it parses one request head to cfg.max_header per line times this (clients send ~10)
# Clients that take their time sending a request are cut off, as nginx does (client_header_timeout,
# client_body_timeout, keepalive_timeout: 60, 60 and 75 s): a connection that never completes its
# request must not hold a file descriptor and buffers for ever (the daemon shares its descriptors
# with the door, and a few hundred such connections would starve its probes).
HEAD_TIMEOUT = 60.0  # from the connection to a complete request head
BODY_TIMEOUT = 60.0  # between two reads of a request body
KEEPALIVE_TIMEOUT = 75.0  # an idle keep-alive connection (also a partial next request)
MIN_CONNECTIONS, MAX_CONNECTIONS = 32, 4096  # the cap on open client connections: bounds of
FDS_PER_CONNECTION, FDS_KEPT = 2, 128  # ... (open-files limit - kept for the daemon) / fds per connection
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
    task: asyncio.Task | None = None
    response: web.StreamResponse | None = None  # set once the client's response has started
    sse: StreamReader | None = None
    failure: tuple[str, str] | None = None  # (message, code) once the door decided to fail it
    replayed: bool = False
    tracking: bool = True  # False after a bug in counting: bytes keep flowing, tokens stop counting


@dataclass(frozen=True)
class _Parsed:
    generation: bool
    stream: bool
    max_tokens: int | None


class FrontDoor:
    """A pass-through for one instance; see the module docstring."""

    def __init__(self, name: str, upstream: str, cfg: FrontConfig, *, clock: Clock | None = None) -> None:
        self.name = name
        self._upstream = upstream.rstrip("/")
        self._cfg = cfg
        self._clock = clock or Clock()
        self._ledger = Ledger(self._clock.monotonic)
        self._gate = Gate.OPEN
        self._gate_changed = asyncio.Event()  # set (and replaced) at every gate change and at stop
        self._opened = 0  # how many times the gate has opened: a replay waits for the next opening
        self._live: dict[str, _Live] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._stalled: list[RequestView] = []
        self._stopping = False
        self._runner: web.ServerRunner | None = None
        self._site: web.TCPSite | None = None
        self._session: aiohttp.ClientSession | None = None
        self._monitor: asyncio.Task | None = None
        self._cut_off_said = -math.inf

    # -- life ----------------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """The address served (the bound port when cfg.listen asked for port 0)."""
        host, port = self._cfg.listen
        if self._runner is not None and self._runner.addresses:
            bound = self._runner.addresses[0]
            return host, int(bound[1])
        return host, port

    async def start(self) -> None:
        """Bind ``cfg.listen`` and serve; FrontError (one line) if the address cannot be bound."""
        if self._runner is not None:
            return
        host, port = self._cfg.listen
        self._stopping = False
        server = _Server(self._handle, handler_cancellation=True, max_line_size=self._cfg.max_header,
                         max_field_size=self._cfg.max_header, max_headers=MAX_HEADER_COUNT,
                         keepalive_timeout=KEEPALIVE_TIMEOUT, access_log=None, door=self,
                         max_connections=connection_cap())
        runner = web.ServerRunner(server, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise FrontError(f"front door {self.name}: cannot listen on {host}:{port}: "
                             f"{exc.strerror or exc}") from exc
        self._runner, self._site = runner, site
        self._session = aiohttp.ClientSession(
            auto_decompress=False,  # bytes pass as the server sent them, compressed or not
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None),  # a slow answer is the watchdog's call, not a timeout's
            connector=aiohttp.TCPConnector(limit=0),
            cookie_jar=aiohttp.DummyCookieJar(),  # a proxy keeps no cookies: one client's would reach the next
        )
        self._monitor = self._start_monitor()

    async def stop(self, drain: float = 5.0) -> None:
        """Stop accepting; wait up to ``drain`` s for requests in flight, then fail the rest loudly.

        Returns within about ``drain + ERROR_WRITE_TIMEOUT`` s; ``start`` afterwards serves again."""
        if self._runner is None:
            return
        self._stopping = True
        self._wake_gate_waiters()
        if self._site is not None:
            await self._site.stop()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), max(0.0, drain))
        if self._live:
            self._fail_all("the mlxwatch front door is stopping", wire.STOPPING)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), ERROR_WRITE_TIMEOUT + 1.0)
        if self._monitor is not None:
            self._monitor.remove_done_callback(self._monitor_ended)
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()
        self._runner = self._site = self._session = self._monitor = None

    # -- what the daemon reads and decides -------------------------------------------------------

    def view(self) -> DeliveryView:
        return self._ledger.view()

    def take_observations(self) -> Observations:
        """First-token latencies and token rates of requests finished since the last call."""
        return self._ledger.take_observations()

    def set_gate(self, gate: Gate) -> None:
        if gate is self._gate:
            return
        self._gate = gate
        if gate is Gate.OPEN:
            self._opened += 1
        self._wake_gate_waiters()

    @property
    def gate(self) -> Gate:
        return self._gate

    def fail_in_flight(self, reason: str) -> int:
        """End every request in flight now with an explicit error naming ``reason``; how many."""
        return self._fail_all(reason, wire.HUNG)

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
        live.failure = (message, code)
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
        if task.cancelled() or self._runner is None:
            return
        log.error("front door %s: stall sweep ended (%r); started again", self.name, task.exception())
        self._monitor = self._start_monitor()

    async def _sweep_forever(self) -> None:
        tick = min(1.0, max(0.05, self._cfg.request_stall_timeout / 4))
        while True:
            await asyncio.sleep(tick)
            try:
                self.sweep()
            except Exception:  # the watchdog side never stops the door
                log.exception("front door %s: stall sweep failed", self.name)

    def sweep(self) -> list[RequestView]:
        """Fail each request with no token for request_stall_timeout while others got tokens."""
        timeout = self._cfg.request_stall_timeout
        failed = []
        for view in self._ledger.stalled(timeout):
            live = self._live.get(view.id)
            if live is not None and self._fail(live, f"no token for {timeout:g} s while other requests "
                                                     "received tokens (mlxwatch front door)", wire.STALLED):
                failed.append(view)
        self._stalled.extend(failed)
        return failed

    # -- serving -----------------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        head = len(request.method) + len(request.raw_path) + 12 + sum(
            len(k) + len(v) + 4 for k, v in request.raw_headers)
        if head > self._cfg.max_header:
            self._ledger.count(REJECTED)
            return _error(431, f"request headers are {head} bytes; the limit is {self._cfg.max_header} "
                               "(front.max_header)", wire.HEADERS_TOO_LARGE, close=True)
        if not request.raw_path.startswith("/"):  # absolute-form or CONNECT: the door is no forward proxy
            self._ledger.count(REJECTED)
            return _error(400, f"the request target must be a path on this server (got {request.raw_path[:80]!r})",
                          wire.BAD_REQUEST, close=True)
        body = await self._read_body(request)
        if isinstance(body, web.StreamResponse):
            return body
        if self._gate is not Gate.OPEN or self._stopping:
            if not await self._wait_gate(self._cfg.hold):
                self._ledger.count(REFUSED_RESTARTING)
                return self._refusal()
        parsed = _parse(request.method, request.path, body)
        fid = self._ledger.open(request.method, request.path, stream=parsed.stream, max_tokens=parsed.max_tokens,
                                prompt_bytes=len(body), generation=parsed.generation, body=body)
        live = _Live(fid)
        self._live[fid] = live
        self._idle.clear()
        try:
            return await self._serve(request, body, parsed, live)
        except Exception:  # a bug, or a client gone mid-write: never an empty answer, never a flight left open
            log.exception("front door %s: request %s failed", self.name, fid)
            if live.response is None:
                return _error(502, "the mlxwatch front door failed to relay this request", wire.UNREACHABLE)
            if request.transport is not None:
                request.transport.abort()
            return live.response
        finally:
            self._live.pop(fid, None)
            if self._ledger.get(fid) is not None:  # a flight left open would look like a stall forever
                self._ledger.close(fid, FAILED_LOUDLY)
            if not self._live:
                self._idle.set()

    def cut_off(self, why: str, after: float | None) -> None:
        """A connection closed by the door before any request went through: counted as rejected,
        said at most once a minute (a flood must not flood the log)."""
        self._ledger.count(REJECTED)
        now = self._clock.monotonic()
        if now - self._cut_off_said >= 60.0:
            self._cut_off_said = now
            log.warning("front door %s: closed a client connection: %s%s (said at most once a minute)",
                        self.name, why, f" in {after:g}s" if after is not None else "")

    def unparsable(self, exc: BaseException | None, message: str | None) -> web.Response:
        """The answer to a request aiohttp's parser refused: 431 for a header line or header
        count over the limit, else 400; both in JSON."""
        self._ledger.count(REJECTED)
        if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc)):
            return _error(431, f"a request header line is over {self._cfg.max_header} bytes (front.max_header) "
                               f"or there are over {MAX_HEADER_COUNT} header fields", wire.HEADERS_TOO_LARGE,
                          close=True)
        return _error(400, f"malformed HTTP request: {exc or message}", wire.BAD_REQUEST, close=True)

    def _refusal(self) -> web.Response:
        if self._stopping:
            return _error(503, "the mlxwatch front door is stopping", wire.STOPPING, retry_after=RETRY_AFTER)
        wait = max(RETRY_AFTER, math.ceil(self._cfg.hold))
        return _error(503, "the server is being restarted by mlxwatch; try again shortly", wire.RESTARTING,
                      retry_after=wait)

    async def _read_body(self, request: web.BaseRequest) -> bytes | web.StreamResponse:
        limit = self._cfg.max_body
        if request.content_length is not None and request.content_length > limit:
            self._ledger.count(REJECTED)
            return _error(413, f"request body is {request.content_length} bytes; the limit is {limit} "
                               "(front.max_body)", wire.TOO_LARGE, close=True)
        if request.headers.get("Expect", "").lower() == "100-continue":
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = bytearray()
        while True:
            try:
                chunk = await asyncio.wait_for(request.content.readany(), BODY_TIMEOUT)
            except asyncio.TimeoutError:
                self._ledger.count(REJECTED)
                return _error(408, f"no byte of the request body for {BODY_TIMEOUT:g}s", wire.TIMEOUT, close=True)
            if not chunk:
                break
            body += chunk
            if len(body) > limit:
                self._ledger.count(REJECTED)
                return _error(413, f"request body is over the limit of {limit} bytes (front.max_body)",
                              wire.TOO_LARGE, close=True)
        return bytes(body)

    async def _serve(self, request: web.BaseRequest, body: bytes, parsed: _Parsed, live: _Live) -> web.StreamResponse:
        while True:
            opening = self._opened
            live.task = asyncio.create_task(self._exchange(request, body, parsed, live))
            try:
                outcome, response = await live.task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if live.failure is None or (current is not None and current.cancelling()):
                    self._ledger.close(live.fid, CANCELLED)  # the client went away
                    raise
            else:
                self._ledger.close(live.fid, outcome)
                return response
            message, code = live.failure
            if live.response is None:
                if self._cfg.replay and not live.replayed and code == wire.HUNG:
                    live.replayed = True
                    if await self._wait_gate(self._cfg.hold, after_opening=opening):
                        live.failure = None
                        self._ledger.restart(live.fid)
                        continue
                self._ledger.close(live.fid, FAILED_LOUDLY)
                return _error(503, message, code, retry_after=RETRY_AFTER)
            self._ledger.close(live.fid, FAILED_LOUDLY)
            await self._end_loudly(request, live, message, code)
            return live.response

    async def _end_loudly(self, request: web.BaseRequest, live: _Live, message: str, code: str) -> None:
        """End a response already started: an SSE error event and a clean end for a stream; for
        any other body (its length promised) the connection is cut, which clients report."""
        response = live.response
        assert response is not None
        if live.sse is not None and response.content_length is None:
            try:
                await asyncio.wait_for(self._write_error_event(response, live, message, code), ERROR_WRITE_TIMEOUT)
                return
            except (asyncio.TimeoutError, ConnectionError):
                pass
        if request.transport is not None:
            request.transport.abort()
        response.force_close()

    async def _write_error_event(self, response: web.StreamResponse, live: _Live, message: str, code: str) -> None:
        at_boundary = live.sse.at_boundary if live.sse is not None else True
        await response.write(wire.sse_error(message, code, at_boundary=at_boundary))
        await response.write_eof()

    async def _exchange(self, request: web.BaseRequest, body: bytes, parsed: _Parsed,
                        live: _Live) -> tuple[str, web.StreamResponse]:
        """Forward one request and stream its answer back; the outcome and the response."""
        assert self._session is not None
        headers = CIMultiDict((k, v) for k, v in wire.end_to_end(request.headers.items())
                              if k.lower() not in _NOT_FORWARDED)
        url = URL(self._upstream + request.raw_path, encoded=True)
        try:
            upstream = await self._session.request(request.method, url, headers=headers, data=body or None,
                                                   allow_redirects=False)
        except aiohttp.ClientError as exc:
            message = f"the server at {self._upstream} did not answer ({exc.__class__.__name__})"
            return FAILED_LOUDLY, _error(503, message, wire.UNREACHABLE, retry_after=RETRY_AFTER)
        try:
            return await self._relay(request, upstream, parsed, live)
        finally:
            upstream.close()  # never reused half-read: a cancelled relay closes the server's request now

    async def _relay(self, request: web.BaseRequest, upstream: aiohttp.ClientResponse, parsed: _Parsed,
                     live: _Live) -> tuple[str, web.StreamResponse]:
        out_headers = CIMultiDict(wire.end_to_end(
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in upstream.raw_headers))
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=out_headers)
        is_sse = upstream.content_type == "text/event-stream"
        live.sse = StreamReader() if is_sse else None
        collect = parsed.generation and not is_sse and 200 <= upstream.status < 300
        collected = bytearray()
        await response.prepare(request)  # writes the status line and headers, without suspending
        live.response = response  # from here on the client has bytes: no 503, no replay
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                live.failure = (f"the server ended the response early ({exc.__class__.__name__})", wire.TRUNCATED)
                await self._end_loudly(request, live, *live.failure)
                return FAILED_LOUDLY, response
            if not chunk:
                break
            try:
                await response.write(chunk)  # drains: a slow client slows the read from the server
            except ConnectionError:
                return CANCELLED, response  # the client went away
            tokens = self._count(live, chunk)
            if collect and len(collected) <= MAX_BODY_READ:
                collected += chunk
            self._delivered(live, tokens, len(chunk))
        sse = live.sse
        if (sse is not None and live.tracking and upstream.status == 200 and not sse.ended and not sse.errored):
            live.failure = ("the server closed the stream without [DONE] or a finish_reason", wire.TRUNCATED)
            await self._end_loudly(request, live, *live.failure)
            return FAILED_LOUDLY, response
        if collect:
            self._delivered(live, self._guarded(live, body_tokens, bytes(collected)) or 0, 0)
        await response.write_eof()
        return OK, response

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


def _parse(method: str, path: str, body: bytes) -> _Parsed:
    """Is this a generation request, does it stream, and how many tokens may it ask for."""
    generation = method == "POST" and path.rstrip("/").endswith("/completions")
    if not generation or not body:
        return _Parsed(generation, False, None)
    try:
        data = json.loads(body)
    except ValueError:
        return _Parsed(generation, False, None)
    if not isinstance(data, dict):
        return _Parsed(generation, False, None)
    limit = data.get("max_completion_tokens", data.get("max_tokens"))
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
    return _Parsed(generation, data.get("stream") is True, limit)


def _error(status: int, message: str, code: str, *, retry_after: int | None = None,
           close: bool = False) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    response = web.Response(status=status, body=wire.error_json(message, code), headers=headers,
                            content_type="application/json")
    if close:
        response.force_close()  # the rest of the request was not read: this connection is done
    return response


class _Handler(web.RequestHandler):
    """aiohttp's connection handler, answering a request it cannot parse in JSON: 431 for a
    header line or header count over the limit (aiohttp's own answer is a plain-text 400); a
    connection over the server's cap is closed at once, one that sends no complete request
    head within HEAD_TIMEOUT is closed then."""

    door: FrontDoor  # set by _Server as it makes the handler
    over_cap = False
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self.over_cap:
            self.force_close()
            return
        self._head_timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT, self._no_request_in_time)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and getattr(self, "_request_count", 1) > 0:
            self._head_timer.cancel()  # a whole head arrived; between requests aiohttp's keepalive_timeout rules
            self._head_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def _no_request_in_time(self) -> None:
        self._head_timer = None
        self.door.cut_off("no complete request head", HEAD_TIMEOUT)
        self.force_close()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if status != 400 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        return self.door.unparsable(exc, message)


class _Server(web.Server):
    """aiohttp's low-level server (no router: every method and path reaches the handler) with
    the JSON-answering connection handler above."""

    def __init__(self, handler: Any, *, door: FrontDoor, max_connections: int, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.door = door
        self.max_connections = max_connections

    def __call__(self) -> web.RequestHandler:
        handler = _Handler(self, loop=self._loop, **self._kwargs)
        handler.door = self.door
        if len(self.connections) >= self.max_connections:
            handler.over_cap = True
            self.door.cut_off(f"{len(self.connections)} connections open, the cap", None)
        return handler


def connection_cap() -> int:
    """How many client connections the door keeps open at once: what the open-files limit
    leaves after the daemon's own needs, two descriptors per proxied request, within bounds."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, (soft - FDS_KEPT) // FDS_PER_CONNECTION))
