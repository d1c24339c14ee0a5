"""What a response delivers, read from the bytes the door forwards: tokens, and whether it ended.

The door forwards every byte as it arrives and hands the same bytes to a reader here, which
never changes them and never holds more than one unfinished SSE line (``max_line``)::

    reader = StreamReader()
    for chunk in upstream:
        tokens = reader.feed(chunk)        # tokens this chunk completed
    reader.ended                            # saw [DONE] or a finish_reason
    reader.at_boundary                      # the client's stream is between two events

"A token" is one ``data:`` event with a non-empty ``choices[].delta`` field (content, reasoning,
tool calls), ``choices[].text`` or a ``finish_reason``; a complete non-streaming body counts its
``usage.completion_tokens`` (else 1). An event holding an ``error`` key is the server's own loud
failure: the stream ended, and loudly.
"""

from __future__ import annotations

import json
from typing import Any

MAX_LINE = 1024 * 1024  # one SSE line; beyond it the reader stops counting (bytes still flow)
MAX_BODY_READ = 1024 * 1024  # a non-streaming body parsed for its usage; larger ones count 1


class StreamReader:
    """Counts tokens in an SSE stream, incrementally, with bounded memory."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._line = bytearray()
        self._max_line = max_line
        self._overflow = False
        self.ended = False  # [DONE] or a finish_reason seen
        self.errored = False  # the server sent an error event itself
        self.finish_reason: str | None = None  # the stream's finish_reason, once seen
        self.at_boundary = True  # the bytes so far end between events (after a blank line)
        self._after_cr = False  # the last chunk ended with CR: an LF starting the next one is its CRLF's

    def feed(self, chunk: bytes) -> int:
        tokens = 0
        if self._after_cr or b"\r" in chunk:  # SSE ends lines with CRLF, LF or CR alone (mlx-lm: LF)
            chunk = self._lf_only(chunk)
        lines = chunk.split(b"\n")
        tail = lines.pop()  # after the last newline: the start of a line still to come
        for part in lines:
            if self._line or self._overflow:  # the end of a line begun in an earlier chunk
                self._take(part)
                part, overflow = bytes(self._line), self._overflow
                self._line.clear()
                self._overflow = False
            else:  # the usual case: a whole line in this chunk, judged in place
                overflow = len(part) > self._max_line
            tokens += self._line_done(part, overflow)
        if tail:
            self._take(tail)
            self.at_boundary = False
        return tokens

    def _lf_only(self, chunk: bytes) -> bytes:
        """The chunk's line ends as LF alone (a copy, for judging; the bytes forwarded are the
        server's). A CRLF split between two chunks is one line end: its CR ended the line."""
        if self._after_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]
        self._after_cr = chunk.endswith(b"\r")
        return chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")

    def _take(self, part: bytes) -> None:
        if self._overflow:
            return
        if len(self._line) + len(part) > self._max_line:
            self._overflow = True  # a line this long is not a token event we can judge; skip it
            self._line.clear()
            return
        self._line += part

    def _line_done(self, line: bytes, overflow: bool) -> int:
        if overflow:  # part of an event, too long to judge: never a boundary
            self.at_boundary = False
            return 0
        if not line:
            self.at_boundary = True
            return 0
        self.at_boundary = False
        if not line.startswith(b"data:"):
            return 0
        return self._event(line[5:].strip())

    def _event(self, payload: bytes) -> int:
        if payload == b"[DONE]":
            self.ended = True
            return 0
        try:
            data = json.loads(payload)
        except ValueError:
            return 0
        if not isinstance(data, dict):
            return 0
        if data.get("error"):
            self.errored = True
            return 0
        choices = data.get("choices")
        if not isinstance(choices, list):
            return 0
        token = False
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.ended = True
                self.finish_reason = str(choice["finish_reason"])
                token = True
            if choice.get("text") or _delta_has_token(choice.get("delta")):
                token = True
        return 1 if token else 0


def _delta_has_token(delta: Any) -> bool:
    if not isinstance(delta, dict):
        return False
    return any(value for key, value in delta.items() if key != "role")


def finish_reason(body: bytes) -> str | None:
    """A complete non-streaming answer's first ``finish_reason``, if it has one."""
    try:
        data = json.loads(body) if len(body) <= MAX_BODY_READ else None
    except ValueError:
        return None
    choices = data.get("choices") if isinstance(data, dict) else None
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    reason = first.get("finish_reason")
    return str(reason) if reason else None


def body_tokens(body: bytes) -> int:
    """Tokens in a complete non-streaming answer: its ``usage.completion_tokens``, else 1."""
    if len(body) <= MAX_BODY_READ:
        try:
            data = json.loads(body)
        except ValueError:
            return 1
        usage = data.get("usage") if isinstance(data, dict) else None
        count = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return count
    return 1
