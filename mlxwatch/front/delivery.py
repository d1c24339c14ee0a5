"""Delivery as the front door sees it, per request: the data, and the ledger that keeps it.

The door opens a flight when a request arrives, adds tokens and bytes as they reach the client,
and closes it with an outcome. Readers (the daemon's verdict, metrics, status) take snapshots::

    ledger = Ledger(clock.monotonic)
    fid = ledger.open("POST", "/v1/chat/completions", stream=True, max_tokens=64, prompt_bytes=812)
    ledger.delivered(fid, tokens=1, nbytes=97)
    ledger.close(fid, OK)
    view = ledger.view()             # DeliveryView: frozen, cheap, no I/O
    ledger.stalled(60.0)             # flights with no token for 60 s while others got tokens

Only generation requests (POST .../completions) are expected to deliver tokens; other requests
are in flight too (a hung server does not answer /v1/models either), but never "stalled".
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

# Outcomes, as counted in DeliveryView.outcomes.
OK = "ok"  # answered whole (a stream with [DONE]/finish_reason, or any complete response)
CANCELLED = "cancelled"  # the client went away first
FAILED_LOUDLY = "failed_loudly"  # ended with an explicit error from the door
REFUSED_RESTARTING = "refused_restarting"  # 503 + Retry-After while the gate was not open
REPLAYED = "replayed"  # sent again to the recovered server (counted once per replay)
REJECTED = "rejected"  # refused before forwarding: over a limit (size, connections), or malformed
TIMEOUT = "timeout"  # the client did not send its whole request in time (cut off, or 408)
OUTCOMES = (OK, CANCELLED, FAILED_LOUDLY, REFUSED_RESTARTING, REPLAYED, REJECTED, TIMEOUT)

OBSERVATIONS_KEPT = 4096  # first-token latencies and rates kept until a reader takes them


@dataclass(frozen=True)
class RequestView:
    """One request in flight, as of the snapshot."""

    id: str
    method: str
    path: str
    started_mono: float
    stream: bool
    max_tokens: int | None
    prompt_bytes: int
    first_token_mono: float | None
    last_token_mono: float | None
    tokens: int
    bytes_out: int
    generation: bool = True  # a completion request: tokens are expected from it
    # The request body (held anyway while in flight, at most front.max_body): for a bundle only
    # with capture.requests: bodies. Never in repr, so never in a log line by accident.
    body: bytes = field(default=b"", repr=False, compare=False)


@dataclass(frozen=True)
class DeliveryView:
    """What the door has delivered: requests in flight and totals since it started."""

    in_flight: tuple[RequestView, ...]
    last_token_mono: float | None  # the latest token to anyone
    tokens_total: int
    outcomes: Mapping[str, int]
    # Requests whose client is not taking the bytes the door has for it (the door's writes to it
    # paused, so it stopped reading the server for it): no token to them is the client's doing.
    held_by_clients: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Observations:
    """Per finished request, for metrics histograms; taken (and cleared) by one reader."""

    first_token_latency: tuple[float, ...]  # seconds from request to its first token
    tokens_per_second: tuple[float, ...]  # a stream's rate between its first and last token


@dataclass
class _Flight:
    view: RequestView
    first_token_mono: float | None = None
    last_token_mono: float | None = None
    tokens: int = 0
    bytes_out: int = 0

    def snapshot(self) -> RequestView:
        v = self.view
        return RequestView(v.id, v.method, v.path, v.started_mono, v.stream, v.max_tokens, v.prompt_bytes,
                           self.first_token_mono, self.last_token_mono, self.tokens, self.bytes_out, v.generation,
                           v.body)


@dataclass
class Ledger:
    """The one owner of delivery state: plain data, no I/O, no locks (one event loop uses it)."""

    monotonic: Callable[[], float]
    _flights: dict[str, _Flight] = field(default_factory=dict)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    _last_token_mono: float | None = None
    _tokens_total: int = 0
    _outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    _latencies: deque = field(default_factory=lambda: deque(maxlen=OBSERVATIONS_KEPT))
    _rates: deque = field(default_factory=lambda: deque(maxlen=OBSERVATIONS_KEPT))
    on_close: Callable[[RequestView, str], None] | None = None  # told each flight's last view and outcome

    def open(self, method: str, path: str, *, stream: bool, max_tokens: int | None, prompt_bytes: int,
             generation: bool = True, body: bytes = b"") -> str:
        fid = f"r{next(self._ids)}"
        self._flights[fid] = _Flight(RequestView(fid, method, path, self.monotonic(), stream, max_tokens,
                                                 prompt_bytes, None, None, 0, 0, generation, body))
        return fid

    def delivered(self, fid: str, *, tokens: int = 0, nbytes: int = 0) -> None:
        flight = self._flights.get(fid)
        if flight is None:
            return
        flight.bytes_out += nbytes
        if tokens > 0:
            now = self.monotonic()
            if flight.first_token_mono is None:
                flight.first_token_mono = now
            flight.last_token_mono = now
            flight.tokens += tokens
            self._tokens_total += tokens
            self._last_token_mono = now

    def restart(self, fid: str) -> None:
        """The flight is sent again (a replay): its clock starts over, nothing was delivered."""
        flight = self._flights.get(fid)
        if flight is not None:
            v = flight.view
            flight.view = RequestView(v.id, v.method, v.path, self.monotonic(), v.stream, v.max_tokens,
                                      v.prompt_bytes, None, None, 0, 0, v.generation, v.body)
        self.count(REPLAYED)

    def close(self, fid: str, outcome: str) -> None:
        flight = self._flights.pop(fid, None)
        self.count(outcome)
        if flight is not None and self.on_close is not None:
            self.on_close(flight.snapshot(), outcome)
        if flight is None or flight.first_token_mono is None:
            return
        self._latencies.append(flight.first_token_mono - flight.view.started_mono)
        if flight.tokens >= 2 and flight.last_token_mono is not None and flight.last_token_mono > flight.first_token_mono:
            self._rates.append((flight.tokens - 1) / (flight.last_token_mono - flight.first_token_mono))

    def count(self, outcome: str) -> None:
        self._outcomes[outcome] = self._outcomes.get(outcome, 0) + 1

    def get(self, fid: str) -> RequestView | None:
        flight = self._flights.get(fid)
        return flight.snapshot() if flight is not None else None

    def view(self) -> DeliveryView:
        return DeliveryView(tuple(f.snapshot() for f in self._flights.values()), self._last_token_mono,
                            self._tokens_total, dict(self._outcomes))

    def stalled(self, timeout: float) -> list[RequestView]:
        """Generation flights with no token for ``timeout`` while another flight got one within it.

        "No token" counts from the flight's latest token, or its start if it has none; "others
        flow" means the latest token to anyone (requests since finished count) came after that
        and within ``timeout``. When nobody gets tokens the server as a whole is the suspect
        (the daemon's stall_timeout), not one request."""
        now = self.monotonic()
        latest = self._last_token_mono
        if latest is None or now - latest >= timeout:
            return []
        out = []
        for flight in self._flights.values():
            if not flight.view.generation:
                continue
            quiet_since = flight.last_token_mono if flight.last_token_mono is not None else flight.view.started_mono
            if now - quiet_since >= timeout and latest > quiet_since:
                out.append(flight.snapshot())
        return out

    def take_observations(self) -> Observations:
        taken = Observations(tuple(self._latencies), tuple(self._rates))
        self._latencies.clear()
        self._rates.clear()
        return taken
