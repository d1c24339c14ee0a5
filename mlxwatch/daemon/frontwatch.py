"""The daemon's reading of the front door's delivery view: signals for the existing policy.

The front door (``mlxwatch.front``) sees every token every client receives. The watcher reads
its ``DeliveryView`` (a cheap snapshot, no I/O) and turns it into what ``policy.Detection``
already understands, exactly as it does the launch shim's heartbeat (``mlxwatch.shim.watch``):

- **delivered** (the server works: ``slow``, never a verdict): tokens the door delivered to
  clients since the previous reading. Passed to ``Detection.failure`` with the shim's
  "tokens to other clients", so a busy or slow server is never restarted;
- **stall** (suspect at once, probe now; the probe that confirms it is decisive): requests in
  flight and no token delivered to anyone for ``front.stall_timeout``. One stall episode (the
  same quiet start) triggers one early probe.

Readings are taken when a probe starts and when it ends, so "since the previous reading" is the
probe's own wait: tokens delivered to others while the probe got none prove the server works
(busy, slow); tokens delivered before the probe started, say before a livelock began, do not
excuse it. Once clients' requests have had no token for half ``front.stall_timeout``, the probe's
first-token deadline is at most ``front.stall_timeout`` (the door watches delivery meanwhile).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlxwatch.capture.redact import NONE, PUBLIC, redact_text
from mlxwatch.front.delivery import DeliveryView, RequestView


@dataclass
class FrontStall:
    reason: str  # one line: why the instance is suspect now
    key: float  # the quiet's start (monotonic): one early probe per episode


@dataclass
class FrontWatch:
    stall_timeout: float
    tokens_seen: int | None = None  # the view's tokens_total at the last reading
    triggered: set[float] = field(default_factory=set)  # stall episodes that had their early probe

    def delivered(self, view: DeliveryView, seconds: float | None = None) -> list[str]:
        """Tokens delivered to clients since the last reading (one line, or none); takes a new
        reading. The first reading only sets the baseline."""
        seen, self.tokens_seen = self.tokens_seen, view.tokens_total
        if seen is None or view.tokens_total <= seen:
            return []
        since = f" in the last {seconds:.0f}s" if seconds is not None else ""
        return [f"front door: {view.tokens_total - seen} token(s) delivered to clients{since}"]

    def stall(self, view: DeliveryView, now: float) -> FrontStall | None:
        """Requests in flight and no token delivered to anyone for ``stall_timeout``, or None."""
        quiet_since = quiet_start(view)
        if quiet_since is None or now - quiet_since < self.stall_timeout:
            return None
        return FrontStall(f"front door: {sum(r.generation for r in view.in_flight)} request(s) in flight"
                          " and no token delivered to anyone "
                          f"for {now - quiet_since:.0f}s (front.stall_timeout {self.stall_timeout:g}s)", quiet_since)

    def first_time(self, stall: FrontStall | None) -> bool:
        """True once per stall episode: whether this stall should wake the watcher."""
        if stall is None or stall.key in self.triggered:
            return False
        self.triggered.add(stall.key)
        if len(self.triggered) > 100:
            self.triggered = {stall.key}
        return True


def quiet_start(view: DeliveryView) -> float | None:
    """Since when generation requests have been in flight with no token delivered to anyone
    (monotonic), or None with none in flight: the later of the last token and the oldest
    request's start."""
    waiting = [r.started_mono for r in view.in_flight if r.generation]  # /v1/models is no token source
    if not waiting:
        return None
    oldest = min(waiting)
    return oldest if view.last_token_mono is None else max(oldest, view.last_token_mono)


def requests_evidence(view: DeliveryView, now: float, bodies: bool = False, redact: bool = True) -> list[dict[str, Any]]:
    """The requests in flight as a bundle's ``front/requests.json`` holds them: ages and sizes,
    never a prompt, unless ``bodies`` (``capture.requests: bodies``): then each body as text too,
    at the export's redaction level (``redact``: ``capture.redact``; prompts are private, and a
    key pasted into one is still a key)."""
    return [_request(r, now, bodies, PUBLIC if redact else NONE) for r in view.in_flight]


def _request(r: RequestView, now: float, bodies: bool, level: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": r.id, "method": r.method, "path": r.path, "age_s": round(now - r.started_mono, 3),
        "stream": r.stream, "max_tokens": r.max_tokens, "prompt_bytes": r.prompt_bytes, "tokens": r.tokens,
        "bytes_out": r.bytes_out,
        "first_token_after_s": None if r.first_token_mono is None else round(r.first_token_mono - r.started_mono, 3),
        "since_last_token_s": None if r.last_token_mono is None else round(now - r.last_token_mono, 3),
    }
    if bodies:
        out["body"] = redact_text(r.body.decode("utf-8", errors="replace"), level)
    return out
