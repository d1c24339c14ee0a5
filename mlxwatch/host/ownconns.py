"""The daemon's own client connections, by their local address, registered as they connect.

Kernel sight leaves the daemon's own connections out (its probes, the door's upstream, a
capture's requests): the probe judges its own stream, the door counts its own tokens. Asking the
process for its sockets after a kernel dump cannot tell them apart: a short request (an endpoint
check, a probe's answer) is often closed by then, its socket gone from ``/proc/self/fd``, and it
was read as another client's (measured: 7 of 7 such connections caught in flight were misread;
in CI the closed ones were counted as answers to clients during a blocked server's capture,
which made its verdict ``busy``). So each connection is registered by whoever opens it, before a
byte is sent, and kept for ``LINGER`` seconds after it closes (a reading taken meanwhile may
still hold it). Thread-safe: the kernel readings run off the event loop.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

LINGER = 30.0  # seconds a closed connection stays ours: readings up to then may still hold its server end


def plain(address: str) -> str:
    """An address as sock_diag, nettop, psutil and ``getsockname`` may each print it: no
    ``%zone``, no IPv4-mapped prefix."""
    address = address.split("%", 1)[0]
    return address[7:] if address.lower().startswith("::ffff:") else address


def key_of(sockname: Any) -> tuple[str, int] | None:
    """``(address, port)`` from a socket's local address (a ``getsockname`` tuple), if it is one."""
    if isinstance(sockname, tuple) and len(sockname) >= 2 and isinstance(sockname[1], int):
        return plain(str(sockname[0])), sockname[1]
    return None


class OwnConnections:
    """Local addresses of this process's client connections, open or closed within ``LINGER``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, linger: float = LINGER) -> None:
        self._clock, self._linger = clock, linger
        self._open: dict[tuple[str, int], int] = {}  # address: connections open from it (a port is reused)
        self._closed: dict[tuple[str, int], float] = {}  # address: when it stops being ours
        self._lock = threading.Lock()

    def opened(self, sockname: Any) -> tuple[str, int] | None:
        """A connection of ours now has this local address; its key, to give to ``closed``."""
        key = key_of(sockname)
        if key is not None:
            with self._lock:
                self._open[key] = self._open.get(key, 0) + 1
                self._closed.pop(key, None)
        return key

    def closed(self, key: tuple[str, int] | None) -> None:
        if key is None:
            return
        with self._lock:
            left = self._open.get(key, 0) - 1
            if left > 0:
                self._open[key] = left
                return
            self._open.pop(key, None)
            self._closed.pop(key, None)  # to the end: the dict stays in the order of expiry
            self._closed[key] = self._clock() + self._linger
            self._prune()

    def __contains__(self, address: object) -> bool:
        """Is ``(address, port)`` the local end of a connection of ours (or was it lately)?"""
        key = key_of(address)
        if key is None:
            return False
        with self._lock:
            if key in self._open:
                return True
            until = self._closed.get(key)
            if until is None:
                return False
            return until > self._clock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open) + len(self._closed)

    def _prune(self) -> None:
        """Forget what expired: the oldest first (all expire ``linger`` after their close)."""
        now = self._clock()
        while self._closed:
            key, until = next(iter(self._closed.items()))
            if until > now:
                return
            del self._closed[key]


OWN = OwnConnections()  # the process's one registry: every client of the daemon registers here
