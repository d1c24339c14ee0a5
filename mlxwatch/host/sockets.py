"""What the kernel counts on a server's client connections, readable without root.

Tokens streamed to a client leave no line in mlx-lm's log, and ``/proc/PID/io`` does not count
the ``send(2)`` its HTTP server uses; but the kernel keeps, for every TCP connection, how many
bytes it sent and when it last did. That is "bytes left the server for a client, and when", for
every client, with no change to the server or its clients:

- **Linux**: sock_diag over netlink (``NETLINK_SOCK_DIAG``, what ``ss -tin`` prints), read with
  the standard library (``mlxwatch.host.sockdiag``): ``tcpi_bytes_sent``, ``tcpi_bytes_received``,
  ``tcpi_data_segs_out``, ``tcpi_notsent_bytes`` (written by the server, not yet taken by a
  slow client) and ``tcpi_last_data_sent`` per socket, and the TIME_WAIT remnant (no counts)
  of each connection it saw open that the server closed first. Any user may dump every socket's
  TCP info; one dump serves every instance (``KernelCounters`` caches it for ``MAX_AGE``), so
  there are at most a few dumps a second however many instances are watched; a dump costs the
  kernel's walk of its connection table and the parsing of the watched ports' sockets.
- **macOS**: ``nettop`` in logging mode lists each TCP connection of a process with its bytes in
  and out, also without root (``mlxwatch.host.nettop``).

The daemon's own connections to the server (its probes, the capture's, the front door's) are
told apart here (``Connection.own``): the probe judges its own stream, and the door counts its
own tokens. Every function blocks: call it from a thread.
"""

from __future__ import annotations

import os
import struct
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass, field
from typing import Callable, Collection

from mlxwatch.host import sockdiag
from mlxwatch.host.connections import Connection, Reader, Reading  # defined there, for nettop too
from mlxwatch.host.nettop import NettopReader
from mlxwatch.host.ownconns import OWN, OwnConnections

MAX_AGE = 0.5  # seconds a dump serves every instance that asks for it
# TCP states of a server's client connection: established, and closed from the server's side
# (it sent its FIN: it has finished writing to that client: ``Connection.closed``), up to the
# TIME_WAIT remnant the server end leaves for a minute (measured on loopback: it keeps the
# socket's cookie and the client's address but no INET_DIAG_INFO; a socket the server's process
# no longer holds has inode 0, so the key is the cookie). Not CLOSE_WAIT or LAST_ACK: the client
# closed its end, nothing is owed to it (a probe the daemon gave up on, or a killed daemon's:
# counted as open streams, they made false stalls), and it leaves no remnant on the server's side.
_STATES = ("ESTABLISHED", "FIN_WAIT1", "FIN_WAIT2", "CLOSING", "TIME_WAIT")
_STATE_NUMBERS = {"ESTABLISHED": 1, "FIN_WAIT1": 4, "FIN_WAIT2": 5, "TIME_WAIT": 6, "CLOSING": 11}
_LIVE_STATES = sum(1 << _STATE_NUMBERS[s] for s in _STATES if s != "TIME_WAIT")


def _own_socket_inodes() -> set[int]:
    """Socket inodes this process holds (``/proc/self/fd``): the daemon's own client ends."""
    out: set[int] = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


class LinuxReader:
    """sock_diag dumps (``mlxwatch.host.sockdiag``). Each reading opens, dumps and closes its own
    netlink socket, in the thread that reads.

    A connection is the daemon's own when its client end was registered by whoever opened it
    (``host.ownconns``), or is a socket this process holds after the dump (what registers
    nothing: a client of a library's own).

    TIME_WAIT remnants are read only for the connections an earlier reading saw open (``tracked``:
    not the daemon's own): a remnant is only ever read against the connection it ends
    (``KernelSource._closed``), and the daemon's own probes leave one each for a minute
    (measured at 300 instances @ 30 s: about 1,800 in every dump; parsing them all made a third
    of a core of the daemon's CPU). Not thread-safe: one reading at a time (``KernelCounters``
    holds its lock)."""

    def __init__(self, registered: OwnConnections = OWN) -> None:
        self.registered = registered
        # cookies of others' connections seen open, kept while the kernel still shows them
        self.tracked: set[int] = set()

    def close(self) -> None:
        return None

    def __call__(self, ports: Collection[int]) -> Reading:
        at = time.monotonic()
        wanted = set(ports)
        states = _LIVE_STATES | (1 << _STATE_NUMBERS["TIME_WAIT"] if self.tracked else 0)
        try:
            found = sockdiag.dump(wanted, states, sockdiag.families_served(wanted), remnants_of=self.tracked)
        # netlink refused, no sock_diag (a container), an answer that cannot be parsed: said, not raised
        except (OSError, ValueError, struct.error) as exc:
            return Reading(at, error=f"sock_diag unavailable: {type(exc).__name__}: {exc}")
        client_ends = {(m.src, m.sport): m.inode for m in found
                       if m.dport in wanted and m.inode}  # a client end on this machine: whose is it?
        own = _own_socket_inodes() if client_ends else set()
        out = [self._connection(m, own=self._own((m.dst, m.dport), client_ends, own)) for m in found if m.sport in wanted]
        self.tracked = {c.key[1] for c in out if not c.own and (not c.closed or c.key[1] in self.tracked)}
        return Reading(at, tuple(out))

    def _own(self, client: tuple[str, int], client_ends: dict[tuple[str, int], int], inodes: set[int]) -> bool:
        """Is the connection from ``client`` the daemon's: registered, or its socket ours now?"""
        return client in self.registered or client_ends.get(client) in inodes

    @staticmethod
    def _connection(m: sockdiag.DiagSocket, own: bool) -> Connection:
        info = m.info
        last, acked = info.get("tcpi_last_data_sent"), info.get("tcpi_bytes_acked")
        closed = m.state != _STATE_NUMBERS["ESTABLISHED"]
        return Connection(
            port=m.sport, client=(m.dst, m.dport), key=("sock", m.cookie),
            bytes_sent=int(info.get("tcpi_bytes_sent") or 0),
            bytes_received=int(info.get("tcpi_bytes_received") or 0),
            segments_out=info.get("tcpi_data_segs_out"),
            idle_send=None if last is None else last / 1000.0,
            own=own,
            unsent=int(info.get("tcpi_notsent_bytes") or 0),
            closed=closed, counted=bool(info),
            # acknowledged + queued (idiag_wqueue: write_seq - snd_una), less a FIN's one
            # sequence number: tcpi_bytes_sent counts every retransmission again (measured: a
            # client that stopped reading made it 47,616 bytes more than was written)
            bytes_written=None if acked is None else int(acked) + int(m.wqueue or 0) - closed,
        )


def unavailable(why: str) -> Reader:
    def read(ports: Collection[int]) -> Reading:
        return Reading(time.monotonic(), error=why)
    return read


def platform_reader(platform: str = sys.platform) -> Reader:
    """The reader this machine has: sock_diag on Linux, nettop on macOS, none elsewhere."""
    if platform.startswith("linux"):
        return LinuxReader()
    if platform == "darwin":
        return NettopReader()
    return unavailable(f"no kernel sight on {platform}")


@dataclass
class KernelCounters:
    """The daemon's one view of the kernel's counters, shared by every instance: a reading
    serves every caller for ``max_age`` seconds, so N instances cost one dump per tick."""

    reader: Reader = field(default_factory=platform_reader)
    max_age: float = MAX_AGE
    clock: Callable[[], float] = time.monotonic
    ports: set[int] = field(default_factory=set)  # every port any instance asked about
    _last: Reading | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # new dumps run here, one at a time (they are serialised by the lock anyway), never on the
    # daemon's default pool: its few workers also resolve every probe's address
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "kernel-sight"), repr=False)

    def fresh(self, port: int, max_age: float | None = None) -> Reading | None:
        """The counters for ``port`` if a dump at most ``max_age`` s old holds them, without
        waiting: no I/O, no thread (None: a new dump is needed, or another thread is making one).
        With many instances most looks are served so, off the daemon's thread pool, whose
        workers also resolve the probes' addresses (measured: 100 instances @ 5 s reading through
        threads put the p99 gap between probes at 156 % of the interval)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            last = self._last
            if last is None or port not in self.ports or \
                    self.clock() - last.at > (self.max_age if max_age is None else max_age):
                return None
            return Reading(last.at, last.on(port), last.error)
        finally:
            self._lock.release()

    def read(self, port: int, max_age: float | None = None) -> Reading:
        """The counters for ``port`` from a dump at most ``max_age`` s old (default
        ``self.max_age``; blocking: call from a thread; one dump at a time)."""
        with self._lock:
            new_port = port not in self.ports
            self.ports.add(port)
            last = self._last
            if last is None or new_port or self.clock() - last.at > (self.max_age if max_age is None else max_age):
                last = self._last = self.reader(frozenset(self.ports))
        return Reading(last.at, last.on(port), last.error)

    def close(self) -> None:
        """Let go of the reader's netlink socket and the dumping thread (the daemon's stop)."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            close = getattr(self.reader, "close", None)
            if close is not None:
                close()
