"""Follow a growing log file by byte offset and inode, the way ``tail -F`` and log shippers do.

Only bytes written since the last read are returned, as whole lines; an old line is never read
twice. A new inode means the file was rotated (read the new one from its start), a size below
the offset means it was truncated in place (copy-truncate: start over). Each read is bounded:
after a burst, only the newest ``max_read`` bytes are kept (the skipped amount is reported).
A FIFO, device or directory is refused, never opened in a way that could block::

    follower = LogFollower(Path("server.log"))
    follower.prime()                  # start at the current end
    chunk = follower.read_new()       # later: what was written meanwhile
    for line in chunk.lines: ...

Reads block (disk I/O): the daemon calls ``read_new`` through ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

MAX_READ = 1024 * 1024  # per read: far more than a probe interval's worth of a busy server's log
MAX_PARTIAL = 64 * 1024  # an unfinished line longer than this is dropped


@dataclass
class LogChunk:
    """What one read found: whole new lines, and what happened to the file meanwhile."""

    lines: list[str] = field(default_factory=list)
    event: str | None = None  # "rotated" | "truncated" | None
    skipped_bytes: int = 0  # dropped to keep the read bounded
    error: str | None = None  # the file could not be followed (missing, not a regular file, ...)


class LogFollower:
    def __init__(self, path: Path, max_read: int = MAX_READ) -> None:
        self.path = path
        self.max_read = max_read
        self.inode: tuple[int, int] | None = None  # (st_dev, st_ino)
        self.offset = 0
        self._partial = b""

    def _stat(self) -> os.stat_result:
        st = os.stat(self.path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{self.path} is not a regular file (a FIFO, device or directory cannot be followed)")
        return st

    def prime(self) -> str | None:
        """Start at the file's current end; returns why it cannot be followed, if it cannot."""
        self._partial = b""
        try:
            st = self._stat()
        except OSError as exc:
            self.inode, self.offset = None, 0  # a log that appears later is read from its start
            return _describe(exc)
        self.inode, self.offset = (st.st_dev, st.st_ino), st.st_size
        return None

    def read_new(self) -> LogChunk:
        """Whole lines written since the last call (or since ``prime``)."""
        chunk = LogChunk()
        try:
            st = self._stat()
        except OSError as exc:
            chunk.error = _describe(exc)
            return chunk
        inode = (st.st_dev, st.st_ino)
        if self.inode is not None and inode != self.inode:
            chunk.event, self.offset, self._partial = "rotated", 0, b""
        elif st.st_size < self.offset:
            chunk.event, self.offset, self._partial = "truncated", 0, b""
        self.inode = inode
        available = st.st_size - self.offset
        if available <= 0:
            return chunk
        start = self.offset
        if available > self.max_read:
            chunk.skipped_bytes = available - self.max_read
            start, self._partial = st.st_size - self.max_read, b""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # never blocks, even if swapped for a FIFO
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(f"{self.path} is not a regular file")
                data = os.pread(fd, st.st_size - start, start)
            finally:
                os.close(fd)
        except OSError as exc:
            chunk.error = _describe(exc)
            return chunk
        self.offset = start + len(data)
        if chunk.skipped_bytes:
            data = data[data.find(b"\n") + 1:]  # the first line was cut: drop it
        data = self._partial + data
        end = data.rfind(b"\n")
        self._partial = data[end + 1:]
        if len(self._partial) > MAX_PARTIAL:
            self._partial = b""
        if end >= 0:
            chunk.lines = data[:end].decode("utf-8", errors="replace").splitlines()
        return chunk


def _describe(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename or 'log'}: not found"
    return exc.strerror and f"{exc.filename}: {exc.strerror}" or str(exc)
