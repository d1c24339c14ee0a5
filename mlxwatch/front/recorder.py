"""The front door's recorder: the exact requests that reached a server lately, and what came back.

A hang is often set off by a sequence of requests (issue 35: two small cache-priming requests
right before one long streamed prompt, with that exact content), and an imitation of its shape
does not bring it back. The door already holds every request body whole while it is in flight;
with ``front.record: true`` it keeps them after, within bounds, so that a bundle can carry the
sequence that led to a verdict and ``mlxwatch replay`` can send it again byte for byte::

    rec = Recorder(max_age=600, max_bytes=256 * 1024**2, monotonic=clock.monotonic, wall=clock.wall)
    rec.arrived("r12", "c3 127.0.0.1:53412", "POST", "/v1/chat/completions", headers, body,
                stream=True, max_tokens=64)                  # at arrival
    rec.ended(view, "ok", status=200, finish_reason="stop", client_gone=False)   # at its end
    rec.requests(ledger_view)                                 # RecordedRequest, arrival order

Bounded like a flight recorder (Java Flight Recorder keeps the last N minutes and bytes): the
oldest request goes once it is older than ``max_age`` or the bytes held pass ``max_bytes``.
Bodies are the door's own bytes objects (no copy), so memory stays at the bound under load.

Credentials never enter it (``Authorization``, cookies, API keys: dropped by name, the names
kept). Bodies and headers are never in a ``repr``, so never in a log line by accident.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Callable

from mlxwatch.front.delivery import DeliveryView, RequestView
from mlxwatch.shim.layout import CREDENTIAL  # one rule for the door and the launch shim's recorder

__all__ = ["CREDENTIAL", "ENTRY_OVERHEAD", "RecordedRequest", "Recorder"]

ENTRY_OVERHEAD = 512  # bytes an entry costs beyond its body, head and target (the objects themselves)


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the door received it, and what came back (None: not known yet)."""

    seq: int  # arrival order, from 1 since the door started
    id: str  # the door's request id (``r12``), as in front/requests.json
    arrived_wall: float
    arrived_mono: float
    connection: str  # the door's connection number and the client's address
    method: str
    target: str  # path and query as sent
    stream: bool
    max_tokens: int | None
    headers: tuple[tuple[str, str], ...] = field(repr=False)  # without credentials
    dropped_headers: tuple[str, ...]  # names of credential headers left out
    body: bytes = field(repr=False)  # exactly as received
    status: int | None = None
    first_token_mono: float | None = None
    last_token_mono: float | None = None
    tokens: int = 0
    finish_reason: str | None = None
    outcome: str | None = None  # the door's outcome (ok, cancelled, failed_loudly...); None: in flight
    client_gone: bool = False
    ended_mono: float | None = None

    @property
    def in_flight(self) -> bool:
        return self.outcome is None


class _Entry:
    """A request as it arrived and what came back, set in place at its end. The frozen
    ``RecordedRequest`` is made only when someone reads the recorder: building one costs 6 µs
    (a frozen dataclass sets each of its 20 fields through ``object.__setattr__``), half of what
    recording a request cost, on the event loop that relays every stream's tokens.

    Few objects the collector counts: each one kept adds to CPython's count of allocations, and
    every 700 start a collection (a pause for every stream). The headers are one flat tuple of
    names and values, the end is set on the entry itself: a request leaves two such objects, not
    nine (measured at 64 streams: gen-0 and gen-1 collections took 3-4 times as long with the
    recorder as without, on the loop that relays every token)."""

    __slots__ = ("seq", "id", "arrived_wall", "arrived_mono", "connection", "method", "target", "stream",
                 "max_tokens", "headers", "dropped", "body", "size", "ended", "status", "first_token_mono",
                 "last_token_mono", "tokens", "finish_reason", "outcome", "client_gone")

    # set at the end, with ``ended``
    status: int | None
    first_token_mono: float | None
    last_token_mono: float | None
    tokens: int
    finish_reason: str | None
    outcome: str
    client_gone: bool

    def __init__(self, seq: int, fid: str, wall: float, mono: float, connection: str, method: str, target: str,
                 stream: bool, max_tokens: int | None, headers: tuple[str, ...], dropped: tuple[str, ...],
                 body: bytes, size: int) -> None:
        self.seq, self.id, self.arrived_wall, self.arrived_mono = seq, fid, wall, mono
        self.connection, self.method, self.target, self.stream, self.max_tokens = (connection, method, target,
                                                                                   stream, max_tokens)
        self.headers, self.dropped, self.body, self.size = headers, dropped, body, size  # headers: name, value, ...
        self.ended: float | None = None  # the end's fields are set with it

    def request(self, view: RequestView | None) -> RecordedRequest:
        """As a ``RecordedRequest``; one still in flight carries what ``view`` (the ledger's) says."""
        flat = self.headers
        arrival = (self.seq, self.id, self.arrived_wall, self.arrived_mono, self.connection, self.method,
                   self.target, self.stream, self.max_tokens, tuple(zip(flat[::2], flat[1::2], strict=True)), self.dropped,
                   self.body)
        if self.ended is not None:
            return RecordedRequest(*arrival, status=self.status, first_token_mono=self.first_token_mono,
                                   last_token_mono=self.last_token_mono, tokens=self.tokens,
                                   finish_reason=self.finish_reason, outcome=self.outcome,
                                   client_gone=self.client_gone, ended_mono=self.ended)
        if view is not None:
            return RecordedRequest(*arrival, first_token_mono=view.first_token_mono,
                                   last_token_mono=view.last_token_mono, tokens=view.tokens)
        return RecordedRequest(*arrival)


class Recorder:
    """The requests of the last ``max_age`` seconds, at most ``max_bytes`` of them; see the module docstring."""

    def __init__(self, max_age: float, max_bytes: int, *, monotonic: Callable[[], float],
                 wall: Callable[[], float]) -> None:
        self.max_age = max_age
        self.max_bytes = max_bytes
        self._monotonic, self._wall = monotonic, wall
        self._entries: collections.deque[_Entry] = collections.deque()
        self._by_id: dict[str, _Entry] = {}
        self._seq = 0
        self._held = 0
        self._credential: dict[str, bool] = {}  # header name -> is a credential (names repeat: one regex each)
        self.dropped = 0  # requests let go before their time: over max_bytes (or one larger than it)

    @property
    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._entries)

    def set_bounds(self, max_age: float, max_bytes: int) -> None:
        self.max_age, self.max_bytes = max_age, max_bytes
        self.trim()

    def arrived(self, fid: str, connection: str, method: str, target: str, headers: list[tuple[str, str]],
                body: bytes, *, stream: bool, max_tokens: int | None) -> bool:
        """Record a request as it arrives; False when it alone is larger than ``max_bytes``."""
        kept: list[str] = []
        dropped: list[str] = []
        size = len(body) + len(target) + ENTRY_OVERHEAD
        for k, v in headers:
            secret = self._credential.get(k)
            if secret is None:
                if len(self._credential) > 1000:  # names a client invents per request: bounded
                    self._credential.clear()
                secret = self._credential[k] = CREDENTIAL.search(k) is not None
            if secret:
                dropped.append(k)
            else:
                kept += (k, v)
                size += len(k) + len(v)
        self._seq += 1
        if size > self.max_bytes:
            self.dropped += 1
            return False
        entry = _Entry(self._seq, fid, self._wall(), self._monotonic(), connection, method, target, stream,
                       max_tokens, tuple(kept), tuple(dropped), body, size)
        self._entries.append(entry)
        self._by_id[fid] = entry
        self._held += size
        self.trim()
        return True

    def ended(self, view: RequestView, outcome: str, *, status: int | None, finish_reason: str | None,
              client_gone: bool) -> None:
        """What came back for a recorded request, at its end (``view``: the ledger's last word on it)."""
        entry = self._by_id.get(view.id)
        if entry is None:
            return
        entry.status, entry.first_token_mono, entry.last_token_mono = status, view.first_token_mono, view.last_token_mono
        entry.tokens, entry.finish_reason, entry.outcome, entry.client_gone = view.tokens, finish_reason, outcome, client_gone
        entry.ended = self._monotonic()
        del self._by_id[view.id]

    def trim(self) -> None:
        """Let go of what is past the bounds, oldest first: by bytes whatever it is, by age only
        once it ended (a request in flight past the age bound may be the one the server hangs
        on: measured, a 2-minute bound left the request a server was still reading out of its
        bundle)."""
        oldest = self._monotonic() - self.max_age
        while self._entries and self._held > self.max_bytes:
            self._let_go(self._entries.popleft(), oldest)
        if self._entries and self._entries[0].arrived_mono < oldest:
            kept: collections.deque[_Entry] = collections.deque()
            for entry in self._entries:
                if entry.arrived_mono < oldest and entry.ended is not None:
                    self._let_go(entry, oldest)
                else:
                    kept.append(entry)
            self._entries = kept

    def _let_go(self, entry: _Entry, oldest: float) -> None:
        self._held -= entry.size
        if entry.arrived_mono >= oldest:
            self.dropped += 1
        if self._by_id.get(entry.id) is entry:
            del self._by_id[entry.id]

    def requests(self, view: DeliveryView | None = None, *, until: float | None = None) -> tuple[RecordedRequest, ...]:
        """Every request held, in arrival order (those arrived by ``until``, monotonic, if
        given); one still in flight carries what ``view`` (the ledger's) says it has had so far."""
        self.trim()
        live = {r.id: r for r in view.in_flight} if view is not None else {}
        out = []
        for entry in self._entries:
            if until is not None and entry.arrived_mono > until:
                break
            out.append(entry.request(live.get(entry.id)))
        return tuple(out)
