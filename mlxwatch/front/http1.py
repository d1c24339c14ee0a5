"""HTTP/1.1 for the front door: asyncio's transports and httptools' parsers, nothing between.

The door is a hop every token crosses, so the hop must cost as little as Python allows. aiohttp's
server and client, joined with none of the door's work, added 0.7-1.4 ms to the first token where
nginx added 0.06-0.35 ms (bench/RESULTS.md); a bare relay on asyncio's transports and httptools
adds 1.5-2.0x nginx's hop (bench/front_hop.py), the least an asyncio proxy adds. So the door keeps
the relay's shape: bytes are parsed by httptools (llhttp, the parser of Node.js, as uvicorn uses
it) and written on by the protocol callbacks that receive them, with no stream object, task or
copy between a chunk from the server and the ``write`` to the client.

- ``ClientConnection``: one client's connection. Parses its requests (limits and timeouts as
  nginx sets them), hands each complete request to the door in order, writes the answer with the
  framing this client understands (the body as the server sent it; chunked when its length is
  unknown and the client speaks HTTP/1.1), and passes backpressure on to the server's side.
- ``UpstreamConnection``: one connection to the server. Writes a request, parses the answer and
  pushes head, body and end to a ``Sink`` as they arrive. ``UpstreamPool`` keeps idle ones.

No policy lives here: what to forward, refuse or fail is the door's (``door.py``).
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import logging
import select
import socket
import ssl
import struct
import sys
import termios
from dataclasses import dataclass
from typing import Callable, Coroutine, Protocol, cast
from urllib.parse import urlsplit

import httptools

from mlxwatch.config import url_port
from mlxwatch.front import wire
from mlxwatch.host.ownconns import OWN

log = logging.getLogger(__name__)

_REASONS = {100: "Continue", 200: "OK", 400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large",
            431: "Request Header Fields Too Large", 502: "Bad Gateway", 503: "Service Unavailable"}
_NO_BODY = frozenset({204, 304})
_SO_NWRITE = 0x1024  # macOS <sys/socket.h>: bytes in the send buffer not yet acknowledged
IDLE_KEPT = 32  # idle connections to the server kept for reuse
CHUNK_LINE = 32  # bytes allowed per chunk of a request body for its size line and CRLFs
STASH_LIMIT = 64 * 1024  # bytes read ahead while a request is served; beyond, reading pauses
SEND_TIMEOUT = 60.0  # a client that takes no byte of its answer for this long is cut off (nginx's send_timeout)
LINGER_TIMEOUT = 5.0  # after a refusal, the longest wait for more of the refused request (nginx's lingering_timeout)
LINGER_TIME = 30.0  # after a refusal, the longest time its request is read and dropped (nginx's lingering_time)


@dataclass
class Request:
    """A complete request from a client, as it sent it."""

    method: str
    target: str  # path and query as sent (percent-encoding kept)
    version: str  # "1.1" or "1.0"
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def header_list(self, name: str) -> str:
        """Every field of ``name`` joined as one list (RFC 9110, 5.3); empty if none."""
        name = name.lower()
        return ", ".join(v for k, v in self.headers if k.lower() == name)


@dataclass(frozen=True)
class Answer:
    """A whole answer the door writes itself (its errors): JSON, with its length."""

    status: int
    body: bytes
    retry_after: int | None = None
    close: bool = False  # the rest of the request was not read: the connection is done


@dataclass(frozen=True)
class Limits:
    max_header: int  # bytes of a request head
    max_header_count: int
    max_body: int
    head_timeout: float  # from the connection (or the last answer) to a complete request head
    body_timeout: float  # from the start of reading a request body to its end (the whole body)
    keepalive_timeout: float  # an idle connection between requests


class Door(Protocol):
    """What a ClientConnection needs of the door."""

    def serve(self, conn: ClientConnection, request: Request) -> Coroutine[None, None, None]: ...
    def refused(self, answer: Answer, why: str) -> Answer: ...
    def cut_off(self, why: str, after: float | None) -> None: ...
    def abandoned(self) -> None: ...
    def admit(self, conn: ClientConnection) -> bool: ...
    def hold(self, nbytes: int) -> Answer | None: ...
    def let_go(self, nbytes: int) -> None: ...
    def closed(self, conn: ClientConnection) -> None: ...


class _Refuse(Exception):
    """Raised from a parser callback: stop parsing this connection, answer, close."""

    def __init__(self, answer: Answer, why: str) -> None:
        super().__init__(why)
        self.answer = answer


def error_answer(status: int, message: str, code: str, *, retry_after: int | None = None,
                 close: bool = False) -> Answer:
    return Answer(status, wire.error_json(message, code), retry_after, close)


def _head(status: int, reason: str, headers: list[tuple[str, str]]) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}\r\n"]
    lines += [f"{k}: {v}\r\n" for k, v in headers]
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


class ClientConnection(asyncio.Protocol):
    """One client connection; see the module docstring. Requests are served one at a time, in
    order (reading stops while a pipelined request waits)."""

    def __init__(self, door: Door, limits: Limits) -> None:
        self.door = door
        self.limits = limits
        self.transport: asyncio.Transport | None = None
        self.upstream: UpstreamConnection | None = None  # paused and resumed with this client's reading
        self.address = ""  # the client's IP address
        self.admitted = False  # counted against its address's share (the door's to set and clear)
        self._parser = httptools.HttpRequestParser(self)
        self._queue: collections.deque[Request | Answer] = collections.deque()
        self._task: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None
        self._closing = False
        self._done_reading = False
        self._eof = False  # the client shut its sending side (a half-close, or the start of a close)
        self._taken_at_end: int | None = None  # bytes the kernel had taken when the client's end came
        self._lost = False  # the transport is gone
        # the request being parsed
        self._in_head = False
        self._head_bytes = 0
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._body = bytearray()
        self._held_bytes = 0  # request body bytes this connection holds against the door's total
        self._reserved = 0  # bytes held for the body being read, on its Content-Length (0: none)
        self._body_timer: asyncio.TimerHandle | None = None
        self._in_body = False
        self._body_bytes = 0
        self._begun = False  # a message began during the current read
        self._trailer_bytes = 0
        self._chunks = 0
        self._stash = bytearray()  # read while a request is served, parsed after it
        self._close_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None  # armed while writing is paused
        self._written = 0  # bytes handed to the transport
        self._taken = 0  # bytes the client had taken when the send timer was armed
        self._close_taken = 0  # ... when the close timer was
        self._linger_until: float | None = None  # a refusal was sent: the client's bytes are read and dropped
        self._continue_due = False  # the request being read waits for a 100 Continue
        self._head_request = False  # the request being answered is a HEAD: the door's own answers have no body
        # the answer being written
        self._version = "1.1"
        self._chunked = False
        self._open_ended = False
        self._close_after = False
        self._held: list[bytes] | None = None  # writes gathered during one read from the server
        self.started = False  # a status line has been written for the current request

    # -- the transport's side ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP transport (uvloop's is no subclass)
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self.door.admit(self):
            self._closing = True
            self.transport.abort()  # over its address's share of the connections: closed at once
            return
        self._wait_for_request(self.limits.head_timeout, first=True)

    def data_received(self, data: bytes) -> None:
        if self._closing or self._done_reading:
            if self._linger_until is not None:
                self._linger_on()
            return  # read on (and dropped) so that a client that goes away is still noticed
        if self._task is not None:  # a request is being served: its successor waits, unparsed
            self._stash += data
            if len(self._stash) > STASH_LIMIT and self.transport is not None:
                self.transport.pause_reading()
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        self._begun = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._upgraded()
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            assert isinstance(refusal, _Refuse), refusal
            self._refuse(refusal.answer, str(refusal))
        except httptools.HttpParserError as exc:
            self._refuse(error_answer(400, f"malformed HTTP request: {exc}", wire.BAD_REQUEST, close=True),
                         "malformed")
        else:
            # Bytes read are bounded per message: a head to max_header, and besides the body (itself
            # bounded by max_body) its chunk lines and trailers to max_header plus CHUNK_LINE per chunk.
            # A read in which a message began is not counted (at most one read under-counted).
            if self._in_head and not self._begun:
                self._head_bytes += len(data)
                if self._head_bytes > self.limits.max_header:
                    self._refuse(self._too_large_head(), "head too large")
            elif self._in_body and not self._begun:
                # what is read beyond the body itself: chunk lines and trailers (httptools holds a
                # trailer field whole until its line ends)
                self._body_bytes += len(data)
                if self._body_bytes - len(self._body) > self.limits.max_header + CHUNK_LINE * self._chunks:
                    self._refuse(self._too_large_head(), "chunk framing or trailers too large")
        self._next()
        if self._in_body and not self._done_reading and self._task is None:
            self._arm_body_timer()  # a body to come: all of it is due within body_timeout of now (its
            # bytes are not read while a request before it is served: its deadline starts when they are)

    def _upgraded(self) -> None:
        """llhttp stops at an upgrade request's head (and takes its body as the new protocol's):
        one without a body is answered as a plain request, then the connection ends; one with a
        body is refused, loudly, rather than sent on without it."""
        self._done_reading = True
        last = self._queue[-1] if self._queue else None
        declared = isinstance(last, Request) and ((last.header("content-length") or "0").strip() != "0"
                                                  or last.header("transfer-encoding") is not None)
        if isinstance(last, Request) and not declared:
            return
        if isinstance(last, Request):
            self._queue.pop()
        self._refuse(error_answer(400, "the request asks for a protocol upgrade (Upgrade header), which the door "
                                       "does not pass on; send it without one", wire.BAD_REQUEST, close=True),
                     "an upgrade")

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._taken_at_end is None:
            self._taken_at_end = self._bytes_taken()
        if (self._in_head or self._in_body) and (self._eof or not self._closing):
            # the client closed with a request sent in part: counted, as a client gone (3,072 such
            # connections were counted in no outcome: issue 36)
            self._in_head = self._in_body = False
            self.door.abandoned()
        self._lost = True
        self._closing = True
        self._let_go(self._held_bytes)  # every body it held, read in part or waiting: given back
        # ... and its memory now: the connection and its parser hold each other, so without this
        # the bodies wait for the cyclic garbage collector, which large buffers alone seldom wake
        # (20 connections of 16 MiB each left 366 MB after they closed: issue 29)
        self._body, self._stash = bytearray(), bytearray()
        self._queue.clear()
        self._cancel_timers()
        for timer in (self._close_timer, self._send_timer):
            if timer is not None:
                timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client went away: its request to the server is closed at once
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)  # drain() sees the connection gone
        self.door.closed(self)

    def eof_received(self) -> bool | None:
        """The client shut its sending side. That is a half-close (``nc -N``, some HTTP/1.0
        tools: it still reads) or the first half of a close, and TCP tells them apart only when
        the door next writes: so a request being served, or complete and waiting, still gets
        its answer (a client that closed whole is noticed when a write to it fails, and its
        request to the server closed then), after which the connection is closed. With nothing
        to answer, ours is closed now. Either way what is written is cut if the client does not
        take it, as SEND_TIMEOUT says (a client that half-closes and never reads held the
        connection for ever; found in review)."""
        if self._eof:
            return True
        self._eof = True
        self._taken_at_end = self._bytes_taken()
        if (self._task is not None or self._queue) and not self._closing:
            if not self._queue and not self._stash:
                self._close_after = True  # nothing more can come: the answer ends the connection
            return True  # keep our side open to write the answer
        self.close()
        return None

    @property
    def eof(self) -> bool:
        """The client shut its sending side."""
        return self._eof

    @property
    def written(self) -> int:
        """Bytes of this connection's answers handed to the transport so far."""
        return self._written

    @property
    def reset(self) -> bool:
        """The client is gone: the connection is lost, a write to it failed, or its socket holds
        an error (a client that closed whole answers the door's next bytes with a reset, which
        the kernel has by the time a write on loopback returns)."""
        if self.transport is None or self._lost or (self.transport.is_closing() and not self._closing):
            return True
        sock = self.transport.get_extra_info("socket")
        try:
            return sock is not None and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        except OSError:
            return True

    def took(self, offset: int) -> bool:
        """Whether the kernel had taken the answer's bytes up to ``offset`` from the door when
        the client's end came (or by now, if it has not come)."""
        taken = self._taken_at_end if self._taken_at_end is not None else self._bytes_taken()
        return taken >= offset

    @property
    def waiting_on_client(self) -> bool:
        """The client is not taking what the door wrote to it (writing paused): the door stopped
        reading the server for it, so no token arriving is the client's doing, not the server's."""
        return self._paused and not self._lost

    def pause_writing(self) -> None:
        self._paused = True
        if self.upstream is not None:
            self.upstream.pause_reading()  # a slow client slows the reads from the server
        self._arm_send_timer()

    def resume_writing(self) -> None:
        self._paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self.upstream is not None:
            self.upstream.resume_reading()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    # -- httptools' callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._begun = True
        self._in_head = True
        self._in_body = False
        self._head_bytes = 0
        self._body_bytes = 0
        self._trailer_bytes = 0
        self._chunks = 0
        self._url = b""
        self._headers = []
        self._body = bytearray()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_body:  # a trailer field: counted against the head's limit, never forwarded
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > self.limits.max_header:
                raise _Refuse(self._too_large_head(), "trailers too large")
            return
        self._headers.append((name.decode("latin-1"), value.rstrip(b" \t").decode("latin-1")))  # RFC 9112, 5.1: no OWS
        if len(self._headers) > self.limits.max_header_count:
            raise _Refuse(self._too_large_head(), "too many header fields")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        self._clear_timer()
        method = self._parser.get_method().decode("latin-1")
        size = len(method) + len(self._url) + 12 + sum(len(k) + len(v) + 4 for k, v in self._headers)
        if size > self.limits.max_header:
            raise _Refuse(error_answer(431, f"request headers are {size} bytes; the limit is "
                                            f"{self.limits.max_header} (front.max_header)",
                                       wire.HEADERS_TOO_LARGE, close=True), "head too large")
        if not self._url.startswith(b"/"):  # absolute-form or CONNECT: the door is no forward proxy
            raise _Refuse(error_answer(400, f"the request target must be a path on this server (got "
                                            f"{self._url[:80].decode('latin-1')!r})", wire.BAD_REQUEST,
                                       close=True), "not a path")
        fields: dict[str, str] = {}
        for k, v in self._headers:  # a field sent twice is one list (RFC 9110, 5.3)
            k = k.lower()
            fields[k] = f"{fields[k]}, {v}" if k in fields else v
        coding = fields.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            raise _Refuse(error_answer(400, f"Transfer-Encoding {coding!r}: the door takes request bodies "
                                            "chunked or with a length only", wire.BAD_REQUEST, close=True),
                          "transfer coding")
        length = fields.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.limits.max_body:
            raise _Refuse(error_answer(413, f"request body is {int(length)} bytes; the limit is "
                                            f"{self.limits.max_body} (front.max_body)", wire.TOO_LARGE,
                                       close=True), "body too large")
        if length is not None and length.strip().isdigit():
            # Held whole now, on its length: a body that does not fit is refused before a byte of it
            # is read, and one that fits cannot be refused half-way (held as its bytes came, a full
            # door refused uploads after 6-14 MiB of them were sent: issue 36). Chunked bodies,
            # whose length is not known, are held as they come.
            refusal = self.door.hold(int(length))
            if refusal is not None:
                raise _Refuse(refusal, "the door's buffers full")
            self._held_bytes += int(length)
            self._reserved = int(length)
        if length not in (None, "0") or "transfer-encoding" in fields:
            if fields.get("expect", "").lower() == "100-continue" and self._parser.get_http_version() == "1.1":
                self._continue_due = True
                if self._task is None and not self._queue:  # never inside another request's answer: a
                    self._send_continue()  # request pipelined behind one gets it when that one is answered

    def _send_continue(self) -> None:
        self._continue_due = False
        self._write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_body(self, body: bytes) -> None:
        if len(self._body) + len(body) > self.limits.max_body:
            raise _Refuse(self._too_large_body(), "body too large")
        if not self._reserved:  # chunked (or a length of 0): held as it comes
            refusal = self.door.hold(len(body))
            if refusal is not None:
                raise _Refuse(refusal, "the door's buffers full")
            self._held_bytes += len(body)
        self._body += body

    def on_message_complete(self) -> None:
        self._in_body = False
        self._continue_due = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        version = self._parser.get_http_version()
        request = Request(self._parser.get_method().decode("latin-1"), self._url.decode("latin-1"), version,
                          self._headers, bytes(self._body))
        self._body = bytearray()  # the copy is the request's (held until it is answered)
        self._reserved = 0  # what it reserved is its body's length, let go once it is answered
        self._queue.append(request)

    # -- serving requests in order --------------------------------------------------------------

    def _next(self) -> None:
        if self._task is None and self._queue and not self._closing:
            self._task = asyncio.get_running_loop().create_task(self._serve_queue())

    async def _serve_queue(self) -> None:
        while self._queue and not self._closing:
            item = self._queue.popleft()
            if isinstance(item, Answer):
                self._head_request = False
                self.answer(item)
                return
            self._version = item.version
            self._head_request = item.method == "HEAD"
            options = {t.strip() for t in item.header_list("connection").lower().split(",")}
            self._close_after = (item.version != "1.1" or "close" in options
                                 or ((self._done_reading or self._eof) and not self._queue and not self._stash))
            self.started = False
            self._chunked = self._open_ended = False
            try:
                await self.door.serve(self, item)
            except Exception:  # the door answers its own failures; this is the last guard
                log.exception("front door: serving a request failed")
                self.abort()
                return
            finally:
                self._let_go(len(item.body))  # answered (or failed): its body is no longer held
            if self._paused and not self._closing:
                # The next request waits until the client takes this answer: a client pipelining
                # requests it never reads the answers of (503s during a restart) cannot pile them
                # up in the door's memory (found in review).
                try:
                    await self.drain()
                except ConnectionError:
                    return
            if self._close_after or self._closing:
                self.close()
                return
        self._task = None
        if self._closing or self.transport is None:
            return
        if self._done_reading:  # an upgrade: what followed its head was not HTTP
            self.close()
            return
        if self._in_body:  # a request read in part while the one before it was served
            self._arm_body_timer()
            if self._continue_due and not self._stash:
                self._send_continue()
        else:
            self._wait_for_request(self.limits.keepalive_timeout, first=False)
        if self._stash:
            stash, self._stash = bytes(self._stash), bytearray()
            self.transport.resume_reading()
            self._feed(stash)
        if self._eof and self._task is None and not self._queue:
            self.close()  # the client sends no more: a partial request never completes

    # -- writing the answer (for the door) ------------------------------------------------------

    def attach(self, upstream: UpstreamConnection | None) -> None:
        """The server connection whose reading follows this client's (None when done with it)."""
        self.upstream = upstream
        if upstream is not None and self._paused:
            upstream.pause_reading()

    def start(self, status: int, reason: str, headers: list[tuple[str, str]], *, length: int | None,
              head_only: bool) -> None:
        """Write the status line and headers (``headers`` end-to-end only, a Content-Length among
        them when ``length`` is known); the body follows with ``write`` and ``end``."""
        framing: list[tuple[str, str]] = []
        self._open_ended = not (head_only or status in _NO_BODY or status < 200) and length is None
        if self._open_ended:
            if self._version == "1.1":
                self._chunked = True
                framing.append(("Transfer-Encoding", "chunked"))
            else:
                self._close_after = True  # the end of the body is the end of the connection
        if self._close_after:
            framing.append(("Connection", "close"))
        self.started = True
        self._write(_head(status, reason or _REASONS.get(status, ""), headers + framing))

    def write(self, chunk: bytes) -> None:
        if chunk:
            self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self._chunked else chunk)

    def end(self) -> None:
        if self._chunked:
            self._write(b"0\r\n\r\n")

    def answer(self, answer: Answer) -> None:
        """Write a whole answer of the door's own (closing the connection after it if it says so)."""
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(answer.body)))]
        if answer.retry_after is not None:
            headers.append(("Retry-After", str(answer.retry_after)))
        if answer.close:
            self._close_after = True
            headers.append(("Connection", "close"))
        self.started = True
        body = b"" if self._head_request else answer.body
        self._write(_head(answer.status, _REASONS.get(answer.status, ""), headers) + body)
        if answer.close:
            self._linger()

    async def drain(self) -> None:
        """Wait until the client has read what was written (ConnectionError if it went away)."""
        if self._paused and not self._closing:
            if self._drained is None:
                self._drained = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drained)
        if self._closing:
            raise ConnectionResetError("the client closed the connection")

    @property
    def gone(self) -> bool:
        return self._closing

    @property
    def framed(self) -> bool:
        """The body being written ends by the door's say (chunked, or at the close), not at a
        length promised to the client: an error event can still follow."""
        return self._open_ended

    def close(self) -> None:
        """Close after what was written has been sent, or cut it if the client has not taken it
        within SEND_TIMEOUT (a client that never reads must not keep a connection for ever)."""
        self._closing = True
        self._cancel_timers()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
            self._arm_close_timer()  # (a lingering close's timer: this one takes over)

    def _linger(self) -> None:
        """Close after a refusal as nginx's lingering close does: the client may still be sending
        the request refused (a body over the limit), and closing with its bytes unread makes the
        kernel reset the connection, which discards the answer before a client that sends all
        before it reads (http.client, requests) sees it. So the door's side is shut after the
        answer, and what the client still sends is read and dropped until it closes, or for
        LINGER_TIMEOUT without a byte, or LINGER_TIME in all."""
        transport = self.transport
        if transport is None or transport.is_closing() or not transport.can_write_eof():
            self.close()
            return
        self._closing = True
        self._cancel_timers()
        transport.write_eof()  # after what was written: the client reads the answer, then the end
        transport.resume_reading()
        self._linger_until = asyncio.get_running_loop().time() + LINGER_TIME
        self._linger_on()

    def _linger_on(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._linger_until is not None
        if self._close_timer is not None:
            self._close_timer.cancel()
        wait = min(LINGER_TIMEOUT, self._linger_until - loop.time())
        self._close_timer = loop.call_later(max(wait, 0.0), self._linger_over)

    def _linger_over(self) -> None:
        self._close_timer = None
        self._linger_until = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()
            self._arm_close_timer()

    def abort(self) -> None:
        """Cut the connection now (a body whose length was promised cannot end otherwise)."""
        self._closing = True
        self._cancel_timers()
        if self.transport is not None:
            self.transport.abort()

    def hold_writes(self) -> None:
        """Gather writes until ``send_held``: what one read from the server brings (the head and
        the first chunks often come together) leaves in one ``send``."""
        self._held = []

    def send_held(self) -> None:
        held, self._held = self._held, None
        if held:
            self._write(b"".join(held))

    def _write(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
        elif self.transport is not None and not self.transport.is_closing() and self._linger_until is None:
            self._written += len(data)
            self.transport.write(data)

    # -- limits and timers -------------------------------------------------------------------------

    def _too_large_body(self) -> Answer:
        return error_answer(413, f"request body is over the limit of {self.limits.max_body} bytes (front.max_body)",
                            wire.TOO_LARGE, close=True)

    def _too_large_head(self) -> Answer:
        return error_answer(431, f"a request head over {self.limits.max_header} bytes (front.max_header) or over "
                                 f"{self.limits.max_header_count} header fields", wire.HEADERS_TOO_LARGE, close=True)

    def _let_go(self, nbytes: int) -> None:
        nbytes = min(nbytes, self._held_bytes)
        if nbytes > 0:
            self._held_bytes -= nbytes
            self.door.let_go(nbytes)

    def _refuse(self, answer: Answer, why: str) -> None:
        """Parse no more; answer (after the request being served, if any) and close."""
        self._let_go(self._reserved or len(self._body))  # a body read in part is dropped, and what was held for it
        self._reserved = 0
        self._body = bytearray()
        self._in_head = self._in_body = False
        self._cancel_timers()
        self._done_reading = True  # nothing more is parsed on this connection
        self._queue.append(self.door.refused(answer, why))
        self._next()

    def _wait_for_request(self, timeout: float, *, first: bool) -> None:
        self._clear_timer()
        self._timer = asyncio.get_running_loop().call_later(timeout, self._no_request_in_time, timeout, first)

    def _no_request_in_time(self, timeout: float, first: bool) -> None:
        self._timer = None
        if first or self._in_head:  # a partial head, or none at all since the connection opened
            self.door.cut_off("no complete request head", timeout)
        self._in_head = False  # counted here, not again as abandoned
        self.close()

    def _bytes_taken(self) -> int:
        """Bytes written that the client's side has taken: left the transport for the kernel,
        and of those, the ones the kernel still holds (unsent, or sent and not acknowledged by
        the client's kernel) taken off. A client reading slowly opens its receive window a
        little at a time and its kernel acknowledges as it does; the door's own buffer, by
        contrast, drains only when the kernel's send buffer has room for a third of it again
        (megabytes on loopback), which a client reading 64 KiB/s did not reach within 3 s
        (measured, issue 29)."""
        if self.transport is None:
            return self._written
        return self._written - self.transport.get_write_buffer_size() - _unacknowledged(self.transport)

    def _arm_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
        self._taken = self._bytes_taken()
        self._send_timer = asyncio.get_running_loop().call_later(SEND_TIMEOUT, self._send_too_slow)

    def _arm_close_timer(self) -> None:
        """Closing with what was written still unsent: cut it if the client takes no byte of it
        for SEND_TIMEOUT (a client reading, however slowly, is let finish)."""
        if self._close_timer is not None:
            self._close_timer.cancel()
        self._close_taken = self._bytes_taken()
        self._close_timer = asyncio.get_running_loop().call_later(SEND_TIMEOUT, self._close_too_slow)

    def _close_too_slow(self) -> None:
        self._close_timer = None
        if self.transport is None or self._lost:
            return
        if self._bytes_taken() > self._close_taken:
            self._arm_close_timer()
            return
        self.transport.abort()

    def _send_too_slow(self) -> None:
        """SEND_TIMEOUT with writing paused: cut the client off if it took no byte in that time
        (its request to the server is closed with it), else wait again. A client that never
        reads must not hold a connection, and a generation on the server, for ever."""
        self._send_timer = None
        if not self._paused or self.transport is None:  # (a closing transport too: its buffer is what is unsent)
            return
        if self._bytes_taken() > self._taken:
            self._arm_send_timer()
            return
        log.warning("front door: cut off a client that took no byte of its answer for %gs", SEND_TIMEOUT)
        self.abort()

    def _arm_body_timer(self) -> None:
        """The body's deadline, set once per body: a timer that started again at each read let a
        client holding a byte every few seconds keep its connection for ever (issue 29)."""
        if self._body_timer is None:
            self._body_timer = asyncio.get_running_loop().call_later(self.limits.body_timeout,
                                                                     self._body_too_slow)

    def _body_too_slow(self) -> None:
        self._body_timer = None
        timeout = self.limits.body_timeout
        self._refuse(error_answer(408, f"the request body was not complete within {timeout:g}s",
                                  wire.TIMEOUT, close=True), "body too slow")

    def _clear_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cancel_timers(self) -> None:
        self._clear_timer()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None


def _unacknowledged(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this socket that the peer has not acknowledged (Linux:
    SIOCOUTQ; macOS: SO_NWRITE); 0 where it cannot be asked."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        if sys.platform == "linux":
            return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0])
        if sys.platform == "darwin":
            return int(sock.getsockopt(socket.SOL_SOCKET, _SO_NWRITE))
    except (OSError, ValueError):
        pass
    return 0


class Sink(Protocol):
    """Where an UpstreamConnection delivers the server's answer, as it arrives; each read from
    the server is bracketed by ``begin_read`` and ``end_read``."""

    def begin_read(self) -> None: ...
    def end_read(self) -> None: ...
    def on_head(self, status: int, reason: str, headers: list[tuple[str, str]], length: int | None) -> None: ...
    def on_body(self, chunk: bytes) -> None: ...
    def on_end(self, error: str | None) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    """One connection to the server: one request at a time, its answer pushed to a Sink."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self._sink: Sink | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.used = False  # handed out for a request (one made ahead waits unused)
        self._own_key: tuple[str, int] | None = None  # its local address, registered as ours while it lives
        self._new_answer(head_only=False)

    def _new_answer(self, *, head_only: bool) -> None:
        """The state of one answer, fresh for each request sent on this connection."""
        self._head_only = head_only
        self._reason = b""
        self._headers: list[tuple[str, str]] = []
        self._until_close = False  # the body ends when the server closes
        self._got_head = False
        self._keep_alive = False
        self._complete = False
        self._trailing = False  # the server sent bytes after a complete answer

    def send(self, request: bytes, sink: Sink, *, head_only: bool) -> None:
        self._sink = sink
        self._new_answer(head_only=head_only)
        assert self.transport is not None
        self.transport.write(request)

    @property
    def reusable(self) -> bool:
        return self._complete and self._keep_alive and not self.closed and not self._until_close \
            and not self._head_only and not self._trailing

    @property
    def answered(self) -> bool:
        """The server's answer head came: its framing says whether the server keeps the connection."""
        return self._got_head

    @property
    def server_closes(self) -> bool:
        """The server ended (or will end) this connection after its answer."""
        return not self._keep_alive or self._until_close

    @property
    def usable(self) -> bool:
        """Open, and nothing to read: an idle connection has no answer coming, so a readable
        socket is a close (or bytes nobody asked for) the event loop has not handled yet."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return False
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return True
        poller = select.poll()  # not select(): the door's descriptors may number past FD_SETSIZE
        try:
            poller.register(sock.fileno(), select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def detach(self) -> None:
        """The door is done with this answer (whole, or abandoned): back to the pool, or closed."""
        self._sink = None
        self.pool.release(self)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a TCP transport (uvloop's is no subclass)
        # the door's own: kernel sight leaves it out (the door counts the tokens it passes)
        self._own_key = OWN.opened(transport.get_extra_info("sockname"))

    def data_received(self, data: bytes) -> None:
        if self._sink is None or self._complete:
            self.close()  # bytes nobody asked for: this connection cannot be reused
            return
        sink = self._sink
        sink.begin_read()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._finish("the server switched protocols, which the door does not pass on")
        except httptools.HttpParserError as exc:
            self._finish(f"the server's answer is not valid HTTP ({exc})")
        finally:
            sink.end_read()
        if self._complete and self._trailing:
            self.close()  # bytes after the end of the answer: dropped, and the connection with them

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        OWN.closed(self._own_key)
        self._own_key = None
        self.pool.forget(self)
        if self._sink is not None and not self._complete:
            if self._got_head and self._until_close:
                self._finish(None)
            else:
                self._finish("the server closed the connection" + (" before answering" if not self._got_head else
                                                                  " before the end of the answer"))

    # httptools' callbacks; once the answer is complete, whatever else the server sends is dropped
    def on_message_begin(self) -> None:
        if self._complete:
            self._trailing = True
        self._reason, self._headers = b"", []

    def on_status(self, reason: bytes) -> None:
        if not self._complete:
            self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._complete and not self._got_head:  # trailers of a chunked answer are not passed on
            self._headers.append((name.decode("latin-1"), value.rstrip(b" \t").decode("latin-1")))

    def on_headers_complete(self) -> None:
        if self._complete:
            return
        status = self._parser.get_status_code()
        if status < 200:
            self._reason, self._headers = b"", []  # an interim answer (100 Continue): the real one follows
            return
        fields = {k.lower(): v for k, v in self._headers}
        chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        length = fields.get("content-length")
        known = int(length) if length is not None and length.strip().isdigit() and not chunked else None
        no_body = self._head_only or status in _NO_BODY
        self._until_close = not no_body and not chunked and known is None
        self._got_head = True
        self._keep_alive = self._parser.should_keep_alive()  # read now: the parser forgets it after the body
        assert self._sink is not None
        self._sink.on_head(status, self._reason.decode("latin-1"), self._headers, known)
        if no_body and self._sink is not None:
            self._finish(None)

    def on_body(self, body: bytes) -> None:
        if self._sink is not None and not self._complete:
            self._sink.on_body(body)

    def on_message_complete(self) -> None:
        if self._got_head and not self._complete:
            self._finish(None)
        elif self._complete:
            self._trailing = True

    def _finish(self, error: str | None) -> None:
        self._complete = True
        if error is not None or self._head_only:
            self.close()
        sink = self._sink
        if sink is not None:
            sink.on_end(error)


class UpstreamPool:
    """Connections to one server (``http://`` or ``https://`` URL): idle ones kept for reuse, and
    one made ahead while the server closes them.

    mlx_lm.server closes its connection after every answer, so each request through the door
    needs a new one, and connecting cost the first token more than all the door's other work
    (bench/front_hop.py). So while the server's latest answer ended its connection, a connection
    is made ahead, in the background, for the next request whenever none is ready (as Envoy's
    preconnect does; ``connect_ahead=False`` turns it off for a server that cannot hold an idle
    connection, one that serves a connection at a time). One the server closes while it waits is
    forgotten, and made again only for a request. A server whose answers keep their connections
    gets none: its idle connections are reused. Before an idle connection is used, its socket is
    looked at once more: a close already in the kernel but not yet read by the event loop would
    make the request fail for nothing."""

    def __init__(self, url: str, *, connect_ahead: bool = True) -> None:
        self.url = url
        self.connect_ahead = connect_ahead
        self._idle: list[UpstreamConnection] = []
        self._spare: asyncio.Task | None = None  # the spare being connected
        self._server_closes = False  # the last answer came with the connection's end
        self._closed = False
        self._ssl: ssl.SSLContext | None = None
        parts = urlsplit(url)
        self.secure = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = url_port(url)
        self.prefix = parts.path.rstrip("/")
        self.authority = (f"[{self.host}]" if ":" in self.host else self.host) + f":{self.port}"
        if self.secure:
            self._ssl = ssl.create_default_context()

    async def connect(self) -> UpstreamConnection:
        """An idle connection, or a new one (OSError if the server cannot be reached)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.usable:
                conn.used = True
                self._prepare_spare()
                return conn
            conn.close()
        conn = await self._open()
        conn.used = True
        self._prepare_spare()
        return conn

    def _prepare_spare(self) -> None:
        """For a server that closes its connections: connect one for the next request, in the
        background, unless one is ready or on its way."""
        if (self.connect_ahead and self._server_closes and self._spare is None and not self._closed
                and all(conn.used for conn in self._idle)):
            self._spare = asyncio.get_running_loop().create_task(self._connect_spare())

    async def _connect_spare(self) -> None:
        try:
            conn = await self._open()
        except OSError:  # the server is down or restarting: the next request connects itself
            return
        finally:
            self._spare = None
        if self._closed or not self.connect_ahead or len(self._idle) >= IDLE_KEPT:
            conn.close()
        elif not conn.closed:
            self._idle.insert(0, conn)  # under connections the server kept alive: those are reused first

    async def _open(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        make: Callable[[], UpstreamConnection] = lambda: UpstreamConnection(self)  # noqa: E731
        _, conn = await loop.create_connection(make, self.host, self.port, ssl=self._ssl,
                                               server_hostname=self.host if self.secure else None)
        return conn

    def request_bytes(self, request: Request, headers: list[tuple[str, str]]) -> bytes:
        """The request as the server gets it: the client's method, target and body, the given
        headers, this hop's Host and the body's length."""
        lines = [f"{request.method} {self.prefix}{request.target} HTTP/1.1\r\n", f"Host: {self.authority}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        if request.body or request.method not in ("GET", "HEAD", "DELETE", "OPTIONS", "TRACE"):
            lines.append(f"Content-Length: {len(request.body)}\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1") + request.body

    def release(self, conn: UpstreamConnection) -> None:
        if conn.answered:
            self._server_closes = conn.server_closes
        if conn.reusable and len(self._idle) < IDLE_KEPT and not self._closed:
            conn.resume_reading()
            self._idle.append(conn)
        else:
            conn.close()
        self._prepare_spare()

    def set_connect_ahead(self, on: bool) -> None:
        """Turned off, the connection made ahead, if any, is closed now."""
        self.connect_ahead = on
        for conn in [] if on else [c for c in self._idle if not c.used]:
            self._idle.remove(conn)
            conn.close()

    def forget(self, conn: UpstreamConnection) -> None:
        if conn in self._idle:
            self._idle.remove(conn)

    def close(self) -> None:
        self._closed = True
        if self._spare is not None:
            self._spare.cancel()
            self._spare = None
        for conn in self._idle:
            conn.close()
        self._idle.clear()
