"""The daemon's own log: one line per event on stderr, and stderr rotated when it is a file.

Under launchd (``StandardErrorPath``) or ``mlxwatch run 2>>file`` stderr is a regular file that
nothing ever rotates; a daemon left running for months would fill the disk. ``RotatingStderr``
is a logging handler that writes to stderr and, when stderr is a regular file larger than
``max_bytes``, renames it to ``<file>.1`` (``.1`` to ``.2`` ..., ``keep`` old files), opens a
new file at the same path and puts it in place of stderr (and of stdout, when stdout was the
same file, as in the launchd agent) with ``dup2``, so every later write, a traceback included,
lands in the new file. A terminal, a pipe or journald's socket is never touched::

    logging.getLogger().addHandler(RotatingStderr())

The file's path is read from the descriptor itself (``/proc/self/fd/2`` on Linux,
``F_GETPATH`` on macOS) and checked to still be the same file (device and inode) before
anything is renamed: a file someone else already rotated is left alone. Every line goes through
the redaction's command-line rule first (secret flags' values, URL user info, tokens).
"""

from __future__ import annotations

import logging
import os
import stat
import sys
from pathlib import Path

from mlxwatch.capture.redact import redact_command_text

MAX_BYTES = 10 * 1024 * 1024
KEEP = 3
F_GETPATH = 50  # macOS fcntl: the path of an open descriptor


def fd_path(fd: int) -> Path | None:
    """The path of the file open on ``fd``, or None if it cannot be told."""
    if sys.platform.startswith("darwin"):
        import fcntl

        try:
            raw = fcntl.fcntl(fd, F_GETPATH, bytes(1024))
        except OSError:
            return None
        return Path(os.fsdecode(raw.split(b"\0", 1)[0])) if raw[:1] == b"/" else None
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return Path(target) if target.startswith("/") and not target.endswith(" (deleted)") else None


class RotatingStderr(logging.StreamHandler):
    """A stderr handler that rotates stderr when it is a regular file (see the module docstring)."""

    def __init__(self, max_bytes: int = MAX_BYTES, keep: int = KEEP, fd: int = 2) -> None:
        super().__init__(sys.stderr if fd == 2 else open(fd, "w", closefd=False))
        self.max_bytes, self.keep, self.fd = max_bytes, keep, fd
        self.rotations = 0

    def format(self, record: logging.LogRecord) -> str:
        """The line with the command-line rule applied: the daemon logs its servers' command
        lines (``server is PID N: … --api-key …``) and this log is kept and shared."""
        return redact_command_text(super().format(record))

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        try:
            st = os.fstat(self.fd)
            if stat.S_ISREG(st.st_mode) and st.st_size > self.max_bytes:
                self.rotate(st)
        except OSError:
            pass  # a log that cannot rotate keeps logging; rotation is housekeeping

    def rotate(self, st: os.stat_result) -> bool:
        """Move the current file aside and continue in a new one; False if it was not ours to move."""
        path = fd_path(self.fd)
        if path is None:
            return False
        try:
            now = os.stat(path)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # rotated by someone else already, or not the file we write
        self.flush()
        for n in range(self.keep - 1, 0, -1):
            older = path.with_name(f"{path.name}.{n}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
        os.replace(path, path.with_name(f"{path.name}.1"))
        new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, stat.S_IMODE(st.st_mode) or 0o600)
        try:
            if self.fd == 2:  # stdout too, when it was the same file (a launchd agent's two paths)
                try:
                    out = os.fstat(1)
                    if (out.st_dev, out.st_ino) == (st.st_dev, st.st_ino):
                        sys.stdout.flush()
                        os.dup2(new, 1)
                except OSError:
                    pass
            os.dup2(new, self.fd)
        finally:
            os.close(new)
        self.rotations += 1
        self.stream.write(f"mlxwatch: log rotated at {st.st_size} bytes; the previous part is {path.name}.1\n")
        self.flush()
        return True
