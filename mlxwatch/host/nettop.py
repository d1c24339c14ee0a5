"""macOS: the bytes a server sent and received on each client connection, from ``nettop``.

``nettop`` lists every socket of every process with its byte counts, without root. In logging
mode it prints CSV (real output, macOS 26.5.2: ``tests/data/nettop-netglass-capture.csv``)::

    time,,interface,state,bytes_in,bytes_out,
    00:39:45.365862,OpenCode Helper.71830,,,19337831,280535705,
    00:39:45.363990,tcp4 127.0.0.1:52122<->127.0.0.1:62377,lo0,Established,2316,219091,

The unnamed column names the row: a process (``Name.pid``) or one of its sockets
(``PROTO local<->remote``; IPv4 ``addr:port``, IPv6 ``addr.port``). Columns come in nettop's
own order whatever ``-J`` asks, so they are found by the header. A column name nettop does not
know makes it print its usage and exit 0, so output without the expected header is an error,
never an empty reading. Use::

    reading = NettopReader()({8080})   # blocks for one nettop run: call it from a thread
    reading.error or reading.on(8080)

Every failure (no nettop, a timeout, a non-zero exit, output it cannot read) is a
``Reading(error=...)`` of one line; nothing raises.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Collection

import psutil

from mlxwatch.host.commands import MAX_OUTPUT, error_line
from mlxwatch.host.connections import Connection, Reading
from mlxwatch.host.ownconns import OWN, OwnConnections, plain

NETTOP = "/usr/bin/nettop"
TIMEOUT = 5.0  # seconds for one run; one sample usually takes well under a second
# The columns asked for: exactly the set of the real output the parser is tested on (time and
# interface are not used, but leaving them out would make a header shape no one has seen).
COLUMNS = ("time", "interface", "state", "bytes_in", "bytes_out")
# States of a server end that are no client connection (seen in real output; Closed rows have no
# counts). Any other state with byte counts is listed.
_NOT_LISTED = frozenset({"Listen", "Closed"})
# States in which the server sent its FIN: it has finished writing to that client (as Linux's
# reader says, ``Connection.closed``). Their rows keep their byte counts (real output:
# ``127.0.0.1:62345<->127.0.0.1:10808,lo0,TimeWait,2484,1396``; FinWait1 rows too).
_CLOSED = frozenset({"FinWait1", "FinWait2", "Closing", "TimeWait"})

OwnEnds = AbstractSet[tuple[str, int, int]]  # (client address, client port, server port) of our sockets


class NettopFormatError(ValueError):
    """nettop's output is not the CSV this module reads (its message is one line)."""


def nettop_command(nettop: str = NETTOP) -> list[str]:
    """One sample (-L 1, logging mode: CSV) of TCP sockets (-m tcp), numeric (-n), the columns
    of ``COLUMNS`` only (-J); every process, since the caller knows ports, not PIDs."""
    return [nettop, "-m", "tcp", "-n", "-L", "1", "-J", ",".join(COLUMNS)]


def _endpoint(text: str) -> tuple[str, int | None]:
    """``127.0.0.1:8080`` or ``::1.8080`` (nettop's IPv6 form) -> (address, port); a port of
    ``*`` (a listener's peer, an unbound socket) -> None."""
    cut = max(text.rfind(":"), text.rfind("."))
    if cut < 0:
        return text, None
    port = text[cut + 1:]
    return text[:cut], int(port) if port.isdigit() else None


def parse(text: str, ports: Collection[int], own: OwnEnds | Callable[[], OwnEnds] = frozenset(),
          registered: OwnConnections | None = None) -> tuple[Connection, ...]:
    """The server ends of TCP connections whose local port is in ``ports``, from nettop's CSV.

    ``own``: our own client ends, or a function giving them (called only when a connection was
    found), and ``registered``: those our clients registered as they connected (nettop runs for
    a second: a short request is closed by the time ``own`` is asked). Raises
    NettopFormatError when the text is not nettop's CSV with the columns needed.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise NettopFormatError("nettop printed nothing")
    header = lines[0].split(",")
    if "" not in header:  # usage text, an error message, human-readable output
        raise NettopFormatError(f"no CSV header (first line: {lines[0][:60]!r})")
    what = header.index("")  # the unnamed column: the process or socket a row is about
    needed = ("state", "bytes_in", "bytes_out")
    missing = [name for name in needed if name not in header]
    if missing:
        raise NettopFormatError(f"header lacks {', '.join(missing)} (header: {lines[0][:60]!r})")
    state_at, in_at, out_at = (header.index(name) for name in needed)
    wanted = set(ports)
    found = []
    for line in lines[1:]:
        fields = line.split(",")
        if line == lines[0] or len(fields) <= what:
            continue  # a repeated header (more than one sample)
        proto, _, pair = fields[what].partition(" ")
        if proto not in ("tcp4", "tcp6"):
            continue  # a process row (its name may hold commas), udp, quic
        if len(fields) != len(header):
            raise NettopFormatError(f"a tcp row has {len(fields)} fields, the header {len(header)}: {line[:80]!r}")
        local, sep, remote = pair.partition("<->")
        address, port = _endpoint(local)
        client, client_port = _endpoint(remote)
        if not sep or port not in wanted or client_port is None or fields[state_at] in _NOT_LISTED:
            continue
        raw_in, raw_out = fields[in_at], fields[out_at]
        if not raw_in and not raw_out:
            continue  # no counts for this socket (seen on rows in state Closed)
        for name, raw in (("bytes_in", raw_in), ("bytes_out", raw_out)):
            if not raw.isdigit():
                raise NettopFormatError(f"{name} is not a byte count: {raw!r}")
        found.append(Connection(
            port=port, client=(client, client_port),
            # nettop shows no socket id: the 4-tuple is one connection's while it lives.
            key=("nettop", proto, address, port, client, client_port),
            bytes_sent=int(raw_out), bytes_received=int(raw_in), closed=fields[state_at] in _CLOSED,
        ))
    if not found:
        return ()
    ends = own() if callable(own) else own
    return tuple(
        Connection(c.port, c.client, c.key, c.bytes_sent, c.bytes_received, closed=c.closed,
                   own=(registered is not None and c.client in registered)
                   or (plain(c.client[0]), c.client[1], c.port) in ends)
        for c in found
    )


def own_client_ends() -> OwnEnds:
    """This process's TCP sockets as (local address, local port, remote port): a server's
    connection whose client end is among them is ours (a probe, the front door). Reading one's
    own sockets needs no root."""
    try:
        me = psutil.Process()
        conns = me.net_connections(kind="tcp") if hasattr(me, "net_connections") else me.connections(kind="tcp")
    except (psutil.Error, OSError):
        return set()
    return {(plain(c.laddr.ip), c.laddr.port, c.raddr.port) for c in conns if c.laddr and c.raddr}


@dataclass
class Ran:
    returncode: int
    stdout: bytes
    stderr: bytes
    truncated: bool


def run_bounded(argv: list[str], timeout: float, cap: int = MAX_OUTPUT) -> Ran:
    """Run ``argv`` (no shell, no stdin) for at most ``timeout`` seconds, keeping at most
    ``cap`` bytes of each stream. Output goes to unlinked temporary files, so a child cannot
    block on a full pipe and the daemon never holds more than ``cap``. On timeout the child's
    session is killed (it was started in its own) and TimeoutExpired is raised. Blocking."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        try:
            returncode = proc.wait(timeout)
        finally:
            if proc.returncode is None:  # timed out (or interrupted): end it and what it started
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(cap + 1), err.read(cap + 1)
    truncated = len(stdout) > cap or len(stderr) > cap
    return Ran(returncode, stdout[:cap], stderr[:cap], truncated)


@dataclass
class NettopReader:
    """Kernel sight on macOS: one ``nettop`` run per reading (``mlxwatch.host.sockets.KernelCounters`` shares it)."""

    nettop: str = NETTOP
    timeout: float = TIMEOUT
    max_output: int = MAX_OUTPUT
    own: Callable[[], OwnEnds] = field(default=own_client_ends, repr=False)
    registered: OwnConnections = field(default=OWN, repr=False)

    def __call__(self, ports: Collection[int]) -> Reading:
        at = time.monotonic()
        try:
            ran = run_bounded(nettop_command(self.nettop), self.timeout, self.max_output)
        except FileNotFoundError:
            return Reading(at, error="nettop not found")
        except subprocess.TimeoutExpired:
            return Reading(at, error=f"nettop timed out after {self.timeout:g}s")
        except OSError as exc:
            return Reading(at, error=f"nettop: {exc.strerror or exc}")
        if ran.returncode != 0:
            return Reading(at, error=f"nettop exit {ran.returncode}: {error_line(ran.stderr or ran.stdout)}")
        if ran.truncated:
            return Reading(at, error=f"nettop printed more than {self.max_output} bytes")
        try:
            return Reading(at, parse(ran.stdout.decode("utf-8", "replace"), ports, self.own, self.registered))
        except NettopFormatError as exc:
            return Reading(at, error=f"nettop output not understood: {exc}")
