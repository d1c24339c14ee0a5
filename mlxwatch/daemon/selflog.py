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
anything is renamed, and to still carry the name it had when the handler was made: a file someone
else already rotated or moved is left alone. The new file is opened before anything is renamed,
so a rotation that fails (EMFILE: out of descriptors) leaves the log at its configured path; the
failure is said once on the log (the size cap is not applied meanwhile) and rotation is tried
again after ``RETRY_SECONDS``, not on every line. Every line goes through the redaction's
command-line rule first (secret flags' values, URL user info, tokens).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
import time
from pathlib import Path

from mlxwatch.capture.redact import redact_command_text

MAX_BYTES = 10 * 1024 * 1024
KEEP = 3
RETRY_SECONDS = 60.0  # after a failed rotation: not again on every line, again after this pause
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

    retry_seconds = RETRY_SECONDS

    def __init__(self, max_bytes: int = MAX_BYTES, keep: int = KEEP, fd: int = 2) -> None:
        super().__init__(sys.stderr if fd == 2 else open(fd, "w", closefd=False))
        self.max_bytes, self.keep, self.fd = max_bytes, keep, fd
        self.path = fd_path(fd)  # the name the daemon was started with: the only one it rotates
        self.rotations = 0
        self.failed_at: float | None = None  # monotonic time of the last rotation that failed

    def format(self, record: logging.LogRecord) -> str:
        """The line with the command-line rule applied: the daemon logs its servers' command
        lines (``server is PID N: … --api-key …``) and this log is kept and shared."""
        return redact_command_text(super().format(record))

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        try:
            st = os.fstat(self.fd)
        except OSError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_size <= self.max_bytes:
            return
        if self.failed_at is not None and time.monotonic() - self.failed_at < self.retry_seconds:
            return  # a rotation failed a moment ago: not again on every line
        try:
            rotated = self.rotate(st)
        except OSError as exc:  # a log that cannot rotate keeps logging; rotation is housekeeping
            self.rotation_failed(st, str(exc))
        else:
            if not rotated:
                self.rotation_failed(st, f"the file written is no longer {self.path}")

    def rotation_failed(self, st: os.stat_result, reason: str) -> None:
        """Say once per run of failures that the size cap is not applied, and wait before trying again."""
        if self.failed_at is None:
            self.stream.write(f"mlxwatch: log not rotated at {st.st_size} bytes ({reason}); "
                              f"the {self.max_bytes}-byte cap is not applied until it is; "
                              f"trying again every {self.retry_seconds:g} s\n")
            self.flush()
        self.failed_at = time.monotonic()

    def rotate(self, st: os.stat_result) -> bool:
        """Move the current file aside and continue in a new one; False if it was not ours to move.

        The new file is opened (under a temporary name) before anything is renamed, so a
        process out of descriptors (EMFILE) leaves the log where it was; a rename that fails
        midway is undone. On OSError the configured path still names the file being written."""
        path = fd_path(self.fd)
        if path is None or path != self.path:
            return False  # moved by someone else (or never a path): not ours to rename again
        try:
            now = os.stat(path)
        except OSError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # rotated by someone else already, or not the file we write
        self.flush()
        fresh = path.with_name(f"{path.name}.rotating")
        previous = path.with_name(f"{path.name}.1")
        new = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND,
                      stat.S_IMODE(st.st_mode) or 0o600)
        try:
            for n in range(self.keep - 1, 0, -1):
                older = path.with_name(f"{path.name}.{n}")
                if older.exists():
                    os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
            os.replace(path, previous)
            try:
                os.replace(fresh, path)
                os.dup2(new, self.fd)
            except OSError:
                os.replace(previous, path)  # the file written gets its name back
                raise
            if self.fd == 2:  # stdout too, when it was the same file (a launchd agent's two paths)
                try:
                    out = os.fstat(1)
                    if (out.st_dev, out.st_ino) == (st.st_dev, st.st_ino):
                        sys.stdout.flush()
                        os.dup2(new, 1)
                except OSError:
                    pass
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(fresh)
            raise
        finally:
            os.close(new)
        self.rotations += 1
        self.failed_at = None
        self.stream.write(f"mlxwatch: log rotated at {st.st_size} bytes; the previous part is {path.name}.1\n")
        self.flush()
        return True
