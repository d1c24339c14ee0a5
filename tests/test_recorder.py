"""The front door's recorder (issue 35): the exact requests that passed through the door, what
came back, credentials never kept, bounded by age and bytes, off by default."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import httpx

from mlxwatch.config import FrontConfig
from mlxwatch.front import FrontDoor
from mlxwatch.front.delivery import RequestView
from mlxwatch.front.recorder import Recorder

BOUND = 15.0


def _cfg(**over) -> FrontConfig:
    return dataclasses.replace(FrontConfig(listen=("127.0.0.1", 0)), **over)


def _body(i: int, stream: bool = True) -> bytes:
    # odd spacing and key order: the bytes recorded must be the client's, not a re-encoding
    return (b'{"messages":[{"role":"user","content":"request %d \\u00e9"}],  "stream": %s, "max_tokens":4}'
            % (i, b"true" if stream else b"false"))


async def _send(base: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    async with httpx.AsyncClient(trust_env=False, timeout=BOUND) as client:
        response = await client.post(base + "/v1/chat/completions", content=body,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        return response.status_code


def test_the_door_records_nothing_by_default():
    assert FrontConfig().record is False
    assert FrontDoor("t", "http://127.0.0.1:1", _cfg()).recorded() is None


async def test_recorded_requests_are_the_exact_bytes_in_order_with_what_came_back(standin, caplog):
    """Bodies byte for byte, arrival order, method and path, headers without credentials, and
    the answer: status, tokens, first and last token, finish reason; no body in any log line."""
    urls, _, _ = standin()
    caplog.set_level(logging.DEBUG)
    door = FrontDoor("t", urls[0], _cfg(record=True))
    await door.start()
    try:
        host, port = door.address
        base = f"http://{host}:{port}"
        for i in range(5):
            assert await _send(base, _body(i), {"Authorization": "Bearer sk-secret-1", "X-Api-Key": "k2",
                                                "X-Trace": f"t{i}"}) == 200
        recorded = door.recorded()
    finally:
        await door.stop(drain=0.5)
    assert recorded is not None and [r.body for r in recorded] == [_body(i) for i in range(5)]
    assert [r.seq for r in recorded] == [1, 2, 3, 4, 5]
    first = recorded[0]
    assert (first.method, first.target, first.stream, first.max_tokens) == ("POST", "/v1/chat/completions", True, 4)
    names = [k.lower() for k, _ in first.headers]
    assert "authorization" not in names and "x-api-key" not in names and ("X-Trace", "t0") in first.headers
    assert sorted(n.lower() for n in first.dropped_headers) == ["authorization", "x-api-key"]
    assert all("sk-secret-1" not in v for _, v in first.headers)
    for r in recorded:
        assert r.status == 200 and r.outcome == "ok" and r.tokens == 4 and r.finish_reason == "length"
        assert r.first_token_mono is not None and r.last_token_mono is not None and not r.client_gone
        assert r.connection.startswith("c") and "127.0.0.1:" in r.connection
    assert "request 0" not in repr(recorded) and "request 0" not in caplog.text


def test_the_bounds_hold_under_a_thousand_requests():
    """1,000 requests of 64 KiB into a recorder bounded at 4 MiB and 60 s: never more than the
    bound held, the newest kept in order, the oldest let go first; then the age bound empties it."""
    now = [0.0]
    rec = Recorder(60.0, 4 * 1024**2, monotonic=lambda: now[0], wall=lambda: 1e9 + now[0])
    body = b"x" * 65536
    highest = 0
    for i in range(1000):
        now[0] = i * 0.01
        assert rec.arrived(f"r{i + 1}", "c1", "POST", "/v1/completions", [("A", "b")], body, stream=False,
                           max_tokens=1)
        highest = max(highest, rec.held_bytes)
        if i % 2 == 0:
            rec.ended(RequestView(f"r{i + 1}", "POST", "/v1/completions", now[0], False, 1, len(body), None, None,
                                  0, 0), "ok", status=200, finish_reason="stop", client_gone=False)
    assert highest <= 4 * 1024**2
    kept = rec.requests()
    assert 50 <= len(kept) < 64 and [r.seq for r in kept] == list(range(1001 - len(kept), 1001))
    assert rec.dropped == 1000 - len(kept)
    assert kept[-2].outcome == "ok" and kept[-1].in_flight  # r999 ended (an even i), r1000 not
    now[0] += 61.0
    left = rec.requests()  # past the age bound: only the requests still in flight (the odd ones)
    assert left and all(r.in_flight for r in left) and 65536 * len(left) <= rec.held_bytes < 65536 * (len(left) + 1)
    for r in left:
        rec.ended(RequestView(r.id, "POST", "/v1/completions", now[0], False, 1, len(body), None, None, 0, 0),
                  "ok", status=200, finish_reason="stop", client_gone=False)
    now[0] += 61.0
    assert rec.requests() == () and rec.held_bytes == 0


def test_a_request_in_flight_past_the_age_bound_stays():
    """Found trying it: with a 2-minute bound, the request a server was still reading was not
    in its bundle (the age bound counted from its arrival). Ended requests go by age; one in
    flight stays until it ends, or the bytes bound takes it."""
    now = [0.0]
    rec = Recorder(120.0, 1024**2, monotonic=lambda: now[0], wall=lambda: 1e9 + now[0])
    assert rec.arrived("old", "c1", "POST", "/v1/completions", [], b"hung on", stream=True, max_tokens=8)
    now[0] = 10.0
    assert rec.arrived("done", "c2", "POST", "/v1/completions", [], b"answered", stream=False, max_tokens=8)
    rec.ended(RequestView("done", "POST", "/v1/completions", 10.0, False, 8, 8, None, None, 0, 0), "ok",
              status=200, finish_reason="stop", client_gone=False)
    now[0] = 200.0
    assert [r.id for r in rec.requests()] == ["old"] and rec.requests()[0].in_flight


def test_a_request_larger_than_the_bound_alone_is_not_kept():
    rec = Recorder(60.0, 1000, monotonic=lambda: 0.0, wall=lambda: 0.0)
    assert not rec.arrived("r1", "c1", "POST", "/v1/completions", [], b"x" * 2000, stream=False, max_tokens=None)
    assert rec.requests() == () and rec.dropped == 1


async def test_a_request_in_flight_is_recorded_as_in_flight_then_as_failed(standin):
    """A hung request is held while in flight (a verdict's bundle takes it then), and its end
    is what the door did to it."""
    urls, mode_file, _ = standin()
    mode_file.write_text("hang")
    door = FrontDoor("t", urls[0], _cfg(record=True))
    await door.start()
    try:
        host, port = door.address
        reader, writer = await asyncio.open_connection(host, port)
        body = _body(7)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BOUND
        while not door.view().in_flight:
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        in_flight = door.recorded()
        assert door.fail_in_flight("test") == 1
        while (rec := door.recorded()) and rec[0].in_flight:
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        writer.close()
    finally:
        await door.stop(drain=0.5)
    assert in_flight is not None and in_flight[0].in_flight and in_flight[0].body == body
    assert rec is not None and rec[0].outcome == "failed_loudly" and rec[0].status is None and rec[0].tokens == 0


async def test_reconfigure_turns_the_recorder_on_and_off(standin):
    urls, _, _ = standin()
    door = FrontDoor("t", urls[0], _cfg())
    await door.start()
    try:
        host, port = door.address
        base = f"http://{host}:{port}"
        await _send(base, _body(1))
        door.reconfigure(_cfg(record=True))
        await _send(base, _body(2))
        assert [r.body for r in door.recorded() or ()] == [_body(2)]
        door.reconfigure(_cfg(record=False))
        assert door.recorded() is None
    finally:
        await door.stop(drain=0.5)


def test_a_recorded_request_leaves_few_objects_for_the_collector():
    """Measured (bench.replay's door at 64 streams): with the recorder, CPython's collections of
    young objects took 3-4 times as long as without it, on the loop that relays every token: a
    request kept nine objects the collector counts (every 700 start a collection). Its headers
    are now one flat tuple and its end is set on its entry: two, however many headers (three with
    a credential's name kept)."""
    import gc

    rec = Recorder(600.0, 2**30, monotonic=lambda: 1.0, wall=lambda: 1.0)
    headers = [("Content-Type", "application/json"), ("User-Agent", "openai/1"), ("Accept", "*/*"),
               ("X-Stainless-Lang", "python"), ("Authorization", "Bearer x")]
    was = gc.isenabled()
    gc.disable()
    try:
        before = gc.get_count()[0]
        for i in range(200):
            rec.arrived(f"r{i}", "c1", "POST", "/v1/chat/completions", [(k, v) for k, v in headers], _body(i),
                        stream=True, max_tokens=8)
            rec.ended(RequestView(f"r{i}", "POST", "/v1/chat/completions", 0.0, True, 8, 10, 0.1, 0.5, 8, 100),
                      "ok", status=200, finish_reason="stop", client_gone=False)
        kept = (gc.get_count()[0] - before) / 200
    finally:
        if was:
            gc.enable()
    assert kept <= 3, kept
    (first, *_) = rec.requests()
    assert first.headers == tuple(headers[:4]) and first.dropped_headers == ("Authorization",)
    assert (first.status, first.outcome, first.tokens) == (200, "ok", 8)


async def test_a_header_value_padded_with_whitespace_is_recorded_without_it(standin):
    """Measured (an adversarial review): `X-Spaces:   lead and trail   ` was recorded as
    "lead and trail   " (the parser dropped the leading whitespace only), and its replay failed:
    httpx refuses a value with trailing whitespace. A field's value has none (RFC 9112, 5.1)."""
    urls, _, _ = standin()
    door = FrontDoor("t", urls[0], _cfg(record=True))
    await door.start()
    try:
        host, port = door.address
        body = _body(1, stream=False)
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"X-Spaces:   lead and trail   \r\nX-Tab:\tv\t\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), BOUND)
        writer.close()
        recorded = door.recorded()
    finally:
        await door.stop(drain=0.5)
    assert answer.startswith(b"HTTP/1.1 200")
    assert recorded is not None and ("X-Spaces", "lead and trail") in recorded[0].headers
    assert ("X-Tab", "v") in recorded[0].headers
