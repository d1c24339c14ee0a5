"""An incremental, bounded Server-Sent Events parser.

httpx hands us raw chunks; a hostile or broken server may send a line that never ends, or
megabytes of it. The parser keeps at most ``max_line`` bytes of an unfinished line and reports
overflow instead of growing, so a probe's memory stays bounded whatever arrives.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SSEEvent:
    """One complete SSE field we care about: a ``data:`` payload or a ``:`` comment."""

    kind: str  # "data" | "comment"
    text: str


class LineTooLong(Exception):
    """A single SSE line exceeded the parser's limit."""


class SSEParser:
    """Feed raw bytes, get back the complete events they finish."""

    def __init__(self, max_line: int = 64 * 1024) -> None:
        self._buffer = bytearray()
        self._max_line = max_line

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buffer += chunk
        events: list[SSEEvent] = []
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(self._buffer[:end]).rstrip(b"\r")
            del self._buffer[: end + 1]
            event = _parse_line(line)
            if event is not None:
                events.append(event)
        if len(self._buffer) > self._max_line:
            self._buffer.clear()
            raise LineTooLong(f"an SSE line exceeded {self._max_line} bytes")
        return events


    def close(self) -> list[SSEEvent]:
        """The stream ended: whatever unterminated line is left is the last event."""
        line = bytes(self._buffer).rstrip(b"\r")
        self._buffer.clear()
        event = _parse_line(line)
        return [event] if event is not None else []


def _parse_line(line: bytes) -> SSEEvent | None:
    if not line:
        return None
    text = line.decode("utf-8", errors="replace")
    if text.startswith(":"):
        return SSEEvent("comment", text[1:].strip())
    field, _, value = text.partition(":")
    if field == "data":
        return SSEEvent("data", value[1:] if value.startswith(" ") else value)
    return SSEEvent("other", text)
