"""``mlxwatch replay`` of a hostile or damaged bundle (bundles travel: they are attached to
upstream issues): whatever its ``requests/`` holds, the replay never blocks on a FIFO or a
device, never sends a request anywhere but the server it was told, never sleeps for ever on a
damaged offset, never drops a request silently; each is one line, exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mlxwatch.capture.requests import INDEX, load_requests
from mlxwatch.errors import BundleError
from test_replay import _bundle, _cli


def _edit(bundle: Path, n: int, **fields) -> None:
    index = bundle / INDEX
    entries = json.loads(index.read_text())
    entries[n].update(fields)
    index.write_text(json.dumps(entries))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("which", ["index", "body"])
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(tmp_path, capsys, which):
    bundle = _bundle(tmp_path)
    path = bundle / (INDEX if which == "index" else "requests/body-000002.bin")
    path.unlink()
    os.mkfifo(path)
    code, out, err = _cli(["replay", str(bundle), "--to", "http://127.0.0.1:9"], capsys)
    assert (code, out) == (2, "") and "not a regular file" in err and len(err.strip().splitlines()) == 1


@pytest.mark.timeout(10)
@pytest.mark.parametrize("which", ["index", "body", "dir"])
def test_links_in_the_bundle_are_refused(tmp_path, which):
    bundle = _bundle(tmp_path)
    if which == "index":  # to an endless device: it was read to the end (memory without bound)
        (bundle / INDEX).unlink()
        (bundle / INDEX).symlink_to("/dev/zero")
    elif which == "body":
        elsewhere = tmp_path / "elsewhere.bin"
        (bundle / "requests/body-000001.bin").rename(elsewhere)
        (bundle / "requests/body-000001.bin").symlink_to(elsewhere)
    else:
        (bundle / "requests").rename(tmp_path / "requests-elsewhere")
        (bundle / "requests").symlink_to(tmp_path / "requests-elsewhere")
    with pytest.raises(BundleError, match="link"):
        load_requests(bundle)


@pytest.mark.parametrize("target", ["@127.0.0.2:9/v1/chat/completions", "http://127.0.0.2:9/v1/chat/completions",
                                    "v1/chat/completions", "/v1/chat completions", "/v1/\r\nX-Evil: 1", ""])
def test_a_target_that_is_not_a_path_is_refused(tmp_path, target):
    """base + target must stay on the replay's door: ``@host`` made the URL's userinfo and sent
    the request (its body: users' words) to another host, past the door and its judge."""
    bundle = _bundle(tmp_path)
    _edit(bundle, 0, target=target)
    with pytest.raises(BundleError, match="request 1: target"):
        load_requests(bundle)


@pytest.mark.parametrize("method", ["GET X", "", "P\rOST", 5])
def test_a_method_that_is_not_a_token_is_refused(tmp_path, method):
    bundle = _bundle(tmp_path)
    _edit(bundle, 0, method=method)
    with pytest.raises(BundleError, match="request 1: method"):
        load_requests(bundle)


@pytest.mark.parametrize("headers", [[["X-A", "b\r\nX-Evil: 1"]], [["X A:", "b"]], [["X-A", "\u2603"]], [["", "b"]]])
def test_a_header_that_cannot_be_sent_is_refused(tmp_path, headers):
    bundle = _bundle(tmp_path)
    _edit(bundle, 0, headers=headers)
    with pytest.raises(BundleError, match="request 1: header"):
        load_requests(bundle)


def test_a_latin1_header_value_is_sent_as_its_bytes(tmp_path, standin, capsys):
    """The door records a header's bytes decoded as Latin-1 (a client may send any byte above
    0x7f); the replay sent it as ASCII: an internal error, exit 2, for a genuine bundle."""
    urls, _, _ = standin()
    bundle = _bundle(tmp_path)
    _edit(bundle, 0, headers=[["Content-Type", "application/json"], ["X-Name", "caf\u00e9"]])
    code, out, err = _cli(["replay", str(bundle), "--to", urls[0], "--speed", "10"], capsys)
    assert code == 1, (out, err)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("t", [float("inf"), 1e300, -1.0, float("nan"), True])
def test_an_offset_that_is_not_a_time_in_the_window_is_refused(tmp_path, t):
    """A damaged ``t`` (inf, 1e300) made the replay sleep for ever."""
    bundle = _bundle(tmp_path)
    index = bundle / INDEX
    entries = json.loads(index.read_text())
    entries[1]["t"] = t
    index.write_text(json.dumps(entries))  # Python writes inf and nan as Infinity and NaN, and reads them back
    with pytest.raises(BundleError, match="request 2: t"):
        load_requests(bundle)


def test_a_repeated_seq_is_refused(tmp_path):
    """Two requests with one seq: the replay counted them as one (3 of 4 sent), silently."""
    bundle = _bundle(tmp_path)
    _edit(bundle, 1, seq=1)
    with pytest.raises(BundleError, match="request 2: seq 1 repeats"):
        load_requests(bundle)


def test_a_genuine_bundle_still_loads(tmp_path):
    assert [r.seq for r in load_requests(_bundle(tmp_path))] == [1, 2, 3, 4]


def test_the_front_door_the_clients_used_is_the_bundles_server_too(tmp_path, standin, capsys):
    """The clients reached the server through its front door (their Host header names it): a
    replay --to that door hangs the production server as surely as --to the server itself,
    and was let through (the manifest names only the server's URL)."""
    urls, _, _ = standin()
    bundle = _bundle(tmp_path)  # came from http://127.0.0.1:9, through a door at urls[0]
    door = urls[0].removeprefix("http://").replace("127.0.0.1", "localhost")
    for n in range(4):
        _edit(bundle, n, headers=[["Host", door], ["Content-Type", "application/json"]])
    code, out, err = _cli(["replay", str(bundle), "--to", urls[0]], capsys)
    assert (code, out) == (2, "") and "is where this bundle's clients reached the server" in err and "--allow-bundle-url" in err
    assert len(err.strip().splitlines()) == 1
    code, out, err = _cli(["replay", str(bundle), "--to", urls[0], "--allow-bundle-url", "--speed", "10"], capsys)
    assert code == 1, (out, err)


def test_an_out_that_is_a_file_is_named_as_such(tmp_path, capsys):
    bundle = _bundle(tmp_path)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    code, out, err = _cli(["replay", str(bundle), "--to", "http://127.0.0.1:9", "--allow-bundle-url",
                           "--out", str(a_file)], capsys)
    assert (code, out) == (2, "") and f"--out {a_file} is not a directory" in err and a_file.read_text() == "mine"


@pytest.mark.parametrize("cmdline", [["python\u0000", "-m", "x"], [None, "x"], ["", "x"], ["python", 5]])
def test_a_recorded_command_line_that_is_not_one_is_refused_and_leaves_nothing(tmp_path, capsys, monkeypatch,
                                                                                 cmdline):
    """A NUL in it was an internal error (Popen's ValueError) that left the server's temp dir."""
    bundle = _bundle(tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["target"]["cmdline"] = cmdline
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    code, out, err = _cli(["replay", str(bundle), "--launch"], capsys)
    assert (code, out) == (2, "") and "target.cmdline" in err and "internal error" not in err, err
    assert list(tmp.iterdir()) == []


@pytest.mark.timeout(60)
def test_a_body_larger_than_a_doors_default_limit_reaches_the_server(tmp_path):
    """The replay's own door had front.max_body's default (16 MiB): a request recorded with a
    larger body (the shim has no such limit; a door may be configured higher) got 413 from the
    replay's door, never reached the server, and the replay said "not reproduced" (exit 1: a
    bisect reads it as fixed)."""
    import hashlib

    from test_replay import replayed_to_a_server_that_keeps_the_bodies

    bundle = _bundle(tmp_path)
    big = b'{"messages": [{"role": "user", "content": "' + b"z" * (20 * 1024**2) + b'"}], "stream": true}'
    (bundle / "requests/body-000001.bin").write_bytes(big)
    _edit(bundle, 0, body_sha256=hashlib.sha256(big).hexdigest(), body_bytes=len(big))
    outcome, got = replayed_to_a_server_that_keeps_the_bodies(load_requests(bundle))
    assert [a.status for a in sorted(outcome.answers, key=lambda a: a.seq)] == [200] * 4, outcome.answers
    assert sorted(len(b) for b in got)[-1] == len(big)


def test_a_server_that_served_none_of_the_requests_is_could_not_run(tmp_path, capsys):
    """Every request answered 501 (a server that is not the one recorded: another model name, an
    API it does not have) was "not reproduced", exit 1: a bisect reads that as fixed, though
    nothing was tested. Now one line with the statuses, exit 2."""
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_error(404, "model not found")

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        bundle = _bundle(tmp_path)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code, out, err = _cli(["replay", str(bundle), "--to", url, "--speed", "10"], capsys)
        assert (code, out) == (2, "") and "served none of the 4 request(s)" in err and "404" in err, err
        assert len(err.strip().splitlines()) == 2  # the progress line, then the refusal
    finally:
        server.shutdown()
        server.server_close()


def test_an_exported_archive_is_named_as_one(tmp_path, capsys):
    archive = tmp_path / "lab-x-redacted.tar.gz"
    archive.write_bytes(b"\x1f\x8b")
    code, out, err = _cli(["replay", str(archive), "--to", "http://127.0.0.1:9"], capsys)
    assert (code, out) == (2, "") and "extract it first" in err and len(err.strip().splitlines()) == 1


def test_an_export_without_bodies_is_named_as_one(tmp_path, capsys):
    """Said only "request 1: its body is missing (...body-000001.bin)"."""
    bundle = _bundle(tmp_path)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["request_bodies"] = False
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    for body in (bundle / "requests").glob("body-*.bin"):
        body.unlink()
    code, out, err = _cli(["replay", str(bundle), "--to", "http://127.0.0.1:9", "--allow-bundle-url"], capsys)
    assert (code, out) == (2, "") and "exported without the requests' bodies" in err
