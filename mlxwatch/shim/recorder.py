"""The shim's request recorder, inside the server (``mlxwatch launch --record``). Stdlib only.

The front door records what passes through it; a server started under ``mlxwatch launch`` and
reached directly (no door) can record itself. The seam is the server's HTTP handler
(``mlx_lm.server.APIHandler``, a ``BaseHTTPRequestHandler``; the same in mlx-lm 0.31.3 and
0.32): its ``do_*`` methods are wrapped in place (``patch_handler``). For each request the
wrapper, in the request's own thread,

- notes the arrival (the headers were just read): time, the client's address, method, target,
  headers without credentials (``layout.CREDENTIAL``, the door's rule);
- puts a tee on ``rfile`` and ``wfile`` for the call: the body is kept as the server reads it
  (exactly the bytes it gets), and the arrival is written to the spool (``spool``) the moment
  the body is read whole, before the server parses it, so a request the server then hangs on is
  on disk already; what the server writes back is read in passing: the status line, the SSE
  events (tokens, first and last token time, finish reason) or a whole answer's ``usage``;
- writes the end when the method returns: outcome ``ok``, ``cancelled`` (the client went away:
  a write raised BrokenPipeError, ConnectionResetError, ConnectionAbortedError) or ``failed``
  (the handler raised something else), then gives ``rfile`` and ``wfile`` back.

The tees hand the server's own objects and return values through unchanged, and re-raise what
the server's calls raise; the answers are byte-identical. Anything of the recorder's own that
fails (a full disk, a bug) is caught, counted, said once in the server's log, and recording
stops; the server goes on. Memory stays flat: a body is held only until it is written, an
answer is read for its ``usage`` only up to ``MAX_ANSWER`` bytes, an SSE line up to
``MAX_LINE``.
"""

from __future__ import annotations

import functools
import itertools
import json
import threading
import time
from typing import Any, Callable

from . import layout
from .spool import SpoolWriter, encode_arrival, encode_end

MAX_LINE = 1024 * 1024  # one SSE line held across writes; beyond it the line is not read
MAX_ANSWER = 1024 * 1024  # a non-streaming answer read for its usage and finish_reason
MAX_LIVE_SHOWN = 100  # requests in flight published in the heartbeat
GONE = (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)
_MARK = "__mlxwatch_shim_record__"


class Flight:
    """One request while its handler runs."""

    __slots__ = ("id", "seq", "wall", "mono", "conn", "method", "target", "headers", "dropped", "expect",
                 "chunks", "got", "written", "skip", "status", "sse", "line", "answer", "first", "last",
                 "tokens", "finish", "gone", "raw_in", "raw_out")

    def __init__(self, seq: int, wall: float, mono: float, conn: str, method: str, target: str,
                 headers: list[list[str]], dropped: list[str], expect: int | None) -> None:
        self.id, self.seq, self.wall, self.mono = f"s{seq}", seq, wall, mono
        self.conn, self.method, self.target = conn, method, target
        self.headers, self.dropped, self.expect = headers, dropped, expect
        self.chunks: list[bytes] | None = []
        self.got = 0
        self.written = False  # the arrival is in the spool (or let go: ``skip``)
        self.skip = False  # not recorded (larger than max_bytes): its end is not written either
        self.status: int | None = None
        self.sse = False
        self.line = b""  # an SSE line begun in one write and ended in a later one
        self.answer: bytearray | None = None  # a non-streaming answer, up to MAX_ANSWER
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.finish: str | None = None
        self.gone = False
        self.raw_in: Any = None
        self.raw_out: Any = None


class RequestRecorder:
    """Records the requests the server's handler receives into a ``SpoolWriter``; see the module."""

    def __init__(self, spool: SpoolWriter, say: Callable[[str], None]) -> None:
        self.spool = spool
        self.max_age, self.max_bytes = spool.max_age, spool.max_bytes
        self.say = say
        self.on = True
        self.state = "waiting"  # waiting (no handler patched yet) | on | failed
        self.detail = "the server's HTTP handler is not loaded yet"
        self.where: list[str] = []
        self.recorded = 0  # arrivals written
        self.dropped = 0  # requests not kept: larger than max_bytes alone
        self.errors = 0  # failures of the recorder's own (the first one stops it)
        self.live: dict[str, Flight] = {}
        self._seq = itertools.count(1)
        self.guard = threading.local()  # a do_* that calls another (a subclass's super()) is one request

    # --- failure: caught, counted, recording stops

    def failed(self, exc: BaseException) -> None:
        self.errors += 1
        if self.on:
            self.on = False
            self.state, self.detail = "failed", f"{type(exc).__name__}: {exc}"
            self.say(f"recording requests failed ({self.detail}); recording stopped, the server runs on")
            try:
                self.spool.close()
            except Exception:
                pass

    # --- the handler's side (its own thread)

    def begin(self, handler: Any) -> Flight | None:
        """A request arrived (its headers read): note it and put the tees on. None: not recorded."""
        if not self.on:
            return None
        flight = None
        try:
            kept: list[list[str]] = []
            dropped: list[str] = []
            for k, v in handler.headers.items():
                (dropped.append(k) if layout.CREDENTIAL.search(k) else kept.append([k, v]))
            length = handler.headers.get("Content-Length")
            try:
                expect: int | None = int(length) if length is not None else None
            except ValueError:
                expect = None
            addr = handler.client_address
            conn = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
            flight = Flight(next(self._seq), time.time(), time.monotonic(), conn, str(handler.command),
                            str(handler.path), kept, dropped, expect)
            flight.raw_in, flight.raw_out = handler.rfile, handler.wfile
            handler.rfile = _TeeIn(flight.raw_in, self, flight)
            handler.wfile = _TeeOut(flight.raw_out, self, flight)
            self.live[flight.id] = flight
            if not expect or expect < 0:  # no body to wait for (a GET): on disk now
                self.arrived(flight)
            return flight
        except Exception as exc:
            if flight is not None:
                self._give_back(handler, flight)
                self.live.pop(flight.id, None)
            self.failed(exc)
            return None

    def took(self, flight: Flight, data: bytes) -> None:
        """The server read ``data`` of the body."""
        if flight.written or not self.on:
            return
        flight.got += len(data)
        if flight.chunks is not None:
            if flight.got > self.max_bytes:
                flight.chunks = None  # larger than the bound: let go (the door's rule)
            else:
                flight.chunks.append(bytes(data))
        if flight.expect is not None and flight.got >= flight.expect:
            self.arrived(flight)

    def arrived(self, flight: Flight) -> None:
        """The arrival to the spool: once, when the body is read whole (or the answer begins)."""
        if flight.written:
            return
        flight.written = True
        chunks, flight.chunks = flight.chunks, None
        if chunks is None:
            flight.skip = True
            self.dropped += 1
            return
        body = b"".join(chunks)
        header = {"id": flight.id, "seq": flight.seq, "wall": flight.wall, "mono": flight.mono, "conn": flight.conn,
                  "method": flight.method, "target": flight.target, "headers": flight.headers,
                  "dropped": flight.dropped, "content_length": flight.expect}
        parts = encode_arrival(header, body)
        if sum(len(p) for p in parts) > self.max_bytes:
            flight.skip = True
            self.dropped += 1
            return
        self.spool.append(parts, flight.mono, opens=flight.id)
        self.recorded += 1

    def wrote(self, flight: Flight, data: Any) -> None:
        """The server wrote ``data`` to the client (it went)."""
        if not self.on:
            return
        if not flight.written:
            self.arrived(flight)
        if flight.status is None:
            head = bytes(data[:8192])
            if head.startswith(b"HTTP/"):
                try:
                    flight.status = int(head[9:12])
                except ValueError:
                    flight.status = 0
                flight.sse = b"text/event-stream" in head.lower()
            return  # what comes before the status line is not the answer
        if flight.sse:
            self._events(flight, bytes(data))
        elif flight.answer is None or len(flight.answer) <= MAX_ANSWER:
            if flight.answer is None:
                flight.answer = bytearray()
            flight.answer += bytes(data[:MAX_ANSWER + 1 - len(flight.answer)])
            flight.last = time.monotonic()

    def _events(self, flight: Flight, data: bytes) -> None:
        lines = (flight.line + data).split(b"\n") if flight.line else data.split(b"\n")
        rest = lines.pop()
        flight.line = rest if len(rest) <= MAX_LINE else b""
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            if _plain_token(payload):  # mlx-lm's usual event: not parsed (a token's cost in the server)
                token = True
            else:
                try:
                    token = _token_event(json.loads(payload), flight)
                except ValueError:
                    continue
            if token:
                now = time.monotonic()
                flight.tokens += 1
                flight.last = now
                if flight.first is None:
                    flight.first = now

    def write_failed(self, flight: Flight, exc: BaseException) -> None:
        if isinstance(exc, GONE):
            flight.gone = True

    def end(self, handler: Any, flight: Flight, exc: BaseException | None) -> None:
        """The handler's method returned (or raised ``exc``): tees off, the end to the spool."""
        self._give_back(handler, flight)
        self.live.pop(flight.id, None)
        if not self.on:
            return
        try:
            if not flight.written:
                self.arrived(flight)
            if flight.skip:
                return
            gone = flight.gone or isinstance(exc, GONE)
            if not flight.sse and flight.answer is not None:
                _read_answer(flight)
            outcome = "cancelled" if gone else "ok" if exc is None else "failed"
            self.spool.append(encode_end({"id": flight.id, "status": flight.status, "first": flight.first,
                                          "last": flight.last, "tokens": flight.tokens, "finish": flight.finish,
                                          "outcome": outcome, "gone": gone, "ended": time.monotonic()}),
                              time.monotonic(), ends=flight.id)
        except Exception as err:
            self.failed(err)

    @staticmethod
    def _give_back(handler: Any, flight: Flight) -> None:
        if isinstance(handler.__dict__.get("rfile"), _TeeIn):
            handler.rfile = flight.raw_in
        if isinstance(handler.__dict__.get("wfile"), _TeeOut):
            handler.wfile = flight.raw_out

    # --- the publisher's side

    def expire(self) -> None:
        if self.on:
            try:
                self.spool.expire(time.monotonic())
            except Exception as exc:
                self.failed(exc)

    def snapshot(self) -> dict[str, Any]:
        """The heartbeat's ``record``: on or not, the bounds, counts, and the requests in flight
        with what they have had so far (the spool has their arrival, not yet their end)."""
        live = []
        for f in sorted(list(self.live.values()), key=lambda f: f.seq)[:MAX_LIVE_SHOWN]:
            live.append({"id": f.id, "status": f.status, "first": f.first, "last": f.last, "tokens": f.tokens})
        return {"state": self.state, "detail": self.detail, "where": list(self.where), "max_age": self.max_age,
                "max_bytes": self.max_bytes, "recorded": self.recorded, "dropped": self.dropped,
                "errors": self.errors, "held_bytes": self.spool.held_bytes, "in_flight": live}


def _plain_token(payload: bytes) -> bool:
    """An event as mlx-lm writes one per token (``json.dumps``' spacing): no finish_reason, one
    choice, a non-empty ``content``. Anything else is parsed (``_token_event``)."""
    return (payload.count(b'"finish_reason": null') == 1 and b'"content": "' in payload
            and b'"content": ""' not in payload and b'"error"' not in payload)


def _token_event(event: Any, flight: Flight) -> bool:
    """An SSE event that delivers a token, by the front door's rule (``front.tokens``): a
    non-empty delta or text, or a finish_reason."""
    if not isinstance(event, dict) or not isinstance(event.get("choices"), list):
        return False
    token = False
    for choice in event["choices"]:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason"):
            flight.finish = str(choice["finish_reason"])
            token = True
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and any(v for k, v in delta.items() if k != "role")):
            token = True
    return token


def _read_answer(flight: Flight) -> None:
    """A whole answer's tokens (``usage.completion_tokens``, else 1) and finish_reason, as the door reads them."""
    answer = flight.answer
    if answer is None or len(answer) > MAX_ANSWER:
        return
    try:
        data = json.loads(bytes(answer))
    except ValueError:
        return
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list):
        return
    usage = data.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    flight.tokens = tokens if isinstance(tokens, int) and tokens >= 0 else 1
    flight.first = flight.last
    if choices and isinstance(choices[0], dict) and choices[0].get("finish_reason"):
        flight.finish = str(choices[0]["finish_reason"])


class _TeeIn:
    """The handler's ``rfile`` for one request: reads go through; what they return is recorded."""

    __slots__ = ("_raw", "_rec", "_flight")

    def __init__(self, raw: Any, rec: RequestRecorder, flight: Flight) -> None:
        self._raw, self._rec, self._flight = raw, rec, flight

    def _took(self, data: Any) -> None:
        if data and self._rec.on:
            try:
                self._rec.took(self._flight, data)
            except Exception as exc:
                self._rec.failed(exc)

    def read(self, *args: Any, **kwargs: Any) -> Any:
        data = self._raw.read(*args, **kwargs)
        self._took(data)
        return data

    def read1(self, *args: Any, **kwargs: Any) -> Any:
        data = self._raw.read1(*args, **kwargs)
        self._took(data)
        return data

    def readline(self, *args: Any, **kwargs: Any) -> Any:
        data = self._raw.readline(*args, **kwargs)
        self._took(data)
        return data

    def readinto(self, buffer: Any) -> Any:
        n = self._raw.readinto(buffer)
        if n:
            self._took(bytes(memoryview(buffer)[:n]))
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)

    def __iter__(self) -> Any:
        return iter(self._raw)


class _TeeOut:
    """The handler's ``wfile`` for one request: writes go through; what went is read in passing."""

    __slots__ = ("_raw", "_rec", "_flight")

    def __init__(self, raw: Any, rec: RequestRecorder, flight: Flight) -> None:
        self._raw, self._rec, self._flight = raw, rec, flight

    def write(self, data: Any) -> Any:
        try:
            n = self._raw.write(data)
        except BaseException as exc:
            try:
                self._rec.write_failed(self._flight, exc)
            except Exception as err:
                self._rec.failed(err)
            raise
        if self._rec.on:
            try:
                self._rec.wrote(self._flight, data)
            except Exception as exc:
                self._rec.failed(exc)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _wrap_do(rec: RequestRecorder, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def do(self: Any, *args: Any, **kwargs: Any) -> Any:
        flight = rec.begin(self) if rec.on and not getattr(rec.guard, "inside", False) else None
        if flight is None:
            return original(self, *args, **kwargs)
        rec.guard.inside = True
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            rec.guard.inside = False
            rec.end(self, flight, exc)
            raise
        rec.guard.inside = False
        rec.end(self, flight, None)
        return result

    setattr(do, _MARK, True)
    return do


def patch_handler(rec: RequestRecorder, cls: Any, where: str) -> bool:
    """Wrap every ``do_*`` method of ``cls`` (a ``BaseHTTPRequestHandler``), in place; False
    when it is not one."""
    import http.server

    if not (isinstance(cls, type) and issubclass(cls, http.server.BaseHTTPRequestHandler)):
        return False
    names = [n for n in dir(cls) if n.startswith("do_") and callable(getattr(cls, n, None))]
    for name in names:
        current = getattr(cls, name)
        if not getattr(current, _MARK, False):
            setattr(cls, name, _wrap_do(rec, current))
    if where not in rec.where:
        rec.where.append(where)
    if rec.state == "waiting":
        rec.state, rec.detail = "on", ""
    return bool(names)
