"""One daemon per state directory: an exclusive ``flock`` on ``<state_dir>/daemon.lock``.

Two daemons on one state dir capture and restart the same hang twice and kill each other's
fresh servers (measured: six hook runs for one hang). The lock file holds the holder's PID so
the refusal can name it; the kernel drops the lock when the holder dies, however it dies, so a
SIGKILLed daemon never leaves a stale lock behind. Taking the lock checks the state dir first
(``storage.private_dir``: ours, not writable by others) and never opens the lock file through a
symbolic link.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from mlxwatch.errors import StateError
from mlxwatch.storage import NOFOLLOW, private_dir

LOCK_NAME = "daemon.lock"


class StateDirLock:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ``StateError`` naming the daemon that holds it, or the state
        dir's problem (``UnsafeDirError``), or the link planted at the lock's name."""
        private_dir(self.path.parent)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateError(f"{self.path} is a symbolic link; mlxwatch never writes through one: "
                                 "remove it and check who made it") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            who = f"PID {holder}" if holder else "another process"
            raise StateError(f"another mlxwatch daemon ({who}) is running on {self.path.parent} (lock {self.path})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (its PID is harmless)
            self.fd = None


def lock_holder(state_dir: Path) -> int | None:
    """The PID of the daemon holding ``state_dir``, or None if no daemon holds it."""
    try:
        fd = os.open(state_dir / LOCK_NAME, os.O_RDONLY | NOFOLLOW)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return None
