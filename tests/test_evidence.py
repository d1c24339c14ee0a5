"""The evidence seam: each source's answer between two instants, and the sources asked as one.

Kernel sight is driven here by readings as the kernel gives them (what a real server sent was
measured on 0.31.3 and 0.32.2: the response head is one segment of 248 bytes, a keepalive
comment 23 bytes, token events about 350 bytes a segment); tests/test_sight_real.py runs it
against the real server."""

from __future__ import annotations

import asyncio
import re
import os
import signal
import subprocess
import sys
import time

import pytest

from mlxwatch.evidence import Evidence, Stall, Window, combine
from mlxwatch.evidence.kernel import BUSY_CPU, KernelSource
from mlxwatch.evidence.sight import Sight
from mlxwatch.host.sockets import Connection, KernelCounters, Reading
from mlxwatch.serverlog.markers import prompt_advances

PORT = 8080


def conn(client_port: int, sent: int, segments: int | None, received: int = 300, own: bool = False,
         unsent: int = 0) -> Connection:
    return Connection(PORT, ("127.0.0.1", client_port), (client_port,), sent, received, segments, None, own,
                      unsent=unsent)


def closed(client_port: int, sent: int | None = None, received: int = 300) -> Connection:
    """What is left of a connection the server closed first: on Linux a TIME_WAIT remnant with no
    counts (``sent`` None), on macOS nettop's TimeWait row with them."""
    return Connection(PORT, ("127.0.0.1", client_port), (client_port,), sent or 0, received if sent else 0,
                      closed=True, counted=sent is not None)


class Readings:
    """A kernel that shows the given connections, one list per reading."""

    def __init__(self, *readings: list[Connection] | str) -> None:
        self.readings = list(readings)

    def __call__(self, ports) -> Reading:
        nxt = self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]
        if isinstance(nxt, str):
            return Reading(time.monotonic(), error=nxt)
        return Reading(time.monotonic(), tuple(nxt))


def source(*readings, quiet: float = 8.0, pid=None) -> KernelSource:
    return KernelSource(KernelCounters(Readings(*readings), max_age=0.0), PORT, lambda: quiet,
                        server_pid=lambda: pid, clock=lambda: 0.0)


def looks(src: KernelSource, *ends: float, start: float = 0.0, real_gap: float = 0.0) -> Evidence:
    """Readings at each of ``ends`` (``real_gap`` real seconds apart: CPU is measured in real
    time); the answer for (start, last end]."""
    for i, t in enumerate(ends):
        if i and real_gap:
            time.sleep(real_gap)
        src.sample(t)
    return src.answer(Window(start, ends[-1]))


def test_tokens_after_the_head_are_a_delivery():
    head, tokens = conn(5000, 248, 1), conn(5000, 248 + 700, 3)
    got = looks(source([conn(5000, 0, 0)], [head], [tokens]), 1.0, 2.0, 3.0)
    assert got.delivered == ("kernel: 700 bytes of tokens sent to clients in the last 3s",)
    assert got.progress == () and got.sees_all and got.last_flow == 3.0


def test_a_head_alone_is_no_delivery_a_livelock_admits_requests():
    """A livelocked server sends each new request its head and nothing more (measured)."""
    got = looks(source([conn(5000, 0, 0)], [conn(5000, 248, 1)], [conn(5000, 248, 1)]), 1.0, 2.0, 3.0)
    assert got.delivered == got.progress == () and got.last_flow is None


def test_keepalives_are_progress_not_delivery():
    """`: keepalive X/Y` comments (23 bytes each) while a prompt is read: progress, which holds
    a verdict only up to grace_ceiling, so a livelock that writes keepalives is still called."""
    got = looks(source([conn(5000, 248, 1)], [conn(5000, 271, 2)], [conn(5000, 317, 4)]), 1.0, 2.0, 3.0)
    assert got.delivered == () and got.progress == (
        "kernel: 2 keepalive write(s) to clients and no token in the last 3s",)


def test_without_segment_counts_size_alone_tells_tokens_from_keepalives():
    """macOS' nettop gives bytes only: 23 bytes is a keepalive, 350 a token event."""
    got = looks(source([conn(5000, 248, None)], [conn(5000, 271, None)]), 1.0, 2.0)
    assert got.progress and not got.delivered
    got = looks(source([conn(5000, 248, None)], [conn(5000, 600, None)]), 1.0, 2.0)
    assert got.delivered and not got.progress


def test_the_daemons_own_connections_and_new_ones_count_for_nothing():
    """Our probe's stream is judged by the probe; a connection first seen already sending is
    a baseline (what it got before is not known)."""
    own = [conn(5000, 248, 1, own=True)], [conn(5000, 5000, 15, own=True)]
    assert looks(source(*own), 1.0, 2.0).delivered == ()
    assert looks(source([], [conn(5001, 5000, 15)]), 1.0, 2.0).delivered == ()


def test_a_window_counts_only_what_came_inside_it():
    src = source([conn(5000, 248, 1)], [conn(5000, 948, 3)], [conn(5000, 948, 3)])
    assert looks(src, 1.0, 2.0, 3.0, start=2.0).delivered == ()  # the tokens came at 2.0, not after
    assert src.answer(Window(1.0, 3.0)).delivered


def test_streams_left_without_a_byte_for_the_quiet_window_are_a_stall():
    src = source([conn(5000, 248, 1), conn(5001, 948, 3)], [conn(5000, 248, 1), conn(5001, 1300, 4)],
                 [conn(5000, 248, 1), conn(5001, 1300, 4)], quiet=8.0)
    assert looks(src, 1.0, 2.0, 9.0).stall is None  # the last byte went at 2.0
    got = looks(src, 10.5)
    assert got.stall is not None and got.stall.event == "kernel_stall" and got.stall.since == 2.0
    assert "2 client stream(s) open, and no byte sent to any client for 8s" in got.stall.reason


def test_requests_waiting_on_an_idle_server_are_a_stall():
    """A blocked generation thread admits nothing new: the app's requests wait for their head
    while the server sits at 0 % CPU. That is owed, not hidden work."""
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        src = source([conn(5000, 0, 0)], quiet=1.0, pid=idle.pid)
        src.sample(0.0)
        time.sleep(0.3)
        src.sample(0.5)
        time.sleep(0.3)
        got = looks(src, 1.5)
        assert got.stall is not None and "1 request(s) waiting for an answer while the server idles" in got.stall.reason
        assert got.stall.journal["waiting"] == 1
    finally:
        idle.kill()
        idle.wait()


def test_no_stream_open_is_no_stall():
    assert looks(source([]), 1.0, 50.0).stall is None


def test_requests_waiting_for_their_head_hide_work_only_while_the_server_works():
    """A non-streaming answer is sent whole at its end: while such a request waits and the server
    uses CPU, nothing may be said to flow; a server at 0 % CPU (blocked) or stopped hides nothing."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        waiting = [conn(5000, 0, 0)]
        got = looks(source(waiting, pid=busy.pid), 0.0, 2.0, 4.0, real_gap=0.5)
        assert got.hidden_work and "1 request(s) waiting" in got.hidden_work
        assert got.quiet_for(4.0, since=0.0) is None
        got = looks(source(waiting, pid=idle.pid), 0.0, 2.0, 4.0, real_gap=0.5)
        assert got.hidden_work is None and got.quiet_for(4.0, since=0.0) == 4.0
        os.kill(busy.pid, signal.SIGSTOP)
        assert looks(source(waiting, pid=busy.pid), 0.0, 2.0, 4.0, real_gap=0.5).hidden_work is None
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()
    assert BUSY_CPU < 0.5


def test_an_answer_sent_whole_is_a_delivery_and_owes_nothing_until_the_next_request():
    """Measured with the official openai SDK (non-streaming) on a slow server: the answer's head
    and body left at its end, and the first growth of a connection was always taken for a
    head, so no answer was ever counted (1-2 false verdicts per 10 minutes). A pooled
    keep-alive connection then sat 'owed' for ever."""
    waiting, whole = conn(5000, 0, 0), conn(5000, 248 + 650, 2)
    got = looks(source([waiting], [whole]), 1.0, 2.0)
    assert got.delivered == ("kernel: 1 answer(s) to clients completed in the last 2s (a non-streamed answer goes "
                             "out whole at its end)",)
    assert got.last_flow == 2.0 and got.detail["kernel"]["streams"] == 0
    src = source([waiting], [whole], [whole], [conn(5000, 898, 2, received=600)])
    assert looks(src, 1.0, 2.0, 30.0).stall is None  # answered: idle on its keep-alive connection, owed nothing
    assert looks(src, 32.0, 34.0).detail["kernel"]["waiting_request_bytes"] == [300]  # its next request waits


def test_a_head_with_keepalives_behind_it_is_still_only_a_head():
    """A livelock admits requests and may write keepalives: never a delivery, however the
    readings fall (the head, 248 bytes, and four 23-byte keepalives in one reading)."""
    got = looks(source([conn(5000, 0, 0)], [conn(5000, 248 + 4 * 23, 5)]), 1.0, 2.0)
    assert got.delivered == () and got.detail["kernel"]["streams"] == 1
    assert looks(source([conn(5000, 0, None)], [conn(5000, 248 + 10 * 23, None)]), 1.0, 2.0).delivered == ()


def test_a_request_the_server_answered_and_closed_between_two_readings_is_a_delivery():
    """mlx-lm closes the connection after every answer: on Linux what is left is the server end's
    TIME_WAIT remnant, with no byte counts. A waiting request whose connection the server closed
    was answered; one whose client gave up leaves no remnant on the server's side."""
    waiting = [conn(5000, 0, 0)]
    got = looks(source(waiting, [closed(5000)]), 1.0, 2.0)
    assert got.delivered and "1 answer(s) to clients completed" in got.delivered[0] and got.last_flow == 2.0
    assert looks(source(waiting, []), 1.0, 2.0).delivered == ()  # the client closed first
    assert looks(source([], [closed(5000)]), 1.0, 2.0).delivered == ()  # opened and closed unseen: not inferred
    # a stream whose head went out, then ended by the server: its end was delivered
    assert looks(source([conn(5000, 248, 1)], [conn(5000, 248, 1)], [closed(5000)]), 1.0, 2.0, 3.0).delivered
    # macOS keeps the counts: a head-sized error and a close is no answer, a whole one is
    assert looks(source(waiting, [closed(5000, sent=230)]), 1.0, 2.0).delivered == ()
    assert looks(source(waiting, [closed(5000, sent=900)]), 1.0, 2.0).delivered


def test_a_server_process_that_died_answered_nothing_by_closing():
    """A dying process closes every connection (a FIN, a TIME_WAIT remnant): no answer."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert looks(source([conn(5000, 0, 0)], [closed(5000)], pid=gone.pid), 1.0, 2.0).delivered == ()


def test_connections_a_restart_closed_are_no_answers():
    """A restart kills the server: the kernel closes its connections as if it had answered them
    (FIN, then TIME_WAIT). Read as answers, they would verify a restart that did not work. The
    connections seen before the server's PID changed are the old server's; the new one's count."""
    pid = {"now": os.getpid()}
    src = KernelSource(KernelCounters(Readings([conn(5000, 0, 0)], [conn(5000, 0, 0)], [closed(5000), conn(5001, 0, 0)],
                                               [closed(5001)]), max_age=0.0),
                       PORT, lambda: 8.0, server_pid=lambda: pid["now"], clock=lambda: 0.0)
    src.sample(1.0)
    pid["now"] = None  # restarted: the watcher forgets the old server until the new one answers
    src.sample(2.0)
    src.sample(3.0)
    assert src.answer(Window(0.0, 3.0)).delivered == ()
    src.sample(4.0)
    assert src.answer(Window(3.0, 4.0)).delivered  # the new server's answer


def test_a_connection_that_never_sent_a_byte_is_no_waiting_request():
    """Measured: 5 connections that never sent a byte made a healthy, idle server draw a false
    stall alert, and under a livelock (CPU busy) they were hidden work: the early end was
    withheld and the verdict took 160 s instead of 31 s."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        silent = [conn(5000 + i, 0, 0, received=0) for i in range(5)]
        got = looks(source(silent, quiet=1.0, pid=idle.pid), 0.0, 2.0, 4.0, real_gap=0.3)
        assert got.stall is None and got.detail["kernel"]["waiting"] == 0
        got = looks(source(silent, pid=busy.pid), 0.0, 2.0, 4.0, real_gap=0.5)
        assert got.hidden_work is None and got.quiet_for(4.0, since=0.0) == 4.0
    finally:
        for p in (busy, idle):
            p.kill()
            p.wait()


def test_a_client_that_reads_slowly_is_owed_nothing_the_server_wrote():
    """Measured: a client reading slowly drew a false stall alert while the probe was healthy.
    The server's writes wait in the socket's send queue (``unsent``): they count as written, and
    a stream whose client leaves them unread is owed nothing."""
    src = source([conn(5000, 248, 1)], [conn(5000, 248, 1, unsent=4000)], [conn(5000, 248, 1, unsent=4000)],
                 quiet=8.0)
    got = looks(src, 1.0, 2.0, 20.0)
    assert got.stall is None and got.last_flow == 2.0
    assert got.detail["kernel"]["slow_readers"] == 1


def test_the_detail_has_each_waiting_requests_size_and_each_streams_age():
    """For the cadence: how big each waiting request is (a prompt-length hint) and how long ago
    each open stream's head went out."""
    src = source([conn(5000, 0, 0, received=4000), conn(5001, 0, 0, received=0), conn(5002, 0, 0)],
                 [conn(5000, 0, 0, received=4000), conn(5001, 0, 0, received=0), conn(5002, 248, 1)])
    got = looks(src, 1.0, 3.0)
    kernel = got.detail["kernel"]
    assert kernel["waiting_request_bytes"] == [4000] and kernel["stream_heads_ago"] == [0.0]
    assert {"connections", "streams", "waiting", "last_flow_ago", "cpu"} <= set(kernel)
    assert src.answer(Window(0.0, 7.5)).detail["kernel"]["stream_heads_ago"] == [4.5]


def test_sight_unavailable_is_a_note_and_no_claim_to_see_everyone():
    got = looks(source("sock_diag unavailable: PermissionError: refused"), 1.0)
    assert got.notes == ("kernel sight unavailable (sock_diag unavailable: PermissionError: refused): "
                         "judging by the probe's rules",)
    assert not got.sees_all and got.quiet_for(10.0, since=0.0) is None


def test_quiet_is_counted_from_the_later_of_the_last_flow_and_since():
    e = Evidence(last_flow=5.0, sees_all=True)
    assert e.quiet_for(12.0, since=3.0) == 7.0 and e.quiet_for(12.0, since=10.0) == 2.0
    assert Evidence(last_flow=5.0).quiet_for(12.0, since=0.0) is None  # nobody sees every client


class _Answer:
    def __init__(self, evidence: Evidence, name: str) -> None:
        self.evidence, self.name = evidence, name

    async def look(self, window: Window) -> Evidence:
        return self.evidence

    async def prime(self) -> None:
        return None


def test_a_stall_is_void_once_another_source_saw_work_after_it_began():
    """The app's streams paused while the log shows a long prompt advancing: not a stall."""
    stall = Stall("kernel: 1 client stream(s) open ...", ("kernel", 2.0), since=2.0)
    kernel = _Answer(Evidence(stall=stall, last_flow=2.0, sees_all=True), "kernel")
    log = _Answer(Evidence(progress=("log: prompt processing advanced",), last_flow=6.0), "log")
    assert asyncio.run(Sight([kernel, log]).look(Window(0.0, 11.0))).stall is None
    quiet_log = _Answer(Evidence(last_flow=1.0), "log")
    assert asyncio.run(Sight([kernel, quiet_log]).look(Window(0.0, 11.0))).stall == stall


def test_combined_answers_keep_every_line_and_the_tightest_cut():
    a = Evidence(delivered=("a",), last_flow=3.0, cut_after=10.0)
    b = Evidence(progress=("b",), last_flow=5.0, sees_all=True, cut_after=4.0)
    both = combine([a, b])
    assert both.delivered == ("a",) and both.progress == ("b",) and both.last_flow == 5.0
    assert both.sees_all and both.cut_after == 4.0


def test_prompts_of_the_same_size_are_new_work_after_each_prompt_cache_line():
    """A cached prompt logs `1/1` each time: the second one counted for nothing (measured), so a
    server reading one short prompt after another looked idle."""
    lines = ["INFO - Prompt Cache: 1 sequences, 0.00 GB", "INFO - Prompt processing progress: 1/1",
             "INFO - Prompt Cache: 2 sequences, 0.00 GB", "INFO - Prompt processing progress: 1/1"]
    assert prompt_advances(lines, {}, set())[0] == [(1, 1), (1, 1)]
    # the same prompt's last chunk logged twice, with no new request between: once
    assert prompt_advances(["Prompt processing progress: 8/8", "Prompt processing progress: 8/8"], {}, set())[0] == [(8, 8)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sock_diag is Linux's")
def test_the_linux_reader_sees_bytes_sent_and_tells_our_own_client_ends():
    """A real socket pair on loopback: the server end's bytes_sent as the kernel counts it, and
    the client end, ours, marked own (the kernel gives both ends: sock_diag sees every socket)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    server, _ = listener.accept()
    try:
        server.sendall(b"x" * 1000)
        reading = KernelCounters(max_age=0.0).read(port)
        assert reading.error is None, reading.error
        [c] = reading.connections
        assert c.bytes_sent == 1000 and c.segments_out == 1 and c.own
        assert c.client == ("127.0.0.1", client.getsockname()[1])
    finally:
        for s in (client, server, listener):
            s.close()


async def _late_server(delay: float):
    """A server that sends a stream's head at once and its one token ``delay`` s later."""
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(delay)
        writer.write(b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\ndata: [DONE]\n\n')
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_probe_cut_short_fails_at_once_and_its_stream_is_read_on():
    """The watcher's evidence says nothing flows: the probe fails now, as at its deadline, with
    the reason, and keeps reading its stream to ``read_until``."""
    import httpx

    from mlxwatch.probes.generation import Failure, probe_generation

    server, url = await _late_server(2.0)
    async with server, httpx.AsyncClient(trust_env=False) as client:
        cut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.3, cut.set_result, "nothing sent to any client for 8s")
        started = time.monotonic()
        result = await probe_generation(client, url, first_token_timeout=30.0, timeout=60.0, read_until=5.0, cut=cut)
        assert time.monotonic() - started < 5.0
        assert result.failure == Failure.NO_FIRST_TOKEN and "nothing sent to any client for 8s" in result.detail
        # found by a new user: the early end read as if it were the first-token timeout ("1.0s")
        assert re.match(r"the wait ended early, after [0-9.]+s of 30s: ", result.detail), result.detail
        assert result.lingering is not None
        await result.lingering
        assert result.late_tokens == 1  # read on: the late token is a delivery


async def test_read_on_keeps_a_failed_probes_stream_open_past_its_bound():
    """Measured on main: the probe's first token came just after its `timeout`, onto a
    connection the daemon had closed. While the server shows work the watcher moves the bound."""
    import httpx

    from mlxwatch.probes.generation import probe_generation

    for hold, expected in ((False, 0), (True, 1)):
        server, url = await _late_server(2.0)
        async with server, httpx.AsyncClient(trust_env=False) as client:
            result = await probe_generation(client, url, first_token_timeout=0.3, timeout=1.0, read_until=1.0)
            assert result.lingering is not None
            if hold:
                result.read_on(asyncio.get_running_loop().time() + 10.0)
            await result.lingering
            assert result.late_tokens == expected, hold
