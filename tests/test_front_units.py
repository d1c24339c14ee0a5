"""The front door's pure parts: token counting in forwarded bytes, the per-request ledger,
hop-by-hop headers and the error shapes."""

from __future__ import annotations

import asyncio
import json

import pytest

from mlxwatch.front import http1
from mlxwatch.front.delivery import FAILED_LOUDLY, OK, Ledger
from mlxwatch.front.tokens import StreamReader, body_tokens
from mlxwatch.front.wire import end_to_end, sse_error


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _delta(**delta) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_a_token_is_an_event_with_content_text_or_finish_reason():
    reader = StreamReader()
    stream = (b": keepalive 10/100\n\n" + _event(_delta(role="assistant")) + _event(_delta(content=""))
              + _event(_delta(content="Hi")) + _event(_delta(reasoning="hmm"))
              + _event({"choices": [{"index": 0, "text": "x"}]})
              + _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    assert reader.feed(stream) == 4
    assert reader.ended and reader.at_boundary and not reader.errored


def test_events_split_anywhere_count_once_when_complete():
    """Chunks cut inside an event (even inside 'data:') count the token when its line ends."""
    stream = _event(_delta(content="a")) + _event(_delta(content="b")) + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        reader = StreamReader()
        first = reader.feed(stream[:cut])
        assert first + reader.feed(stream[cut:]) == 2, cut
        assert reader.ended
    reader = StreamReader()
    reader.feed(stream[:10])
    assert not reader.at_boundary


@pytest.mark.parametrize("end", [b"\r\n", b"\r"], ids=["CRLF", "CR alone"])
def test_lines_ended_by_crlf_or_cr_alone_split_anywhere_count_the_same(end):
    """SSE ends a line with CRLF, LF or CR alone. Found by an adversarial review: a stream
    using CR alone counted 0 tokens, and the door wrote a "truncated" error event after it,
    complete as it was."""
    stream = (_event(_delta(content="a")) + _event(_delta(content="b")) + b"data: [DONE]\n\n").replace(b"\n", end)
    for cut in range(1, len(stream)):
        reader = StreamReader()
        first = reader.feed(stream[:cut])
        assert first + reader.feed(stream[cut:]) == 2, cut
        assert reader.ended and reader.at_boundary, cut


def test_an_error_event_and_a_line_over_the_limit():
    reader = StreamReader(max_line=64)
    assert reader.feed(b"data: " + b"x" * 200 + b"\n\n" + _event(_delta(content="a"))[:0]) == 0
    assert reader.feed(b"data: {\"error\": {\"message\": \"boom\"}}\n\n") == 0
    assert reader.errored and not reader.ended


def test_a_line_over_the_limit_is_no_event_boundary():
    """The client has the overlong line but not the blank line ending its event: an error event
    written now must end that event first, so the reader must not call this a boundary."""
    reader = StreamReader(max_line=128)
    reader.feed(b"data: " + b"x" * 200 + b"\n")
    assert not reader.at_boundary
    reader.feed(b"\n")
    assert reader.at_boundary
    reader = StreamReader(max_line=128)  # the same line split over two chunks
    reader.feed(b"data: " + b"x" * 100)
    reader.feed(b"x" * 100 + b"\n")
    assert not reader.at_boundary
    assert reader.feed(b"\n" + _event(_delta(content="a"))) == 1 and reader.at_boundary


def test_a_body_counts_its_usage_else_one():
    assert body_tokens(json.dumps({"usage": {"completion_tokens": 7}}).encode()) == 7
    assert body_tokens(b'{"choices": []}') == 1
    assert body_tokens(b"not json") == 1


def test_the_ledger_keeps_first_and_latest_token_per_request():
    now = [100.0]
    ledger = Ledger(lambda: now[0])
    fid = ledger.open("POST", "/v1/chat/completions", stream=True, max_tokens=8, prompt_bytes=10)
    now[0] = 101.0
    ledger.delivered(fid, tokens=1, nbytes=50)
    now[0] = 103.0
    ledger.delivered(fid, tokens=2, nbytes=60)
    r = ledger.view().in_flight[0]
    assert (r.first_token_mono, r.last_token_mono, r.tokens, r.bytes_out) == (101.0, 103.0, 3, 110)
    assert ledger.view().last_token_mono == 103.0
    ledger.close(fid, OK)
    view = ledger.view()
    assert view.in_flight == () and view.tokens_total == 3 and view.outcomes[OK] == 1
    taken = ledger.take_observations()
    assert taken.first_token_latency == (1.0,) and taken.tokens_per_second == (1.0,)
    assert ledger.take_observations().first_token_latency == ()


def test_stalled_means_silent_while_others_flow():
    now = [0.0]
    ledger = Ledger(lambda: now[0])
    silent = ledger.open("POST", "/v1/completions", stream=True, max_tokens=None, prompt_bytes=1)
    models = ledger.open("GET", "/v1/models", stream=False, max_tokens=None, prompt_bytes=0, generation=False)
    flowing = ledger.open("POST", "/v1/completions", stream=True, max_tokens=None, prompt_bytes=1)
    now[0] = 50.0
    assert ledger.stalled(60.0) == []  # not silent long enough
    now[0] = 70.0
    assert ledger.stalled(60.0) == []  # silent long enough, but nobody else flows either: the server's problem
    ledger.delivered(flowing, tokens=1)
    assert [r.id for r in ledger.stalled(60.0)] == [silent]  # /v1/models is never "stalled"
    ledger.close(flowing, OK)  # tokens to a request since finished still count as others flowing
    assert [r.id for r in ledger.stalled(60.0)] == [silent]
    now[0] = 131.0
    assert ledger.stalled(60.0) == []  # the others' last token is too old now
    ledger.close(silent, FAILED_LOUDLY)
    ledger.close(models, OK)


def test_hop_by_hop_headers_and_those_connection_names_are_dropped():
    headers = [("Connection", "keep-alive, X-Private"), ("X-Private", "1"), ("Keep-Alive", "timeout=5"),
               ("Transfer-Encoding", "chunked"), ("TE", "trailers"), ("Trailer", "X"), ("Upgrade", "h2c"),
               ("Proxy-Authorization", "x"), ("Proxy-Authenticate", "x"), ("Set-Cookie", "a=1"),
               ("Set-Cookie", "b=2"), ("Content-Type", "text/event-stream")]
    assert end_to_end(headers) == [("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("Content-Type", "text/event-stream")]


def test_the_sse_error_is_an_event_of_its_own():
    event = sse_error("server hung", "mlxwatch_hung", at_boundary=False)
    assert event.startswith(b"\n\ndata: ") and event.endswith(b"\n\n")
    payload = json.loads(event.strip()[len(b"data: "):])
    assert payload == {"error": {"message": "server hung", "type": "server_error", "code": "mlxwatch_hung"}}


class _Transport(asyncio.Transport):
    """A client's connection as the door's protocol sees it: bytes waiting in the door's buffer
    until the test says the client took them."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = 0
        self.aborted = False

    def write(self, data) -> None:
        self.waiting += len(data)

    def get_write_buffer_size(self) -> int:
        return self.waiting

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


class _Door:
    def admit(self, conn) -> bool:
        return True

    def closed(self, conn) -> None:
        pass


async def test_the_send_timeout_cuts_a_client_that_took_nothing_and_spares_one_taking_slowly():
    """Measured: a client that never read held its connection for ever. Cutting on writing paused
    alone would cut a slow reader too: what counts is whether it took a byte since the timer
    was armed (as nginx's send_timeout, between two successful writes)."""
    limits = http1.Limits(max_header=8192, max_header_count=100, max_body=1000, head_timeout=60,
                          body_timeout=60, keepalive_timeout=60)
    conn = http1.ClientConnection(_Door(), limits)
    transport = _Transport()
    conn.connection_made(transport)
    conn.start(200, "OK", [], length=None, head_only=False)
    conn.write(b"x" * 100_000)
    conn.pause_writing()
    transport.waiting -= 10  # the client took 10 bytes within SEND_TIMEOUT
    conn._send_too_slow()
    assert not transport.aborted
    conn._send_too_slow()  # then nothing for another SEND_TIMEOUT
    assert transport.aborted
    conn.connection_lost(None)
