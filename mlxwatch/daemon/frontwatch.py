"""The front door's requests in flight at a verdict, as a bundle keeps them
(``front/requests.json``). What the door delivers is evidence (``mlxwatch.evidence.door``).
"""

from __future__ import annotations

from typing import Any

from mlxwatch.capture.redact import NONE, PUBLIC, redact_text
from mlxwatch.front.delivery import DeliveryView, RequestView


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
