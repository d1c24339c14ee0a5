"""Lingering: a probe that gives up at a deadline must not leave an orphan generation behind.

mlx-lm notices a closed stream only when it next writes to it, so closing an abandoned probe
does not take its work back: the server still generates the reply (ahead of the next probe) and
then logs a BrokenPipeError. With ``linger`` the probe reads the abandoned stream to its end in
the background instead. A loopback stand-in server plays the slow server and records, on its own
side, whether it wrote its whole reply or saw the client go away first.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import tracemalloc
from collections.abc import Awaitable, Callable

import httpx
import pytest

from mlxwatch.probes import Failure, probe_generation, run_check
from mlxwatch.probes.generation import LINGER_MAX_BYTES

FIRST, TOTAL = 0.5, 1.0
SLACK = 0.5  # scheduling allowance on a loaded 2-core CI machine
BOUND = 15.0  # generous bound for anything we wait on


def chunk(content=None, finish=None):
    delta = {"role": "assistant"}
    if content is not None:
        delta["content"] = content
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


FINISH = chunk(finish="length") + b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n' + b"data: [DONE]\n\n"


class Conn:
    """One generation request as the stand-in server saw it."""

    def __init__(self, writer: asyncio.StreamWriter, go: asyncio.Event) -> None:
        self.writer = writer
        self.go = go  # set by the test: "the probe has its verdict, now send the late part"
        self.t0 = time.monotonic()
        self.written = 0
        self.completed = False  # the whole scripted reply was written and the server closed
        self.error: str | None = None  # what writing raised (BrokenPipeError, ConnectionResetError)
        self.client_gone = asyncio.Event()  # the client closed its side before the reply was complete
        self.client_gone_after: float | None = None  # seconds after the request arrived
        self.ended = asyncio.Event()

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()
        self.written += len(data)


Script = Callable[[Conn], Awaitable[None]]


class StandIn:
    """A loopback HTTP/1.1 server, mlx-lm style (no content length, close-delimited body)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.posts: list[Conn] = []
        self.go = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> StandIn:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def conn(self) -> Conn:
        await until(lambda: self.posts)
        return self.posts[0]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._tasks.add(asyncio.current_task())
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n"
                             b"connection: close\r\n\r\n{\"status\":\"ok\"}")
                await writer.drain()
                return
            length = re.search(rb"content-length: *(\d+)", head, re.I)
            await reader.readexactly(int(length[1]) if length else 0)
            conn = Conn(writer, self.go)
            self.posts.append(conn)
            watcher = asyncio.create_task(self._watch(reader, conn))
            try:
                await conn.send(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
                await self.script(conn)
                conn.completed = not conn.client_gone.is_set()
            except (ConnectionError, OSError) as exc:
                conn.error = type(exc).__name__
            finally:
                watcher.cancel()
                conn.ended.set()
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, OSError):
                pass
            self._tasks.discard(asyncio.current_task())

    @staticmethod
    async def _watch(reader: asyncio.StreamReader, conn: Conn) -> None:
        """The client sends nothing after its request: EOF (or a reset) means it went away."""
        try:
            while await reader.read(65536):
                pass
        except (ConnectionError, OSError):
            pass
        conn.client_gone_after = time.monotonic() - conn.t0
        conn.client_gone.set()


async def until(predicate: Callable[[], object], bound: float = BOUND) -> None:
    async with asyncio.timeout(bound):
        while not predicate():
            await asyncio.sleep(0.01)


async def probe(server: StandIn, client: httpx.AsyncClient, **kw):
    t0 = time.monotonic()
    result = await probe_generation(client, server.url, first_token_timeout=FIRST, timeout=TOTAL, **kw)
    return result, time.monotonic() - t0


async def test_late_first_token_is_read_to_the_end_while_lingering():
    """First token after 2 s, first-token timeout 0.5 s, linger 5: the verdict comes at 0.5 s, and the
    server still writes its whole reply to a reader, with no broken pipe."""

    async def slow(conn: Conn) -> None:
        await asyncio.sleep(2.0)
        await conn.send(chunk("OK"))
        await conn.send(FINISH)

    async with StandIn(slow) as server, httpx.AsyncClient() as client:
        result, elapsed = await probe(server, client, linger=5.0)
        assert result.failure == Failure.NO_FIRST_TOKEN and FIRST <= elapsed < FIRST + SLACK
        assert result.lingering is not None and not result.lingering.done()
        assert result.late_finished is None  # still lingering
        await asyncio.wait_for(result.lingering, BOUND)
        conn = await server.conn()
        await asyncio.wait_for(conn.ended.wait(), BOUND)
        assert conn.completed and conn.error is None and not conn.client_gone.is_set()
        assert result.late_finished is True and result.late_tokens == 1 and result.late_bytes > 0
        # The verdict stayed what it was when the probe returned.
        assert result.failure == Failure.NO_FIRST_TOKEN and result.tokens == 0 and result.ttft is None
        assert result.to_dict()["late_finished"] is True and "lingering" not in result.to_dict()
        ends = [e for e in result.transcript if e["kind"] == "linger_end"]
        assert len(ends) == 1 and "ended the stream" in ends[0]["text"]


async def test_stalled_stream_lingers_until_the_server_finishes():
    """A stall verdict lingers too: the rest of the reply counts as late, the judged tokens stay."""

    async def stall(conn: Conn) -> None:
        await conn.send(chunk("a"))
        await conn.go.wait()
        await conn.send(chunk("b") + chunk("c") + FINISH)

    async with StandIn(stall) as server, httpx.AsyncClient() as client:
        result, elapsed = await probe(server, client, linger=5.0)
        assert result.failure == Failure.STALLED and TOTAL <= elapsed < TOTAL + SLACK
        server.go.set()
        await asyncio.wait_for(result.lingering, BOUND)
        conn = await server.conn()
        await asyncio.wait_for(conn.ended.wait(), BOUND)
        assert conn.completed and not conn.client_gone.is_set()
        assert result.tokens == 1 and result.late_tokens == 2 and result.late_finished is True


async def test_without_linger_the_stream_is_closed_at_the_deadline():
    """linger 0 (the default): the connection is closed at the verdict and the server sees it."""

    async def never(conn: Conn) -> None:
        await conn.go.wait()

    async with StandIn(never) as server, httpx.AsyncClient() as client:
        result, elapsed = await probe(server, client, linger=0)
        assert result.failure == Failure.NO_FIRST_TOKEN and elapsed < FIRST + SLACK
        assert result.lingering is None and result.late_finished is None and result.late_bytes == 0
        conn = await server.conn()
        await asyncio.wait_for(conn.client_gone.wait(), BOUND)
        assert conn.client_gone_after < FIRST + SLACK


async def test_cancelling_the_lingering_task_closes_the_connection():
    """While lingering the stream is held open (the server's keepalives are still read); cancelling
    the task closes it."""

    async def keepalives(conn: Conn) -> None:
        while True:
            await conn.send(b": keepalive 1/2\n\n")
            await asyncio.sleep(0.05)

    async with StandIn(keepalives) as server, httpx.AsyncClient() as client:
        result, _ = await probe(server, client, linger=60.0)
        assert result.failure == Failure.NO_FIRST_TOKEN and result.lingering is not None
        seen = result.late_bytes
        await until(lambda: result.late_bytes > seen)  # still reading after the verdict
        conn = await server.conn()
        assert not conn.client_gone.is_set()
        result.lingering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await result.lingering
        await asyncio.wait_for(conn.client_gone.wait(), BOUND)
        assert result.late_finished is False
        assert result.transcript[-1]["kind"] == "linger_end" and "cancelled" in result.transcript[-1]["text"]


async def test_a_stream_that_never_ends_is_cut_at_linger():
    """Tokens forever, all after the first-token deadline: lingering stops at ``linger`` seconds."""
    linger = 1.5

    async def forever(conn: Conn) -> None:
        await conn.go.wait()
        while True:
            await conn.send(chunk("x"))
            await asyncio.sleep(0.05)

    async with StandIn(forever) as server, httpx.AsyncClient() as client:
        result, _ = await probe(server, client, linger=linger)
        assert result.failure == Failure.NO_FIRST_TOKEN
        server.go.set()
        await asyncio.wait_for(result.lingering, BOUND)  # finishes by itself: never raises
        end = result.transcript[-1]
        assert end["kind"] == "linger_end" and "1.5s of lingering passed" in end["text"]
        lingered = end["t"] - result.total  # both on the probe's clock: verdict -> stream closed
        assert linger <= lingered < linger + SLACK
        conn = await server.conn()
        await asyncio.wait_for(conn.client_gone.wait(), BOUND)
        assert not conn.completed and conn.client_gone_after < result.total + linger + SLACK
        assert result.late_finished is False and result.late_tokens > 5


async def test_a_fifty_megabyte_late_body_is_not_buffered():
    """50 MB arriving after the verdict: read and discarded up to the byte cap, then the stream is
    closed; the lingering reader's memory stays small."""
    piece = chunk("x") * (65536 // len(chunk("x")))
    pieces = 50 * 1024 * 1024 // len(piece)

    async def flood(conn: Conn) -> None:
        await conn.go.wait()
        for _ in range(pieces):
            await conn.send(piece)

    async with StandIn(flood) as server, httpx.AsyncClient() as client:
        result, _ = await probe(server, client, linger=60.0)
        assert result.failure == Failure.NO_FIRST_TOKEN and result.lingering is not None
        tracemalloc.start()
        try:
            server.go.set()
            await asyncio.wait_for(result.lingering, BOUND)  # ends at the byte cap, long before 60 s
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 8 * 1024 * 1024
        assert LINGER_MAX_BYTES < result.late_bytes <= LINGER_MAX_BYTES + 65536
        assert result.late_finished is False and result.late_tokens > 0
        conn = await server.conn()
        await asyncio.wait_for(conn.ended.wait(), BOUND)
        assert not conn.completed and conn.written < 50 * 1024 * 1024


async def test_cancelling_the_probe_closes_its_stream():
    """The probe's caller cancels it mid-stream: CancelledError propagates and the stream is closed."""

    async def never(conn: Conn) -> None:
        await conn.go.wait()

    async with StandIn(never) as server, httpx.AsyncClient() as client:
        task = asyncio.create_task(probe_generation(client, server.url, first_token_timeout=30, timeout=60,
                                                    linger=30))
        conn = await server.conn()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(conn.client_gone.wait(), BOUND)


async def test_run_check_passes_linger_and_exposes_the_task():
    """``run_check(..., linger=)`` lingers the generation probe; ``report.lingering`` is its task."""

    async def slow(conn: Conn) -> None:
        await conn.go.wait()
        await conn.send(chunk("OK") + FINISH)

    async with StandIn(slow) as server, httpx.AsyncClient() as client:
        report = await run_check(client, server.url, first_token_timeout=FIRST, timeout=TOTAL,
                                 endpoint_timeout=0.5, linger=5.0)
        assert report.failure == Failure.NO_FIRST_TOKEN and report.health.status == 200
        assert report.lingering is not None and report.lingering is report.generation.lingering
        server.go.set()
        await asyncio.wait_for(report.lingering, BOUND)
        assert report.generation.late_finished is True
        assert report.to_dict()["generation"]["late_tokens"] == 1
