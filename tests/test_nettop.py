"""The macOS kernel-sight reader around its nettop run: every way the run can fail is one line
in ``Reading.error``, never an exception.

No Mac here: ``nettop`` is a small script in the test's directory that prints the real output
quoted in tests/data (vrlda/netglass's capture), fails, hangs or floods, as the case needs. The
runs are real processes; the reader ends the ones that hang, and the test checks they are gone.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from mlxwatch.host import nettop
from mlxwatch.host.sockets import KernelCounters, platform_reader

CAPTURE = Path(__file__).parent / "data" / "nettop-netglass-capture.csv"


def fake_nettop(tmp_path: Path, body: str) -> str:
    path = tmp_path / "nettop"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def capture(tmp_path) -> Path:
    out = tmp_path / "capture.csv"
    out.write_text(CAPTURE.read_text().partition("# ----- output below, as quoted -----\n")[2])
    return out


def test_the_reader_lists_the_server_ends_from_a_nettop_run(tmp_path, capture):
    """The run gets nettop_command's arguments; its output is parsed for the asked ports."""
    argv_file = tmp_path / "argv"
    path = fake_nettop(tmp_path, f'printf "%s\\n" "$@" > {argv_file}\nexec cat {capture}')
    reader = nettop.NettopReader(nettop=path, own=set)
    reading = reader({52122})
    assert reading.error is None
    assert {c.client for c in reading.on(52122)} == {("127.0.0.1", 62377), ("127.0.0.1", 52142)}
    assert argv_file.read_text().split("\n")[:-1] == nettop.nettop_command(path)[1:]


def test_the_darwin_reader_is_nettops_and_serves_kernel_counters(tmp_path, capture):
    assert isinstance(platform_reader("darwin"), nettop.NettopReader)
    reader = nettop.NettopReader(nettop=fake_nettop(tmp_path, f"exec cat {capture}"), own=set)
    counters = KernelCounters(reader=reader)
    assert len(counters.read(10808).connections) == 30
    assert len(counters.read(52122).connections) == 2


def test_no_nettop_is_one_line():
    reading = nettop.NettopReader(nettop="/nonexistent/nettop")({8080})
    assert reading.error == "nettop not found" and reading.connections == ()


def test_a_failing_nettop_gives_its_error_line(tmp_path):
    path = fake_nettop(tmp_path, 'echo "nettop: sysctl failed: Operation not permitted" >&2; exit 1')
    reading = nettop.NettopReader(nettop=path)({8080})
    assert reading.error == "nettop exit 1: nettop: sysctl failed: Operation not permitted"


def test_usage_text_with_exit_0_is_an_error_not_an_empty_reading(tmp_path):
    """nettop prints its usage and exits 0 for a column name it does not know (netglass's
    notes): that must not read as "no connections"."""
    path = fake_nettop(tmp_path, 'echo "usage: nettop [-ncd] [-m <mode>]"; exit 0')
    reading = nettop.NettopReader(nettop=path)({8080})
    assert reading.error is not None and reading.error.startswith("nettop output not understood: no CSV header")
    assert "\n" not in reading.error


def test_a_hung_nettop_is_ended_and_said(tmp_path):
    pid_file = tmp_path / "pid"
    path = fake_nettop(tmp_path, f"echo $$ > {pid_file}\nexec sleep 60")
    started = time.monotonic()
    reading = nettop.NettopReader(nettop=path, timeout=1.0)({8080})
    assert reading.error == "nettop timed out after 1s"
    assert time.monotonic() - started < 30
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_output_beyond_the_cap_is_refused_not_parsed_in_part(tmp_path, capture):
    path = fake_nettop(tmp_path, f"exec cat {capture}")
    reading = nettop.NettopReader(nettop=path, max_output=1000, own=set)({10808})
    assert reading.error == "nettop printed more than 1000 bytes" and reading.connections == ()


def test_an_unrunnable_nettop_is_one_line(tmp_path):
    path = tmp_path / "nettop"
    path.write_text("not a program")
    path.chmod(0o644)
    reading = nettop.NettopReader(nettop=str(path))({8080})
    assert reading.error == "nettop: Permission denied"


def test_own_client_ends_include_a_socket_this_process_holds():
    """Our own sockets, read without root (psutil on this process): a loopback connection
    made here shows as (address, port, server port)."""
    import socket

    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    try:
        port = server.getsockname()[1]
        assert ("127.0.0.1", client.getsockname()[1], port) in nettop.own_client_ends()
    finally:
        client.close()
        server.close()
