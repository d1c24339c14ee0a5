"""The launch shim's recorded requests on disk: a bounded spool of segment files. Stdlib only.

Written in the server by the shim's recorder (``recorder``, ``launch --record``), read by
``mlxwatch capture`` (``read``). On disk, not in the server's memory: a server that holds a large
model should not hold 256 MiB of its users' words as well, and a file written as each request
arrives is still there when the server is hung with the GIL held (the dump thread cannot answer
then) or stopped. Per server process, in the private runtime dir (``layout``), files 0600::

    <pid>.requests.<n>   segments, n counting up from 1 (never renamed: a reader that lists
                         them cannot see one twice)

A segment is a sequence of records, each appended whole in one ``writev``::

    {"k": "a", ...header..., "body_bytes": N}\\n  N bytes of body  \\n     a request's arrival
    {"k": "e", ...}\\n                                                   its end: what came back

Bounds, as the front door's recorder: a new segment is begun when the current one would pass
``max_bytes / SEGMENTS``; the oldest are removed while there are more than ``SEGMENTS`` or they
hold more than ``max_bytes`` together, and once their newest record is older than ``max_age``.
The reader applies both bounds again at the moment it reads (and ``until``: the start of a
capture, so a capture's own probe is not in it). A record a full disk cut short ends its segment
for the reader; the writer stops at its first error (the recorder then records nothing more).
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
from collections import deque
from typing import Any

from . import layout

SEGMENTS = 4
MAX_HEADER = 1024 * 1024  # a header line longer than this is not ours: the segment is read no further
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class _Segment:
    __slots__ = ("n", "path", "size", "newest", "ino", "open_ids")

    def __init__(self, n: int, path: str, ino: int) -> None:
        self.n, self.path, self.ino = n, path, ino
        self.size = 0
        self.newest = 0.0  # monotonic time of its newest record
        self.open_ids: set[str] = set()  # requests whose arrival it holds and that have not ended


class SpoolWriter:
    """Appends records to ``<pid>.requests.<n>`` within the bounds; thread-safe (the server's
    request threads write, the shim's publisher expires). Raises OSError; the caller stops."""

    def __init__(self, directory: str, pid: int, max_age: float, max_bytes: int) -> None:
        self.directory, self.pid = directory, pid
        self.max_age, self.max_bytes = max_age, max_bytes
        self.lock = threading.Lock()
        self.segments: deque[_Segment] = deque()
        self.fd = -1
        self.next_n = 1
        self.arrived_in: dict[str, _Segment] = {}  # a request in flight: the segment holding its arrival

    @property
    def held_bytes(self) -> int:
        return sum(s.size for s in list(self.segments))

    def remove_stale(self) -> None:
        """Segments a process of the same PID left (before this one): not ours to read on."""
        pattern = re.compile(rf"^{self.pid}\.requests\.\d+$")
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if pattern.match(name):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except OSError:
                    pass

    def append(self, parts: list[bytes], mono: float, *, opens: str | None = None, ends: str | None = None) -> None:
        """One record (its parts written in one ``writev``), at monotonic time ``mono``: the
        arrival of request ``opens``, or the end of request ``ends``. A segment holding the
        arrival of a request still in flight is not expired by age (the request a server hangs
        on is the one that matters), only by the bytes bound."""
        size = sum(len(p) for p in parts)
        with self.lock:
            current = self.segments[-1] if self.segments and self.fd >= 0 else None
            if current is None or (current.size and current.size + size > max(1, self.max_bytes // SEGMENTS)):
                current = self._begin()
            _write_all(self.fd, parts)
            current.size += size
            current.newest = mono
            if opens is not None:
                current.open_ids.add(opens)
                self.arrived_in[opens] = current
            if ends is not None and (held := self.arrived_in.pop(ends, None)) is not None:
                held.open_ids.discard(ends)
            self._trim()

    def _begin(self) -> _Segment:
        self._close_fd()
        path = layout.requests_path(self.directory, self.pid, self.next_n)
        self.next_n += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | _NOFOLLOW, 0o600)
        self.fd = fd
        segment = _Segment(self.next_n - 1, path, os.fstat(fd).st_ino)
        self.segments.append(segment)
        return segment

    def _trim(self) -> None:
        while len(self.segments) > 1 and (len(self.segments) > SEGMENTS or
                                          sum(s.size for s in self.segments) > self.max_bytes):
            self._remove(self.segments.popleft())

    def _remove(self, segment: _Segment) -> None:
        for rid in segment.open_ids:
            self.arrived_in.pop(rid, None)
        try:
            os.unlink(segment.path)
        except FileNotFoundError:
            pass

    def expire(self, now_mono: float) -> None:
        """Remove the segments whose newest record is past ``max_age``; notice a current
        segment removed under us (a /tmp cleaner): the next record begins a new one."""
        with self.lock:
            while self.segments and self.segments[0].newest < now_mono - self.max_age and not self.segments[0].open_ids:
                if len(self.segments) == 1 and self.fd >= 0:
                    self._close_fd()
                self._remove(self.segments.popleft())
            if self.segments and self.fd >= 0:
                try:
                    same = os.stat(self.segments[-1].path).st_ino == self.segments[-1].ino
                except OSError:
                    same = False
                if not same:
                    self._close_fd()

    def _close_fd(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    def close(self) -> None:
        with self.lock:
            self._close_fd()


def _write_all(fd: int, parts: list[bytes]) -> None:
    written = os.writev(fd, parts) if hasattr(os, "writev") else os.write(fd, b"".join(parts))
    total = sum(len(p) for p in parts)
    if written < total:  # a regular file writes whole; a short write is finished by hand
        rest = b"".join(parts)[written:]
        while rest:
            n = os.write(fd, rest)
            if n <= 0:
                raise OSError("short write to the request spool")
            rest = rest[n:]


def encode_arrival(header: dict[str, Any], body: bytes) -> list[bytes]:
    """An arrival record's parts: its header line (``body_bytes`` set here), the body, a newline."""
    line = json.dumps({**header, "k": "a", "body_bytes": len(body)}, separators=(",", ":")).encode() + b"\n"
    return [line, body, b"\n"]


def encode_end(fields: dict[str, Any]) -> list[bytes]:
    return [json.dumps({**fields, "k": "e"}, separators=(",", ":")).encode() + b"\n"]


# --- the reader (capture, in mlxwatch's own process)


def segment_paths(directory: str, pid: int) -> list[str]:
    """The process's segments, oldest first."""
    pattern = re.compile(rf"^{pid}\.requests\.(\d+)$")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = sorted((int(m.group(1)), name) for name in names if (m := pattern.match(name)))
    return [os.path.join(directory, name) for _, name in found]


def _read_segment(path: str, limit: int) -> bytes | None:
    """A segment's bytes (never through a link, never a FIFO), None when gone or not a file of ours."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        chunks, left = [], min(st.st_size, limit)
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def parse_segment(data: bytes) -> tuple[list[dict[str, Any]], bool]:
    """The whole records of one segment, in order, and whether it ended in a cut record."""
    out: list[dict[str, Any]] = []
    pos, end = 0, len(data)
    while pos < end:
        nl = data.find(b"\n", pos, pos + MAX_HEADER)
        if nl < 0:
            return out, True
        try:
            record = json.loads(data[pos:nl])
        except ValueError:
            return out, True
        if not isinstance(record, dict):
            return out, True
        pos = nl + 1
        if record.get("k") == "a":
            n = record.get("body_bytes")
            if not isinstance(n, int) or n < 0 or pos + n >= end or data[pos + n:pos + n + 1] != b"\n":
                return out, True
            record["body"] = data[pos:pos + n]
            pos += n + 1
        out.append(record)
    return out, False


def read(directory: str, pid: int, *, now_mono: float, max_age: float, max_bytes: int,
         until: float | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The recorded requests of ``pid``, arrival order: each arrival record with its body and,
    once it ended, its end's fields under ``"end"``; within the bounds at ``now_mono`` and
    arrived by ``until`` (monotonic) if given. Also what could not be read, one line each."""
    arrivals: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for path in segment_paths(directory, pid):
        data = _read_segment(path, 2 * max_bytes + MAX_HEADER)
        if data is None:
            continue  # removed since it was listed (the oldest, expired): nothing lost that the bounds keep
        records, cut = parse_segment(data)
        if cut:
            problems.append(f"{os.path.basename(path)}: a record cut short (written at this moment, or a full disk)")
        for record in records:
            rid = str(record.get("id"))
            if record.get("k") == "a":
                arrivals.setdefault(rid, record)
            elif record.get("k") == "e":
                ends[rid] = record
    kept = []
    for rid, record in arrivals.items():
        mono = record.get("mono")
        if not isinstance(mono, (int, float)) or (until is not None and mono > until):
            continue
        if mono < now_mono - max_age and rid in ends:  # past the age bound and over; one in flight stays
            continue
        if rid in ends:
            record["end"] = ends[rid]
        kept.append(record)
    kept.sort(key=lambda r: (r.get("seq", 0), r["mono"]))
    held = sum(len(r["body"]) for r in kept)
    while kept and held > max_bytes:  # the oldest go first, as in the door's recorder
        held -= len(kept.pop(0)["body"])
    return kept, problems
