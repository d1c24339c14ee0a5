"""HTTP details of the pass-through: which headers stay on one hop, and the door's own errors.

Every error the door writes is in the OpenAI error shape, so client libraries surface it::

    {"error": {"message": "...", "type": "server_error", "code": "mlxwatch_hung"}}

as a JSON body (503, 413, 431, 502) for a request not yet answered, or as one SSE ``data:``
event for a stream already answered 200 (the openai SDK raises ``APIError`` on it).
"""

from __future__ import annotations

import json
from typing import Iterable

# RFC 9110 7.6.1: meaningful for one connection only; a proxy drops them, and those Connection names.
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
    "te", "trailer", "transfer-encoding", "upgrade",
})

# Error codes, one per way the door ends a request.
HUNG = "mlxwatch_hung"  # the daemon judged the server hung, or restarts it
STALLED = "mlxwatch_request_stalled"  # this request got no token while others did
TRUNCATED = "mlxwatch_upstream_truncated"  # the server ended the answer without finishing it
RESTARTING = "mlxwatch_restarting"  # the server is being restarted: try again later
UNREACHABLE = "mlxwatch_upstream_unreachable"  # the server refused or dropped the connection
STOPPING = "mlxwatch_stopping"  # the door itself is stopping
TOO_LARGE = "mlxwatch_body_too_large"
DOOR_FULL = "mlxwatch_door_full"  # the door holds front.max_buffered of request bodies: try again shortly
HEADERS_TOO_LARGE = "mlxwatch_headers_too_large"
BAD_REQUEST = "mlxwatch_bad_request"
TIMEOUT = "mlxwatch_request_timeout"  # the client did not send its request in time


def end_to_end(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers a proxy forwards: all but hop-by-hop ones and those the Connection header names."""
    pairs = list(headers)
    named = {token.strip().lower() for name, value in pairs if name.lower() == "connection"
             for token in value.split(",") if token.strip()}
    return [(name, value) for name, value in pairs
            if name.lower() not in HOP_BY_HOP and name.lower() not in named]


def error_json(message: str, code: str, type_: str = "server_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "code": code}}).encode()


def sse_error(message: str, code: str, *, at_boundary: bool = True) -> bytes:
    """An SSE event ending a stream loudly; a stream cut inside an event is first ended with a
    blank line, so the error is an event of its own."""
    lead = b"" if at_boundary else b"\n\n"
    return lead + b"data: " + error_json(message, code) + b"\n\n"
