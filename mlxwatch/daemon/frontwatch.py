"""What a watcher's verdicts mean for the front door's clients (``instances[].front``), and the
door's requests in flight at a verdict as a bundle keeps them (``front/requests.json``). What the
door delivers is evidence (``mlxwatch.evidence.door``); without a door every duty is a no-op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from mlxwatch.capture.redact import NONE, PUBLIC, redact_text
from mlxwatch.config import CaptureConfig, FrontConfig
from mlxwatch.front.delivery import DeliveryView, RequestView
from mlxwatch.front.door import FrontDoor, Gate
from mlxwatch.journal.incidents import Event, Journal

log = logging.getLogger("mlxwatch.watchdog")


@dataclass
class FrontWatch:
    """One instance's door, told by its watcher what the watcher decided."""

    name: str  # the instance's
    door: Callable[[], FrontDoor | None]  # its door while it has one (the daemon starts and swaps it)
    front: Callable[[], FrontConfig | None]
    journal: Journal
    clock: Callable[[], float]  # monotonic

    def failed_alone(self) -> None:
        """Requests the door failed alone (no token for request_stall_timeout while others got
        theirs) are said and journaled."""
        door, front = self.door(), self.front()
        if door is None or front is None:
            return
        for req in door.take_stalled_requests():
            log.warning("%s: front door: request %s (%s %s) got no token for %gs while others did; it failed loudly",
                        self.name, req.id, req.method, req.path, front.request_stall_timeout)
            self.journal.note(Event.FRONT_REQUEST_STALLED, instance=self.name, request=req.id, path=req.path,
                              tokens=req.tokens, timeout=front.request_stall_timeout)

    def at_verdict(self, capture: CaptureConfig, restarting: bool) -> list[dict] | None:
        """The verdict, for the door's clients: the requests in flight are kept as evidence, then
        each ends with an explicit error (never an empty success); when a restart follows
        (``restarting``), new requests get 503 + Retry-After (or are held up to ``front.hold``)
        until it is verified."""
        door = self.door()
        if door is None:
            return None
        evidence = requests_evidence(door.view(), self.clock(), bodies=capture.requests == "bodies",
                                     redact=capture.redact)
        failed = door.fail_in_flight("the server is hung (mlxwatch verdict); retry later")
        if failed:  # no line about no request: most verdicts come with nobody waiting
            log.warning("%s: front door: %d request(s) in flight failed loudly", self.name, failed)
        if restarting:
            self.restarting("a restart follows the verdict")
        return evidence

    def restarting(self, why: str) -> None:
        """New requests get 503 + Retry-After (or are held up to ``front.hold``) until ``open``."""
        self._gate(Gate.RESTARTING, why)

    def open(self, why: str) -> None:
        """Requests reach the server again (the incident ended, or restarts were given up)."""
        self._gate(Gate.OPEN, why)

    def _gate(self, gate: Gate, why: str) -> None:
        door = self.door()
        if door is not None:
            log.info("%s: front door: %s (%s)", self.name, getattr(gate, "value", gate), why)
            door.set_gate(gate)


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
