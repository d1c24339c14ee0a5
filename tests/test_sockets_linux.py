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
