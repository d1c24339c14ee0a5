"""What one look at the kernel's per-connection counters gives, whatever read them: the types
shared by the Linux reader (``mlxwatch.host.sockets``) and the macOS one
(``mlxwatch.host.nettop``). ``mlxwatch.host.sockets`` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Collection, Protocol


@dataclass(frozen=True)
class Connection:
    """One client connection of a server, as the kernel counts it on the server's side."""

    port: int  # the server's (listening) port
    client: tuple[str, int]  # the peer's address and port
    key: tuple[Any, ...]  # stays the same for the connection's life (inode and cookie; nettop: the 4-tuple)
    bytes_sent: int  # server -> client
    bytes_received: int  # client -> server: a request that has arrived
    segments_out: int | None = None  # data segments sent (Linux): tells keepalive-sized writes from tokens
    idle_send: float | None = None  # seconds since the server last sent data (None: not known)
    own: bool = False  # the client end is this process (a probe of ours, the front door)
    unsent: int = 0  # bytes the server wrote that wait in its send queue, not yet sent: a client that reads slowly (Linux)
    closed: bool = False  # the server sent its FIN: it has finished writing to this client
    counted: bool = True  # its byte counts are known (False: a Linux TIME_WAIT remnant keeps none)
    bytes_written: int | None = None  # bytes the server wrote, acknowledged or queued (Linux; no retransmission counted twice)

    @property
    def written(self) -> int:
        """Bytes the server wrote to this client: sent, or waiting in the send queue."""
        return self.bytes_written if self.bytes_written is not None else self.bytes_sent + self.unsent


@dataclass(frozen=True)
class Reading:
    """One look at the kernel's counters: the connections on the asked ports, or why none."""

    at: float  # monotonic
    connections: tuple[Connection, ...] = ()
    error: str | None = None  # why nothing could be read (no sock_diag, no nettop, refused)

    def on(self, port: int) -> tuple[Connection, ...]:
        return self._by_port.get(port, ())

    @cached_property
    def _by_port(self) -> dict[int, tuple[Connection, ...]]:
        """The connections by port, sorted once: every instance asks a shared dump for its own."""
        out: dict[int, list[Connection]] = {}
        for c in self.connections:
            out.setdefault(c.port, []).append(c)
        return {port: tuple(conns) for port, conns in out.items()}


class Reader(Protocol):
    def __call__(self, ports: Collection[int]) -> Reading: ...
