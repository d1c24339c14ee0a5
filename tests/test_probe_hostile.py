"""The generation probe against servers that misbehave in every way a real one might.

respx stands in for the edges a real mlx_lm.server cannot produce on demand (garbage, endless
bodies, silence after headers); the real server is exercised in test_check_real.py. Each case
asserts the verdict, that the probe returned by its deadline, and that memory stayed bounded.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import respx

from mlxwatch.probes import Failure, probe_generation, run_check
from mlxwatch.probes.generation import MAX_BODY_BYTES, MAX_TRANSCRIPT_EVENTS

URL = "http://127.0.0.1:8999"
FIRST, TOTAL = 0.5, 1.0
SLACK = 0.5  # scheduling allowance on a loaded 2-core CI machine


def chunk(content=None, finish=None):
    delta = {"role": "assistant"}
    if content is not None:
        delta["content"] = content
    body = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


class Stream(httpx.AsyncByteStream):
    """Yield byte pieces, optionally pausing (or pausing forever) between them."""

    def __init__(self, *pieces, pause=0.0, then_hang=False, forever=None):
        self.pieces, self.pause, self.then_hang, self.forever = pieces, pause, then_hang, forever

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece
            await asyncio.sleep(self.pause)
        if self.forever is not None:
            while True:
                yield self.forever
                await asyncio.sleep(self.pause)
        if self.then_hang:
            await asyncio.sleep(3600)


def sse(stream, status=200, content_type="text/event-stream"):
    return httpx.Response(status, headers={"content-type": content_type}, stream=stream)


async def probe(**kw):
    async with httpx.AsyncClient() as client:
        t0 = time.monotonic()
        kw = {"first_token_timeout": FIRST, "timeout": TOTAL, **kw}
        result = await probe_generation(client, URL, **kw)
        return result, time.monotonic() - t0


def mock(response_or_effect):
    route = respx.post(f"{URL}/v1/chat/completions")
    if callable(response_or_effect):
        route.mock(side_effect=response_or_effect)
    else:
        route.mock(return_value=response_or_effect)
    return route


@respx.mock
async def test_healthy_stream_records_timings_and_tokens():
    """Four tokens then finish and [DONE]: healthy, with TTFT, three gaps and the usage count."""
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\n'
    mock(sse(Stream(b": keepalive 10/25\n\n", *(chunk("t") for _ in range(4)), chunk(finish="length"),
                    usage, b"data: [DONE]\n\n", pause=0.01)))
    result, elapsed = await probe()
    assert result.ok and result.failure is None and result.reason == "ok"
    assert result.tokens == 4 and result.completion_tokens == 4
    assert result.finish_reason == "length"
    assert len(result.gaps) == 3 and result.ttft is not None and result.ttft <= result.total
    assert [(k.processed, k.total) for k in result.keepalives] == [(10, 25)]
    sent = json.loads(respx.calls.last.request.content)
    assert sent["stream"] is True and sent["max_tokens"] == 4 and sent["temperature"] == 0.0
    assert "seed" not in sent  # a seed would make the probe non-batchable: it would queue behind real work


@respx.mock
async def test_accepts_and_says_nothing():
    """No headers ever: no_first_token at the first-token deadline."""

    async def silent(request):
        await asyncio.sleep(3600)

    mock(silent)
    result, elapsed = await probe()
    assert result.failure == Failure.NO_FIRST_TOKEN and result.status is None
    assert "no response headers" in result.detail
    assert FIRST <= elapsed < FIRST + SLACK


@respx.mock
async def test_headers_then_nothing():
    """200 and SSE headers, then silence: no_first_token, and the status is recorded."""
    mock(sse(Stream(then_hang=True)))
    result, elapsed = await probe()
    assert result.failure == Failure.NO_FIRST_TOKEN and result.status == 200
    assert FIRST <= elapsed < FIRST + SLACK


@respx.mock
async def test_endless_keepalives_do_not_count_as_tokens():
    """Keepalive comments forever (prompt processing that never ends) are progress, not delivery."""
    mock(sse(Stream(forever=b": keepalive 5/10\n\n", pause=0.001)))
    result, elapsed = await probe()
    assert result.failure == Failure.NO_FIRST_TOKEN
    assert result.tokens == 0 and len(result.keepalives) > 10
    assert len(result.transcript) <= MAX_TRANSCRIPT_EVENTS
    assert elapsed < FIRST + SLACK


@respx.mock
async def test_tokens_then_stall():
    """Two tokens, then silence: stalled at the whole-stream deadline, tokens counted."""
    mock(sse(Stream(chunk("a"), chunk("b"), then_hang=True)))
    result, elapsed = await probe()
    assert result.failure == Failure.STALLED and result.tokens == 2
    assert TOTAL <= elapsed < TOTAL + SLACK


@respx.mock
async def test_trickle_of_tokens_past_total_timeout_is_stalled():
    """A token every 0.3 s forever: first token in time, but the stream never finishes."""
    mock(sse(Stream(forever=chunk("x"), pause=0.3)))
    result, elapsed = await probe()
    assert result.failure == Failure.STALLED and result.tokens >= 2
    assert elapsed < TOTAL + SLACK


@pytest.mark.parametrize("body, detail", [
    (b"data: {not json\n\n", "data is not JSON"),
    (b"data: [1, 2]\n\n", "not a JSON object"),
    (b'data: {"id": 1}\n\n', "chunk without a choices list"),
    (b"<html>oops</html>\n", "not an SSE line"),
])
@respx.mock
async def test_malformed_stream(body, detail):
    """Garbage where SSE JSON should be: malformed, at once, naming what was wrong."""
    mock(sse(Stream(body, then_hang=True)))
    result, elapsed = await probe()
    assert result.failure == Failure.MALFORMED and detail in result.detail
    assert elapsed < FIRST


@respx.mock
async def test_error_json_with_200_in_stream():
    """An error object inside a 200 stream is a server error, not a token."""
    mock(sse(Stream(b'data: {"error": "Missing 627 parameters"}\n\n', then_hang=True)))
    result, _ = await probe()
    assert result.failure == Failure.SERVER_ERROR and "Missing 627 parameters" in result.detail


@respx.mock
async def test_error_json_with_200_without_sse_framing():
    """A bare JSON error body with 200 (no data: prefix) is read as the error it is."""
    mock(httpx.Response(200, json={"error": "generation thread died"}))
    result, _ = await probe()
    assert result.failure == Failure.THREAD_DIED


@respx.mock
async def test_thread_died_404_as_sent_by_mlx_lm_032():
    """mlx-lm 0.32 answers 404 {"error": "generation thread died"} once the thread is gone."""
    mock(httpx.Response(404, json={"error": "generation thread died"}))
    result, _ = await probe()
    assert result.failure == Failure.THREAD_DIED and result.status == 404


@respx.mock
async def test_other_http_error():
    """A 500 is an HTTP error with the status and body in the detail."""
    mock(httpx.Response(500, text="Internal Server Error"))
    result, _ = await probe()
    assert result.failure == Failure.HTTP_ERROR and "HTTP 500: Internal Server Error" in result.detail


@respx.mock
async def test_ten_megabyte_body_is_cut_off():
    """A 10 MB stream of valid-looking lines is refused after the body limit; memory stays bounded."""
    line = b": keepalive 1/2\n\n" * 4096  # ~70 KB a piece, 10 MB in all
    mock(sse(Stream(*([line] * 150))))
    result, _ = await probe(first_token_timeout=60, timeout=60)  # cut by size, never by a loaded machine's clock
    assert result.failure == Failure.TOO_LARGE
    assert result.body_bytes <= MAX_BODY_BYTES + len(line)


@respx.mock
async def test_ten_megabyte_line_without_newline():
    """One endless line (no newline) is malformed once it passes the line limit, not buffered whole."""
    mock(sse(Stream(*([b"x" * 65536] * 160))))
    result, _ = await probe(first_token_timeout=60, timeout=60)
    assert result.failure in (Failure.MALFORMED, Failure.TOO_LARGE)
    assert result.body_bytes <= MAX_BODY_BYTES + 65536


@respx.mock
async def test_done_without_tokens_and_close_without_done():
    """[DONE] before any token, and a stream that ends without [DONE], are both disconnections."""
    mock(sse(Stream(b"data: [DONE]\n\n")))
    first, _ = await probe()
    assert first.failure == Failure.DISCONNECTED and "[DONE] before any token" in first.detail
    respx.clear()
    mock(sse(Stream(chunk("a"))))
    second, _ = await probe()
    assert second.failure == Failure.DISCONNECTED and "without [DONE]" in second.detail


@respx.mock
async def test_immediate_stop_is_a_delivery():
    """A model that stops at once (finish chunk, no content) still delivered: healthy."""
    mock(sse(Stream(chunk(finish="stop"), b"data: [DONE]\n\n")))
    result, _ = await probe()
    assert result.ok and result.tokens == 0 and result.ttft is not None


@respx.mock
async def test_check_names_thread_death_from_health_503():
    """Probe fails and /health says 503 (mlx-lm >= 0.32): the check's reason is a dead thread."""
    mock(sse(Stream(then_hang=True)))
    respx.get(f"{URL}/health").mock(return_value=httpx.Response(503, json={"status": "unavailable"}))
    respx.get(f"{URL}/v1/models").mock(return_value=httpx.Response(200, json={"data": []}))
    async with httpx.AsyncClient() as client:
        report = await run_check(client, URL, first_token_timeout=FIRST, timeout=TOTAL, endpoint_timeout=0.5)
    assert not report.healthy and report.failure == Failure.THREAD_DIED
    assert report.models.status == 200 and "generation thread died" in report.reason


@respx.mock
async def test_slow_endpoint_times_out_on_its_own_deadline():
    """/v1/models that never answers is recorded as timed out within the endpoint timeout."""

    async def silent(request):
        await asyncio.sleep(3600)

    mock(sse(Stream(chunk("a"), chunk(finish="length"), b"data: [DONE]\n\n")))
    respx.get(f"{URL}/health").mock(return_value=httpx.Response(200, json={"status": "ok"}))
    respx.get(f"{URL}/v1/models").mock(side_effect=silent)
    async with httpx.AsyncClient() as client:
        t0 = time.monotonic()
        report = await run_check(client, URL, first_token_timeout=FIRST, timeout=TOTAL, endpoint_timeout=0.3)
    assert report.healthy
    assert report.models.status is None and report.models.error == "timed out after 0.3s"
    assert time.monotonic() - t0 < 0.3 + SLACK


async def test_connection_refused_is_named():
    """Nothing listening: connect_refused, at once."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again before the probe: nothing listens there
    async with httpx.AsyncClient() as client:
        result = await probe_generation(client, f"http://127.0.0.1:{port}", first_token_timeout=FIRST, timeout=TOTAL)
    assert result.failure == Failure.CONNECT_REFUSED


async def test_real_socket_that_accepts_and_never_answers():
    """A real loopback listener that reads the request and says nothing: bounded no_first_token."""
    hold = []

    async def accept(reader, writer):
        hold.append(writer)
        await reader.read(65536)
        await asyncio.sleep(3600)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient() as client:
            t0 = time.monotonic()
            result = await probe_generation(client, f"http://127.0.0.1:{port}", first_token_timeout=FIRST, timeout=TOTAL)
        assert result.failure == Failure.NO_FIRST_TOKEN and result.status is None
        assert time.monotonic() - t0 < FIRST + SLACK
    finally:
        for writer in hold:
            writer.close()
        server.close()


def data(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


# Reply chunks of every wrong shape a broken server or proxy might send. Each must end the probe at
# once as malformed, naming what was wrong; before issue 11 several of these raised out of the probe
# (AttributeError, RecursionError) and killed the daemon's watcher task, others passed as tokens.
HOSTILE_CHUNKS = [
    pytest.param(data('{"choices": [{"delta": "hi"}]}'), "delta is a string, not an object", id="delta-string"),
    pytest.param(data('{"choices": [{"delta": ["hi"]}]}'), "delta is a list, not an object", id="delta-list"),
    pytest.param(data('{"choices": [{"delta": 7}]}'), "delta is a number, not an object", id="delta-number"),
    pytest.param(data('{"choices": [{"delta": {"content": 5}}]}'), "delta.content is a number", id="content-number"),
    pytest.param(data('{"choices": [{"delta": {"content": {"text": "hi"}}}]}'), "delta.content is an object",
                 id="content-object"),
    pytest.param(data('{"choices": [{"delta": {"reasoning": ["x"]}}]}'), "delta.reasoning is a list",
                 id="reasoning-list"),
    pytest.param(data('{"choices": [{"delta": {"tool_calls": "call"}}]}'), "delta.tool_calls is a string",
                 id="tool-calls-string"),
    pytest.param(data('{"choices": ["hi"]}'), "choice is a string, not an object", id="choice-string"),
    pytest.param(data('{"choices": [null]}'), "choice is null, not an object", id="choice-null"),
    pytest.param(data('{"choices": {"0": {"delta": {"content": "hi"}}}}'), "choices is an object, not a list",
                 id="choices-object"),
    pytest.param(data('{"choices": "hi"}'), "choices is a string, not a list", id="choices-string"),
    pytest.param(data('{"choices": [], "usage": "lots"}'), "usage is a string, not an object", id="usage-string"),
    pytest.param(data('{"choices": [], "usage": {"completion_tokens": "4"}}'),
                 "usage.completion_tokens is a string", id="usage-count-string"),
    pytest.param(data('{"choices": [], "usage": {"completion_tokens": true}}'),
                 "usage.completion_tokens is a boolean", id="usage-count-bool"),
    pytest.param(data('{"choices": [{"delta": {}, "finish_reason": 1}]}'), "finish_reason is a number",
                 id="finish-number"),
    pytest.param(data('{"choices": [{"delta": {}, "finish_reason": {"type": "stop"}}]}'),
                 "finish_reason is an object", id="finish-object"),
    pytest.param(data('{"error": 42}'), "error is a number, not a message or an object", id="error-number"),
    pytest.param(data('{"error": ["generation thread died"]}'), "error is a list", id="error-list"),
    pytest.param(data('{"error": true}'), "error is a boolean", id="error-bool"),
    pytest.param(data("[" * 50_000), "nested too deeply", id="json-nested-50k-deep"),
    pytest.param(b'{"error": 7}\n', "error is a number", id="plain-line-error-number"),
]


@pytest.mark.parametrize("body, detail", HOSTILE_CHUNKS)
@respx.mock
async def test_hostile_chunk_shapes_are_malformed(body, detail):
    """Each wrong shape is a malformed verdict at once, never an exception, never a token."""
    mock(sse(Stream(body, then_hang=True)))
    result, elapsed = await probe()
    assert result.failure == Failure.MALFORMED, result.reason
    assert detail in result.detail
    assert result.tokens == 0 and result.ttft is None
    assert elapsed < FIRST


@pytest.mark.parametrize("body, failure, detail", [
    pytest.param(data('{"error": {"message": "generation thread died", "type": "x"}}'), Failure.THREAD_DIED,
                 "generation thread died", id="object-thread-died"),
    pytest.param(data('{"error": {"message": "boom", "code": 500}}'), Failure.SERVER_ERROR, "boom", id="object"),
    pytest.param(data('{"error": "' + "x" * 5000 + '"}'), Failure.SERVER_ERROR, "xxxx", id="long-string"),
])
@respx.mock
async def test_error_objects_are_server_errors(body, failure, detail):
    """An error as a message or an object is the server's error, with a bounded detail."""
    mock(sse(Stream(body, then_hang=True)))
    result, _ = await probe()
    assert result.failure == failure and detail in result.detail
    assert len(result.detail) <= 200


@respx.mock
async def test_tolerated_shapes_still_deliver():
    """Null fields (error, delta, content, finish_reason) and list content are not malformed."""
    mock(sse(Stream(
        data('{"error": null, "choices": [{"delta": null, "finish_reason": null}]}'),
        data('{"choices": [{"delta": {"content": null, "reasoning": "hm"}}]}'),
        data('{"choices": [{"delta": {"content": [{"type": "text", "text": "OK"}]}}]}'),
        data('{"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": null}'),
        data('{"choices": [], "usage": {"completion_tokens": 2}}'),
        b"data: [DONE]\n\n",
    )))
    result, _ = await probe()
    assert result.ok, result.reason
    assert result.tokens == 2 and result.completion_tokens == 2 and result.finish_reason == "stop"


@pytest.mark.parametrize("comment", [
    pytest.param(": keepalive \u00b2/3", id="superscript-digit"),
    pytest.param(": keepalive " + "9" * 5000 + "/1", id="5000-digits"),
])
@respx.mock
async def test_odd_keepalive_numbers_are_not_progress(comment):
    """isdigit() accepts what int() refuses; such a keepalive is noted, not counted, and never raises."""
    mock(sse(Stream(f"{comment}\n\n".encode(), then_hang=True)))
    result, elapsed = await probe()
    assert result.failure == Failure.NO_FIRST_TOKEN and result.keepalives == []
    assert elapsed < FIRST + SLACK


@respx.mock
async def test_unexpected_parser_exception_is_malformed(monkeypatch):
    """Last-resort guard: whatever the parsing raises becomes a malformed verdict naming the exception."""
    from mlxwatch.probes.sse import SSEParser

    def boom(self, chunk):
        raise ZeroDivisionError("parser bug")

    monkeypatch.setattr(SSEParser, "feed", boom)
    mock(sse(Stream(chunk("a"), then_hang=True)))
    result, elapsed = await probe()
    assert result.failure == Failure.MALFORMED
    assert "ZeroDivisionError" in result.detail and "parser bug" in result.detail
    assert elapsed < FIRST


@respx.mock
async def test_cancellation_from_parsing_still_propagates(monkeypatch):
    """The guard catches Exception only: a CancelledError is not turned into a verdict."""
    from mlxwatch.probes.sse import SSEParser

    def cancelled(self, chunk):
        raise asyncio.CancelledError()

    monkeypatch.setattr(SSEParser, "feed", cancelled)
    mock(sse(Stream(chunk("a"), then_hang=True)))
    with pytest.raises(asyncio.CancelledError):
        await probe()
