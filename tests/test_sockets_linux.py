"""The Linux reader on real loopback sockets: what it counts as a server's client connection."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from mlxwatch.host.sockets import LinuxReader

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
