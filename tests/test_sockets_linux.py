"""The Linux reader on real loopback sockets: what it counts as a server's client connection."""

from __future__ import annotations

import errno
import socket
import struct
import subprocess
import sys
import time
import unittest.mock

import pytest

from mlxwatch.host import sockdiag
from mlxwatch.host.sockets import _STATE_NUMBERS, LinuxReader

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sock_diag is Linux's")

CLIENT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("connected", flush=True)
sys.stdin.readline()  # until told to go
s.recv(300)  # read what was sent: a close with unread data would reset the connection, not end it
s.close()
"""


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_connection_its_client_closed_is_no_client_stream():
    """Found trying it (issue 27): the daemon's abandoned probes, and a killed daemon's, left
    server-side sockets in CLOSE_WAIT that were counted as open client streams, and made a
    `kernel_stall` of a server nobody used. A client still connected is counted, with what the
    server sent it; once it closes its end, it is not."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert client.stdout is not None and client.stdout.readline().strip() == "connected"
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"x" * 300)
                reader = LinuxReader()
                assert _wait(lambda: [c.bytes_sent for c in reader([port]).connections] == [300])
                assert not reader([port]).connections[0].own  # another process's client end
                assert client.stdin is not None
                client.stdin.write("go\n")
                client.stdin.flush()
                client.wait(10)
                assert _wait(lambda: reader([port]).connections == ())
        finally:
            if client.poll() is None:
                client.kill()
            client.wait(10)
            for stream in (client.stdin, client.stdout):
                if stream is not None:
                    stream.close()


REQUESTER = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 2\\r\\n\\r\\n{}")
print("sent", flush=True)
if sys.argv[2] == "read":
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    print(len(got), flush=True)
sys.stdin.readline()  # until told to go
s.close()
"""


class _Client:
    """A client in a process of its own (its connection is someone else's to the reader)."""

    def __init__(self, port: int, mode: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", REQUESTER, str(port), mode], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def end(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write("go\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def _listener() -> tuple[socket.socket, int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener, listener.getsockname()[1]


@pytest.mark.parametrize("client_closed", [False, True])
def test_an_answer_the_server_sent_whole_and_closed_between_two_readings_is_a_delivery(client_closed):
    """Measured with the openai SDK: a non-streamed answer leaves in one go at its end and mlx-lm
    closes the connection after it, so the answer was never counted. What sock_diag still shows
    after the server's close: its end, orphaned (inode 0) in FIN_WAIT with its counts while the
    client holds its own end, then a TIME_WAIT remnant with none; both keep the socket's cookie.
    Kernel sight reads the waiting request, then what is left, as an answer."""
    from mlxwatch.evidence import Window
    from mlxwatch.evidence.kernel import KernelSource
    from mlxwatch.host.sockets import KernelCounters

    listener, port = _listener()
    client = _Client(port, "read")
    source = KernelSource(KernelCounters(LinuxReader(), max_age=0.0), port, lambda: 8.0)
    try:
        assert client.line() == "sent"
        conn, peer = listener.accept()
        conn.recv(65536)  # the request, read as a server reads it
        source.sample(1.0)
        source.sample(2.5)
        assert source.answer(Window(0.0, 2.5)).detail["kernel"]["waiting"] == 1
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 700\r\n\r\n" + b"x" * 700)
        conn.shutdown(socket.SHUT_WR)
        conn.close()
        assert client.line() == str(len(b"HTTP/1.0 200 OK\r\nContent-Length: 700\r\n\r\n") + 700)
        if client_closed:
            client.end()
        reading = source.sample(3.5)
        [remnant] = [c for c in reading.connections if c.client == peer]
        assert remnant.closed and remnant.counted is not client_closed
        if remnant.counted:
            assert remnant.written == len(b"HTTP/1.0 200 OK\r\nContent-Length: 700\r\n\r\n") + 700
        got = source.answer(Window(2.5, 3.5))
        assert got.delivered and "1 answer(s) to clients completed" in got.delivered[0], got
        assert got.detail["kernel"]["waiting"] == 0
    finally:
        client.end()
        listener.close()


def test_a_client_that_reads_nothing_leaves_the_servers_writes_unsent():
    """A slow reader: what the server wrote waits in its send queue (tcpi_notsent_bytes), and
    counts as written."""
    listener, port = _listener()
    client = _Client(port, "hold")
    try:
        assert client.line() == "sent"
        conn, peer = listener.accept()
        with conn:
            conn.recv(65536)
            conn.setblocking(False)
            wrote = 0
            try:
                while True:
                    wrote += conn.send(b"x" * 65536)
            except BlockingIOError:
                pass
            reader = LinuxReader()
            assert _wait(lambda: [c.written for c in reader([port]).connections if c.client == peer] == [wrote])
            [c] = [c for c in reader([port]).connections if c.client == peer]
            assert c.unsent > 0 and c.bytes_sent < wrote
    finally:
        client.end()
        listener.close()



def _pyroute2_dump(port: int, family: int, states: int) -> dict[int, dict]:
    """pyroute2's reading of the sockets on ``port``, by cookie: the reference."""
    from pyroute2 import DiagSocket

    with DiagSocket() as sock:
        sock.bind()
        messages = sock.get_sock_stats(family=family, states=states, extensions=1 << (2 - 1))
    out = {}
    for m in messages:
        if port in (m["idiag_sport"], m["idiag_dport"]):
            info = m.get_attr("INET_DIAG_INFO") or {}
            out[m["idiag_cookie"]] = {
                "family": m["idiag_family"], "state": m["idiag_state"], "sport": m["idiag_sport"],
                "dport": m["idiag_dport"], "src": m["idiag_src"], "dst": m["idiag_dst"], "cookie": m["idiag_cookie"],
                "wqueue": m["idiag_wqueue"],
                "inode": m["idiag_inode"], "info": {k: info.get(k) for k in sockdiag._TCP_INFO} if info else {}}
    return out


def _stdlib_dump(port: int, family: int, states: int) -> dict[int, dict]:
    return {m.cookie: {**m._asdict(), "info": dict(m.info)} for m in sockdiag.dump({port}, states, (family,))
            if m.family == family}


def _quiet(dumped: dict[int, dict]) -> dict[int, dict]:
    """Without the times since the last send (they grow between two readings)."""
    return {k: {**v, "info": {f: x for f, x in v["info"].items() if f != "tcpi_last_data_sent"}}
            for k, v in dumped.items()}


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_the_standard_library_dump_reads_what_pyroute2_reads(family):
    """sock_diag's answers are parsed here (``mlxwatch.host.sockdiag``; pyroute2 took about
    100 ms a dump with the daemon's own probes' TIME_WAIT remnants in it, a third of a core at
    300 instances): on one quiet set of sockets of every kind kernel sight reads (listening,
    established with bytes both ways, a slow reader with bytes unsent, a server end whose writes
    ended while the client holds its end, TIME_WAIT remnants, orphans), every field read is what
    pyroute2 reads, in both address families."""
    pytest.importorskip("pyroute2")
    host = "127.0.0.1" if family == socket.AF_INET else "::1"
    listener = socket.socket(family)
    listener.bind((host, 0))
    listener.listen()
    port = listener.getsockname()[1]
    held: list[socket.socket] = [listener]
    try:
        for _ in range(3):  # closed by the server first, then by the client: TIME_WAIT remnants
            c = socket.create_connection((host, port))
            s, _ = listener.accept()
            s.sendall(b"x" * 100)
            s.close()
            c.recv(200)
            c.close()
        orphaned = socket.create_connection((host, port))  # the server closed, the client holds its end
        held.append(orphaned)
        s, _ = listener.accept()
        s.sendall(b"o" * 10)
        s.close()
        ours = socket.create_connection((host, port))  # bytes both ways
        served, _ = listener.accept()
        held += [ours, served]
        ours.sendall(b"GET / HTTP/1.1\r\n\r\n")
        served.recv(100)
        served.sendall(b"y" * 300)
        ours.recv(300)
        half = socket.create_connection((host, port))  # the server ended its writes and holds its end
        closing, _ = listener.accept()
        held += [half, closing]
        closing.sendall(b"z" * 50)
        closing.shutdown(socket.SHUT_WR)
        slow = socket.create_connection((host, port))  # reads nothing: bytes unsent
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        writer, _ = listener.accept()
        held += [slow, writer]
        writer.setblocking(False)
        try:
            while True:
                writer.send(b"w" * 65536)
        except BlockingIOError:
            pass
        every = 0xFFF & ~1  # every TCP state
        assert _wait(lambda: _quiet(_stdlib_dump(port, family, every)) == _quiet(_pyroute2_dump(port, family, every)))
        got = _stdlib_dump(port, family, every)
        states = sorted(v["state"] for v in got.values())
        assert states.count(_STATE_NUMBERS["TIME_WAIT"]) >= 3
        assert {_STATE_NUMBERS["FIN_WAIT1"], _STATE_NUMBERS["FIN_WAIT2"]} & set(states)
        assert 10 in states  # the listener
        assert any(v["info"].get("tcpi_notsent_bytes") for v in got.values())
        assert any(v["info"].get("tcpi_bytes_received") for v in got.values())
        assert all(v["info"]["tcpi_last_data_sent"] is not None for v in got.values() if v["info"])
    finally:
        for s in held:
            s.close()


def test_a_remnant_is_read_only_for_another_clients_connection_seen_open():
    """The TIME_WAIT remnants in a reading: only those of connections an earlier reading saw open
    and not ours (the daemon's own probes left about 1,800 in each dump at 300 instances, and
    parsing them cost a third of a core). A connection never seen open, or our own, would be
    read against nothing (``KernelSource._closed``)."""
    listener, port = _listener()
    seen_client, unseen_client = _Client(port, "read"), None
    reader = LinuxReader()
    answer = b"HTTP/1.0 200 OK\r\n\r\n" + b"x" * 700

    def answered(conn: socket.socket, client: _Client) -> None:
        conn.sendall(answer)
        conn.close()
        assert client.line() == str(len(answer))
        client.end()

    try:
        assert seen_client.line() == "sent"
        seen, seen_peer = listener.accept()
        seen.recv(65536)
        ours = socket.create_connection(("127.0.0.1", port))
        mine, my_peer = listener.accept()
        first = {c.client: c.own for c in reader([port]).connections}
        assert first == {seen_peer: False, my_peer: True}
        unseen_client = _Client(port, "read")  # opened and closed before the next reading
        assert unseen_client.line() == "sent"
        unseen, _ = listener.accept()
        unseen.recv(65536)
        answered(unseen, unseen_client)
        answered(seen, seen_client)
        mine.close()  # ours, closed by the server first too
        ours.recv(100)
        ours.close()
        remnants = [m for m in sockdiag.dump({port}, 1 << _STATE_NUMBERS["TIME_WAIT"]) if m.sport == port]
        assert len(remnants) == 3  # the kernel keeps all three
        assert [(c.client, c.closed, c.counted) for c in reader([port]).connections] == [(seen_peer, True, False)]
    finally:
        seen_client.end()
        if unseen_client is not None:
            unseen_client.end()
        listener.close()


def test_a_dump_walks_ipv6_connections_only_where_a_listener_may_have_them():
    """Each family's dump walks every bucket of the kernel's connection table (3 ms a family
    measured, most of kernel sight's cost at 10 instances): IPv4 alone where every port's
    listeners are IPv4; both where one is IPv6 (its IPv4 clients are v4-mapped IPv6 sockets) or
    a port has no listener (its server may still hold connections)."""
    v4, v4_port = _listener()
    v6 = socket.socket(socket.AF_INET6)
    try:
        v6.bind(("::", 0))
        v6.listen()
        v6_port = v6.getsockname()[1]
        v4_clients = socket.create_connection(("127.0.0.1", v6_port))  # a dual-stack listener's IPv4 client
        served, _ = v6.accept()
        assert sockdiag.families_served({v4_port}) == (socket.AF_INET,)
        assert sockdiag.families_served({v4_port, v6_port}) == (socket.AF_INET, socket.AF_INET6)
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        unheard = free.getsockname()[1]
        free.close()
        assert sockdiag.families_served({v4_port, unheard}) == (socket.AF_INET, socket.AF_INET6)
        assert [c.client[0] for c in LinuxReader()([v6_port]).connections] == ["::ffff:127.0.0.1"]
        v4_clients.close()
        served.close()
    finally:
        v4.close()
        v6.close()


class _Datagrams:
    """A netlink socket that answers with the given datagrams."""

    def __init__(self, *datagrams: bytes) -> None:
        self.datagrams = list(datagrams)

    def recvmsg_into(self, buffers):
        data = self.datagrams.pop(0)
        buffers[0][:len(data)] = data
        return len(data), [], 0, None


def _nlmsg(kind: int, body: bytes, seq: int = 1) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, 0, seq, 0) + body + b"\0" * (-len(body) % 4)


def test_a_refused_or_malformed_answer_is_an_error_not_a_traceback():
    """The kernel's refusal (an NLMSG_ERROR) and an answer that does not parse are errors the
    reading reports ("sock_diag unavailable: ..."), never a traceback; a socket on no watched
    port is skipped, a well-formed one read."""
    buf = bytearray(sockdiag.RECV_BYTES)
    refused = _Datagrams(_nlmsg(sockdiag.NLMSG_ERROR, struct.pack("=i", -errno.EPERM) + b"\0" * 16))
    with pytest.raises(PermissionError):
        list(sockdiag._answers(refused, buf, 1, frozenset({8080}), None))  # type: ignore[arg-type]
    truncated = _Datagrams(struct.pack("=IHHII", 400, sockdiag.SOCK_DIAG_BY_FAMILY, 0, 1, 0) + b"\0" * 8)
    with pytest.raises(OSError):
        list(sockdiag._answers(truncated, buf, 1, frozenset({8080}), None))  # type: ignore[arg-type]
    msg = (struct.pack("=BBBB", socket.AF_INET, 1, 0, 0) + struct.pack("!HH", 8080, 40000)
           + socket.inet_aton("127.0.0.1") + b"\0" * 12 + socket.inet_aton("127.0.0.2") + b"\0" * 12
           + struct.pack("=IQIIIII", 0, 77, 0, 0, 5, 0, 123))
    other = msg[:4] + struct.pack("!HH", 9090, 40001) + msg[8:]
    answers = _Datagrams(_nlmsg(sockdiag.SOCK_DIAG_BY_FAMILY, other) + _nlmsg(sockdiag.SOCK_DIAG_BY_FAMILY, msg)
                         + _nlmsg(sockdiag.NLMSG_DONE, b"\0" * 4))
    [got] = sockdiag._answers(answers, buf, 1, frozenset({8080}), None)  # type: ignore[arg-type]
    assert (got.sport, got.dport, got.src, got.dst, got.cookie, got.wqueue, got.inode, got.info) == \
        (8080, 40000, "127.0.0.1", "127.0.0.2", 77, 5, 123, {})
    with unittest.mock.patch.object(sockdiag, "dump", side_effect=PermissionError(errno.EPERM, "refused")):
        reading = LinuxReader()([8080])
    assert reading.error == "sock_diag unavailable: PermissionError: [Errno 1] refused" and not reading.connections
