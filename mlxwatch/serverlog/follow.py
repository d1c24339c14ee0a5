"""Follow a growing log file by byte offset and inode, the way ``tail -F`` and log shippers do.

Only bytes written since the last read are returned, as whole lines; an old line is never read
twice, and no line a file held before is ever taken for a new one. Each read is bounded: after
a burst, only the newest ``max_read`` bytes of a file are kept (the skipped amount is
reported). A FIFO, device or directory is refused, never opened in a way that could block.
The rules (docs/deciding.md, "Following the log"):

- **Rename** (newsyslog, logrotate ``create``): another file at the path is read from its
  start; the old one is still read through the descriptor held on it, because its writer may
  go on writing there (a launchd job's stderr does until the job restarts) or reopen later.
  It is let go once a read finds it no longer growing and its writer (``writer_pid``, when
  known) no longer has it open; with no writer known, once it stops growing and the new file
  has grown since it appeared (newsyslog's own "turned over" line does not count).
- **Copy-truncate**: a size below the offset means truncated in place: start over at 0.
- **Symlink swap**: the path's symlink now resolves to another file. A file new since the
  previous look is read from its start; one that already existed (it was last modified, or
  created where the OS records that, before the previous look) holds history only and is
  read from its end. A swap back to a file still held resumes where it was left.
- **Gone**: a missing path while a file is held is not an error: the held file is still read.

Usage::

    follower = LogFollower(Path("server.log"), writer_pid=lambda: server_pid)
    follower.prime()                  # start at the current end
    chunk = follower.read_new()       # later: what was written meanwhile
    for line in chunk.lines: ...

Reads block (disk I/O): the daemon calls ``prime`` and ``read_new`` through ``asyncio.to_thread``.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from mlxwatch.storage import open_regular_fd

MAX_READ = 1024 * 1024  # per read and file: far more than a probe interval's worth of a busy server's log
MAX_PARTIAL = 64 * 1024  # an unfinished line longer than this is dropped
MAX_ROTATED = 4  # rotated files still read at once; past that the oldest is let go

FileId = tuple[int, int]  # (st_dev, st_ino)


@dataclass
class LogChunk:
    """What one read found: whole new lines, and what happened to the file meanwhile."""

    lines: list[str] = field(default_factory=list)
    event: str | None = None  # "rotated" | "relinked" | "truncated" | "gone" | None
    detail: str = ""  # for a person: which file, read from where
    skipped_bytes: int = 0  # dropped to keep the read bounded
    error: str | None = None  # the log cannot be followed at all (missing, not a regular file, ...)


class _Open:
    """One file being read, by the descriptor held on it (its name may change under it)."""

    def __init__(self, fd: int, ident: FileId) -> None:
        self.fd: int | None = fd
        self.ident = ident
        self.offset = 0
        self.partial = b""
        self.seen_size = 0  # its size when it became the current file: has it grown since?

    def stat(self) -> os.stat_result:
        if self.fd is None:
            raise OSError("log file already let go")
        return os.fstat(self.fd)

    def size(self) -> int:
        return self.stat().st_size

    def pread(self, n: int, at: int) -> bytes:
        if self.fd is None:
            raise OSError("log file already let go")
        return os.pread(self.fd, n, at)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # a follower replaced without close() must not leak descriptors
        try:
            self.close()
        except OSError:
            pass


class LogFollower:
    def __init__(self, path: Path, max_read: int = MAX_READ,
                 writer_pid: Callable[[], int | None] | None = None) -> None:
        self.path = path
        self.max_read = max_read
        self.writer_pid = writer_pid  # the process writing the log, if known: is it still on a rotated file?
        self.current: _Open | None = None  # the file the path names (or named, until another appears)
        self.rotated: list[_Open] = []  # files the path named before, still read; oldest first
        self._target: str | None = None  # where the path resolved at the last look (symlink swaps)
        self._looked_ns: int | None = None  # wall-clock time of the last look

    @property
    def offset(self) -> int:
        """How far the current file has been read (0 when none is open)."""
        return self.current.offset if self.current else 0

    def close(self) -> None:
        for f in self._all():
            f.close()
        self.current, self.rotated = None, []

    def prime(self) -> str | None:
        """Start at the current end of every file followed; returns why the log cannot be
        followed, if it cannot (a log that appears later is then read from its start)."""
        chunk = LogChunk()
        self._look(chunk)
        grown: set[FileId] = set()
        for f in self._all():
            try:
                size = f.size()
            except OSError:
                continue
            if size != f.offset:
                grown.add(f.ident)
            f.offset, f.partial = size, b""
        self._let_go(grown)
        return chunk.error

    def read_new(self) -> LogChunk:
        """Whole lines written since the last call (or since ``prime``): the rotated files'
        first (they are older), then the current file's."""
        chunk = LogChunk()
        self._look(chunk)
        grown = {f.ident for f in self._all() if self._read(f, chunk)}
        self._let_go(grown)
        return chunk

    # --- internals

    def _all(self) -> list[_Open]:
        return [*self.rotated, *([self.current] if self.current else [])]

    def _look(self, chunk: LogChunk) -> None:
        """Find which file the path names now; on a change, keep the old one as rotated."""
        previous_look, self._looked_ns = self._looked_ns, time.time_ns()
        try:
            st = os.stat(self.path)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{self.path} is not a regular file (a FIFO, device or directory cannot be followed)")
        except OSError as exc:
            if self.current is None:
                chunk.error = _describe(exc)
            elif isinstance(exc, FileNotFoundError):
                chunk.event, chunk.detail = "gone", "the file it named is still read, by the descriptor held on it"
            else:
                chunk.error = _describe(exc)
            return
        target = os.path.realpath(self.path)
        relinked = self._target is not None and target != self._target and os.path.islink(self.path)
        self._target = target
        ident = (st.st_dev, st.st_ino)
        if self.current is not None and ident == self.current.ident:
            return
        held = next((f for f in self.rotated if f.ident == ident), None)
        if held is not None:  # the path names a file we still read (a swap back): go on where it was left
            self.rotated.remove(held)
            new = held
            chunk.event, chunk.detail = "relinked", f"{target}: read on from where it was left"
        else:
            try:
                new = _open(self.path)
            except OSError as exc:
                chunk.error = _describe(exc)
                return
            if self.current is None:
                pass  # the first file (or one that appeared): read from its start; prime puts it at its end
            elif relinked and not _new_since(new.stat(), previous_look):
                new.offset = new.size()  # an older file swapped in: what it holds is history
                chunk.event, chunk.detail = "relinked", f"{target} existed before: its lines are history, read from its end"
            else:
                chunk.event = "relinked" if relinked else "rotated"
                chunk.detail = f"{target} is new: read from its start"
        if self.current is not None:
            self.rotated.append(self.current)
            chunk.detail += "; the old file is read on while its writer may still use it"
        try:
            new.seen_size = new.size()
        except OSError:
            pass
        self.current = new
        while len(self.rotated) > MAX_ROTATED:
            self.rotated.pop(0).close()

    def _read(self, f: _Open, chunk: LogChunk) -> bool:
        """Append ``f``'s new whole lines to ``chunk``; True if it grew."""
        try:
            size = f.size()
        except OSError as exc:
            chunk.error = _describe(exc)
            return False
        if size < f.offset:  # truncated in place (copy-truncate): start over
            f.offset, f.partial = 0, b""
            if f is self.current:
                chunk.event, chunk.detail = "truncated", "truncated in place: read from its start"
        available = size - f.offset
        if available <= 0:
            return False
        start, skipped = f.offset, 0
        if available > self.max_read:
            skipped = available - self.max_read
            start, f.partial = size - self.max_read, b""
        try:
            data = f.pread(size - start, start)
        except OSError as exc:
            chunk.error = _describe(exc)
            return False
        f.offset = start + len(data)
        if skipped:
            chunk.skipped_bytes += skipped
            data = data[data.find(b"\n") + 1:]  # the first line was cut: drop it
        data = f.partial + data
        end = data.rfind(b"\n")
        f.partial = data[end + 1:]
        if len(f.partial) > MAX_PARTIAL:
            f.partial = b""
        if end >= 0:
            chunk.lines.extend(data[:end].decode("utf-8", errors="replace").splitlines())
        return True

    def _let_go(self, grown: set[FileId]) -> None:
        """Stop reading the rotated files that stopped growing and that their writer has left:
        it has them no longer open but has the current file open, or (writer unknown, or on
        neither) the current file has grown since it became current (newsyslog's "turned over"
        line in a new file says nothing about where the server writes)."""
        idle = [f for f in self.rotated if f.ident not in grown and _unread(f) == 0]
        if not idle or self.current is None:
            return
        pid = self.writer_pid() if self.writer_pid else None
        held = open_by(pid) if pid else None
        try:
            current_grew = self.current.size() > self.current.seen_size
        except OSError:
            current_grew = False
        for f in idle:
            if held is not None and f.ident in held:
                continue  # its writer still has it open: more may come
            if (held is not None and self.current.ident in held) or current_grew:
                self.rotated.remove(f)
                f.close()  # an unfinished last line goes with it: a cut line is never evidence


def _unread(f: _Open) -> int:
    """Bytes written to ``f`` since it was read (written between its read and this check)."""
    try:
        return f.size() - f.offset
    except OSError:
        return 0


def open_by(pid: int) -> set[FileId] | None:
    """The files process ``pid`` has open, by identity; None if that cannot be told (best effort:
    a process of another user, or one gone). Linux's /proc/PID/fd also sees deleted files."""
    fd_dir = f"/proc/{pid}/fd"
    out: set[FileId] = set()
    try:
        names = os.listdir(fd_dir)
    except FileNotFoundError:
        names = None
    except OSError:
        return None
    if names is not None:
        for name in names:
            try:
                st = os.stat(f"{fd_dir}/{name}")
            except OSError:
                continue
            out.add((st.st_dev, st.st_ino))
        return out
    try:
        files = psutil.Process(pid).open_files()
    except (psutil.Error, OSError):
        return None
    for f in files:
        try:
            st = os.stat(f.path)
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


def _open(path: Path) -> _Open:
    try:
        fd, st = open_regular_fd(path, follow_links=True)  # never blocks, even if swapped for a FIFO
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise OSError(f"{path} is not a regular file (a FIFO, device or directory cannot be followed)") from None
        raise
    return _Open(fd, (st.st_dev, st.st_ino))


def _new_since(st: os.stat_result, looked_ns: int | None) -> bool:
    """Was this file created after the previous look? Modified since then, and created since then
    where the OS records creation (macOS); on Linux the modification alone tells."""
    if looked_ns is None:
        return True
    if st.st_mtime_ns <= looked_ns:
        return False
    born = getattr(st, "st_birthtime", None)
    return born is None or born * 1e9 > looked_ns


def _describe(exc: OSError) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename or 'log'}: not found"
    return exc.strerror and f"{exc.filename}: {exc.strerror}" or str(exc)
