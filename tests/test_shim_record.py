"""The launch shim's request recorder (``mlxwatch launch --record``), on an in-process
``http.server`` handler written the way ``mlx_lm.server``'s ``APIHandler`` is (both versions:
the body read with ``rfile.read(Content-Length)``, SSE events one write each, a whole answer in
one write): exact bodies and what came back, credentials never kept, answers byte-identical,
a recorder that fails never reaching the server, the spool's bounds, and capture reading it."""

from __future__ import annotations

import asyncio
import errno
import http.client
import http.server
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from mlxwatch.capture import requests as bundle_requests
from mlxwatch.capture.requests import from_shim, index_entries, manifest_entry, summary_lines
from mlxwatch.cli.parser import build_parser, parse
from mlxwatch.errors import UsageError
from mlxwatch.shim import agent as shim_agent
from mlxwatch.shim import layout, launcher, spool
from mlxwatch.shim.recorder import RequestRecorder, patch_handler
from mlxwatch.shim.spool import SEGMENTS, SpoolWriter


class APIHandler(http.server.BaseHTTPRequestHandler):
    """mlx_lm.server's handler in miniature: same reads, same writes, same way of failing."""

    def date_time_string(self, timestamp=None):  # answers compared byte for byte
        return "Mon, 07 Dec 2026 00:00:00 GMT"

    def log_message(self, format, *args):
        pass

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"data": [{"id": "tiny"}]}')

    def do_POST(self):
        if self.path != "/v1/chat/completions":
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"Not Found")
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])).decode())
        words = body["messages"][-1]["content"].split()[: body.get("max_tokens", 100)]
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b": keepalive 1/1\n\n")
            for w in words:
                event = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": w}, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
                time.sleep(body.get("gap", 0))
            last = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": "length"}]}
            self.wfile.write(f"data: {json.dumps(last)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
        else:
            answer = json.dumps({"choices": [{"message": {"content": " ".join(words)}, "finish_reason": "stop"}],
                                 "usage": {"completion_tokens": len(words)}}).encode()
            self.send_response(200)
            self.send_header("Content-type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)


def _serve(handler: type) -> tuple[http.server.ThreadingHTTPServer, str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"127.0.0.1:{server.server_address[1]}"


def _raw(where: str, request: bytes) -> bytes:
    """Everything the server sends back for ``request``, byte for byte (it closes: HTTP/1.0)."""
    host, port = where.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def _post(body: bytes, extra: str = "", path: str = "/v1/chat/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


STREAMED = json.dumps({"messages": [{"role": "user", "content": "one two three four"}], "stream": True,
                       "max_tokens": 3, "temperature": 0}).encode()
WHOLE = b'{"messages": [{"role": "user", "content": "alpha beta \\u00e9"}], "max_tokens": 8}'


@pytest.fixture
def recorded(tmp_path):
    """A fresh handler class, patched by a recorder whose spool is in tmp_path; the server serving it."""
    made = []

    def make(max_age: float = 600.0, max_bytes: int = 256 * 1024**2, said: list | None = None):
        cls = type("APIHandler", (APIHandler,), {})
        writer = SpoolWriter(str(tmp_path), 4242, max_age, max_bytes)
        rec = RequestRecorder(writer, (said if said is not None else []).append)
        assert patch_handler(rec, cls, "test.APIHandler") and rec.state == "on"
        server, where = _serve(cls)
        made.append(server)
        return rec, where

    yield make
    for server in made:
        server.shutdown()
        server.server_close()


def _read(tmp_path: Path, rec: RequestRecorder, until: float | None = None) -> list[dict]:
    records, problems = spool.read(str(tmp_path), 4242, now_mono=time.monotonic(), max_age=rec.max_age,
                                   max_bytes=rec.max_bytes, until=until)
    assert problems == []
    return records


def _wait(predicate, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not seen within {timeout}s")


def test_each_request_is_kept_exactly_with_what_came_back_and_without_credentials(recorded, tmp_path):
    rec, where = recorded()
    secret = "Authorization: Bearer sk-live-1\r\nCookie: s=2\r\nX-Api-Key: k3\r\nX-Trace: keep-me\r\n"
    _raw(where, _post(STREAMED, secret))
    _raw(where, _post(WHOLE))
    _raw(where, b"GET /v1/models HTTP/1.0\r\n\r\n")
    _raw(where, _post(b"{}", path="/nowhere"))
    records = _wait(lambda: (r := _read(tmp_path, rec)) and len([x for x in r if "end" in x]) == 4 and r, "4 ends")
    stream, whole, models, missing = records
    assert [r["seq"] for r in records] == [1, 2, 3, 4] and rec.recorded == 4
    assert stream["body"] == STREAMED and whole["body"] == WHOLE and models["body"] == b"" and missing["body"] == b""
    assert (stream["method"], stream["target"], models["method"]) == ("POST", "/v1/chat/completions", "GET")
    names = [k for k, _ in stream["headers"]]
    assert "X-Trace" in names and not {"Authorization", "Cookie", "X-Api-Key"} & set(names)
    assert stream["dropped"] == ["Authorization", "Cookie", "X-Api-Key"]
    assert b"sk-live-1" not in b"".join(Path(p).read_bytes() for p in spool.segment_paths(str(tmp_path), 4242))
    assert stream["conn"].startswith("127.0.0.1:")
    e = stream["end"]
    assert (e["status"], e["tokens"], e["finish"], e["outcome"], e["gone"]) == (200, 4, "length", "ok", False)
    assert stream["mono"] <= e["first"] <= e["last"] <= e["ended"]
    e = whole["end"]
    assert (e["status"], e["tokens"], e["finish"], e["outcome"]) == (200, 3, "stop", "ok")
    assert models["end"]["status"] == 200 and missing["end"]["status"] == 404 and missing["end"]["tokens"] == 0
    assert rec.live == {}


def test_answers_are_byte_identical_with_the_recorder_and_without(recorded):
    plain, plain_at = _serve(type("APIHandler", (APIHandler,), {}))
    try:
        _, rec_at = recorded()
        for request in (_post(STREAMED), _post(WHOLE), b"GET /v1/models HTTP/1.0\r\n\r\n", _post(b"x", path="/no")):
            assert _raw(rec_at, request) == _raw(plain_at, request)
    finally:
        plain.shutdown()
        plain.server_close()


@pytest.mark.parametrize("where", ["spool", "reading the answer"])
def test_a_recorder_that_fails_stops_recording_and_the_server_answers_as_ever(recorded, tmp_path, monkeypatch, where):
    said: list[str] = []
    rec, at = recorded(said=said)
    _raw(at, _post(WHOLE))
    before = _raw(at, _post(STREAMED))
    if where == "spool":
        def full(self, parts, mono):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(SpoolWriter, "append", full)
    else:
        monkeypatch.setattr(RequestRecorder, "_events", lambda self, flight, data: 1 / 0)
    assert _raw(at, _post(STREAMED)) == before  # the failing request itself is answered unchanged
    assert rec.on is False and rec.state == "failed" and rec.errors == 1
    assert len(said) == 1 and "recording stopped, the server runs on" in said[0]
    for _ in range(3):
        assert _raw(at, _post(STREAMED)) == before
    assert rec.errors == 1 and rec.live == {}  # not recording any more: nothing more to fail


def test_a_client_that_goes_away_is_recorded_as_cancelled(recorded, tmp_path):
    rec, where = recorded()
    body = json.dumps({"messages": [{"role": "user", "content": "w " * 400}], "stream": True, "max_tokens": 400,
                       "gap": 0.01}).encode()
    host, port = where.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(_post(body))
        _wait(lambda: b"data: {" in s.recv(4096), "the first event")
    records = _wait(lambda: (r := _read(tmp_path, rec)) and "end" in r[0] and r, "the end", timeout=30)
    e = records[0]["end"]
    assert e["outcome"] == "cancelled" and e["gone"] is True and 1 <= e["tokens"] < 400


def test_a_request_in_flight_is_on_disk_before_the_server_answers(recorded, tmp_path):
    """The arrival is written when the body has been read: a request the server then hangs on is kept."""
    rec, where = recorded()
    stuck = threading.Event()
    cls = type("APIHandler", (APIHandler,), {})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        stuck.wait(10)

    cls.do_POST = do_POST
    assert patch_handler(rec, cls, "hang.APIHandler")
    server, at = _serve(cls)
    try:
        threading.Thread(target=lambda: _raw(at, _post(WHOLE)), daemon=True).start()
        held = _wait(lambda: _read(tmp_path, rec), "the arrival")
        assert held[0]["body"] == WHOLE and "end" not in held[0]
        live = rec.snapshot()["in_flight"]
        assert [x["id"] for x in live] == [held[0]["id"]] and live[0]["status"] is None
    finally:
        stuck.set()
        server.shutdown()
        server.server_close()


# --- the spool's bounds


def _arrival(i: int, size: int, mono: float | None = None) -> list[bytes]:
    return spool.encode_arrival({"id": f"s{i}", "seq": i, "mono": float(i) if mono is None else mono, "wall": 0.0},
                                bytes([i % 256]) * size)


def test_the_spool_holds_at_most_max_bytes_over_1000_requests_newest_kept_in_order(tmp_path):
    bound = 64 * 1024
    writer = SpoolWriter(str(tmp_path), 7, 600.0, bound)
    for i in range(1, 1001):
        writer.append(_arrival(i, 700), float(i))
        on_disk = sum(os.path.getsize(p) for p in spool.segment_paths(str(tmp_path), 7))
        assert on_disk == writer.held_bytes <= bound and len(writer.segments) <= SEGMENTS
    assert all(os.stat(p).st_mode & 0o777 == 0o600 for p in spool.segment_paths(str(tmp_path), 7))
    records, problems = spool.read(str(tmp_path), 7, now_mono=1000.0, max_age=600.0, max_bytes=bound)
    seqs = [r["seq"] for r in records]
    assert problems == [] and seqs == list(range(seqs[0], 1001)) and len(seqs) > 60  # at least 3/4 of the bound
    assert all(r["body"] == bytes([r["seq"] % 256]) * 700 for r in records)
    writer.close()


def test_the_spool_lets_go_by_age_and_a_request_larger_than_the_bound_is_not_kept(tmp_path, recorded):
    writer = SpoolWriter(str(tmp_path), 8, 10.0, 4096)
    for i in range(1, 9):
        writer.append(_arrival(i, 300, 100.0 + i), 100.0 + i, opens=f"s{i}")
        writer.append(spool.encode_end({"id": f"s{i}", "status": 200}), 100.0 + i, ends=f"s{i}")
    records, _ = spool.read(str(tmp_path), 8, now_mono=113.5, max_age=10.0, max_bytes=4096)
    assert [r["seq"] for r in records] == [4, 5, 6, 7, 8]  # the reader: arrived in the last 10 s (all ended)
    writer.expire(200.0)
    assert spool.segment_paths(str(tmp_path), 8) == [] and writer.held_bytes == 0
    writer.append(_arrival(9, 10, 201.0), 201.0)  # begins a new segment
    assert [r["seq"] for r in spool.read(str(tmp_path), 8, now_mono=201.0, max_age=10.0, max_bytes=4096)[0]] == [9]
    writer.close()

    rec, where = recorded(max_bytes=2048)
    _raw(where, _post(json.dumps({"messages": [{"role": "user", "content": "x" * 4000}]}).encode()))
    _raw(where, _post(WHOLE))
    records = _wait(lambda: (r := _read(tmp_path, rec)) and "end" in r[-1] and r, "the small one")
    assert [r["body"] for r in records] == [WHOLE] and rec.dropped == 1


def test_a_record_cut_short_ends_its_segment_for_the_reader(tmp_path):
    writer = SpoolWriter(str(tmp_path), 9, 600.0, 1024**2)
    for i in range(1, 4):
        writer.append(_arrival(i, 50), float(i))
    writer.close()
    path = spool.segment_paths(str(tmp_path), 9)[0]
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 10)
    records, problems = spool.read(str(tmp_path), 9, now_mono=3.0, max_age=600.0, max_bytes=1024**2)
    assert [r["seq"] for r in records] == [1, 2] and "cut short" in problems[0]


# --- switched on by launch, read back by capture


def test_launch_record_sets_the_bounds_for_the_shim_and_only_then():
    p = launcher.plan(["--", "/bin/true"], record=launcher.Record(90.0, 1024**2),
                      environ={layout.RECORD_ENV: "stale", "PATH": os.defpath})
    assert layout.parse_record_setting(p.env[layout.RECORD_ENV]) == (90.0, 1024**2)
    assert layout.RECORD_ENV not in launcher.plan(["--", "/bin/true"], environ={layout.RECORD_ENV: "1:2"}).env
    args = parse(build_parser(), ["launch", "--record", "--record-max-age", "2m", "--record-max-bytes", "64MiB",
                                  "--", "mlx_lm.server"])
    assert (args.record, args.record_max_age, args.record_max_bytes) == (True, 120.0, 64 * 1024**2)
    with pytest.raises(UsageError, match="record-max-bytes"):
        parse(build_parser(), ["launch", "--record", "--record-max-bytes", "lots", "--", "mlx_lm.server"])
    assert [layout.parse_record_setting(v) for v in ("", "1", "a:b", "0:5", "5:0", "inf:5")] == [None] * 6


def test_the_agent_records_only_when_asked_and_says_so_in_its_heartbeat(tmp_path, capsys):
    def agent(setting: str | None) -> shim_agent.Agent:
        a = shim_agent.Agent(time.time(), None, False, str(tmp_path / "run"))
        ready = a.prepare_dir()
        if setting is not None:
            shim_agent._start_recorder(a, setting, ready)
        return a

    assert agent(None).snapshot()["record"] is None
    assert agent("600:nope").recorder is None
    assert "MLXWATCH_SHIM_RECORD='600:nope' is not MAX_AGE_SECONDS:MAX_BYTES" in capsys.readouterr().err
    on = agent("600:1048576")
    shim_agent._patch_handler(on, type("M", (), {"APIHandler": type("APIHandler", (APIHandler,), {})}), "mlx_lm.server")
    record = on.snapshot()["record"]
    assert (record["state"], record["max_age"], record["max_bytes"]) == ("on", 600.0, 1024**2)
    assert record["where"] == ["mlx_lm.server.APIHandler"] and record["in_flight"] == []
    on.recorder.spool.close()


def test_capture_reads_the_shim_spool_as_the_door_records_them(tmp_path, monkeypatch, recorded):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv(layout.RUNTIME_ENV, str(run))
    rec, where = recorded()
    rec.spool.directory = str(run)  # the spool where capture looks: the runtime dir
    _raw(where, _post(WHOLE, "Authorization: Bearer x\r\n"))
    _raw(where, _post(STREAMED))
    _wait(lambda: len(spool.read(str(run), 4242, now_mono=time.monotonic(), max_age=600, max_bytes=1 << 30)[0]) == 2
          and rec.live == {}, "two requests")
    until = time.monotonic()
    _raw(where, _post(b'{"after": "the capture began"}'))
    hb = {"format": layout.FORMAT, "pid": 4242, "started_at": time.time(), "record": rec.snapshot()}
    (run / "4242.json").write_text(json.dumps(hb))
    held, problem = from_shim(4242, None, until)
    assert problem == "" and held is not None and [r.body for r in held] == [WHOLE, STREAMED]
    first, second = held
    assert first.dropped_headers == ("Authorization",) and first.outcome == "ok" and first.tokens == 3
    assert (second.stream, second.max_tokens, second.finish_reason, second.tokens) == (True, 3, "length", 4)
    index = index_entries(held)
    assert index[1]["body_file"] == "requests/body-000002.bin" and index[1]["status"] == 200
    entry = manifest_entry(held, until, "shim")
    assert entry["source"] == "shim" and "## Requests (recorded by the launch shim)" in summary_lines(entry)
    hb["record"] = None
    (run / "4242.json").write_text(json.dumps(hb))
    assert from_shim(4242, None, until) == (None, "the launch shim does not record requests (mlxwatch launch --record)")


def test_a_bundle_takes_the_door_requests_when_it_has_them_else_the_shim(tmp_path, monkeypatch):
    from mlxwatch.capture import collector
    from mlxwatch.capture.bundle import BundleWriter
    from mlxwatch.capture.redact import PRIVATE
    from mlxwatch.capture.results import ProcessResult
    from mlxwatch.front.recorder import RecordedRequest

    door = (RecordedRequest(1, "r1", 0.0, 1.0, "c1", "POST", "/v1/completions", False, 4, (), (), b"door"),)
    shim = (RecordedRequest(1, "s1", 0.0, 1.0, "127.0.0.1:1", "POST", "/v1/completions", False, 4, (), (), b"shim"),)
    monkeypatch.setattr(collector, "from_shim", lambda pid, create_time, until: (shim, ""))
    process = ProcessResult(info={"pid": 1, "create_time": 1.0, "errors": {}})
    for given, source, body in ((door, "door", b"door"), (None, "shim", b"shim"), ((), "shim", b"shim")):
        files = collector._Files(BundleWriter(tmp_path / source, "t", 0), PRIVATE)
        req = collector.CaptureRequest(pid=1, out_dir=tmp_path, recorded=given, recorded_at=2.0)
        result = asyncio.run(collector._requests(req, process, files, 5.0))
        assert result.source == source and [r.body for r in result.recorded] == [body]
        assert (files.writer.partial / "requests" / "body-000001.bin").read_bytes() == body
    assert bundle_requests.SOURCES["shim"] == "the launch shim"


def test_the_spool_keeps_the_arrival_of_a_request_in_flight_past_the_age_bound(tmp_path):
    """The request a server hangs on may have arrived longer ago than the age bound: its
    arrival's segment is not expired while it is in flight, and the reader keeps it; ended
    requests past the bound go."""
    writer = SpoolWriter(str(tmp_path), 10, 10.0, 1024**2)
    writer.append(_arrival(1, 50, 100.0), 100.0, opens="s1")  # the one the server hangs on
    writer.append(_arrival(2, 50, 101.0), 101.0, opens="s2")
    writer.append(spool.encode_end({"id": "s2", "status": 200}), 102.0, ends="s2")
    writer.expire(200.0)
    assert spool.segment_paths(str(tmp_path), 10)  # still on disk
    records, _ = spool.read(str(tmp_path), 10, now_mono=200.0, max_age=10.0, max_bytes=1024**2)
    assert [r["seq"] for r in records] == [1] and "end" not in records[0]
    writer.append(spool.encode_end({"id": "s1", "status": 200}), 201.0, ends="s1")
    writer.expire(300.0)
    assert spool.segment_paths(str(tmp_path), 10) == []
    writer.close()
