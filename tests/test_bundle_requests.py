"""The recorded requests in a bundle (issue 35): a private part, exact bodies in arrival order,
the summary names the requests in flight and the ones before, and an export leaves the bodies
out unless asked, then says that it holds users' words."""

from __future__ import annotations

import json
import stat
import tarfile

from mlxwatch.capture import CaptureRequest, capture_bundle, export_bundle
from mlxwatch.capture.requests import load_requests
from mlxwatch.front.recorder import RecordedRequest

SECRET_WORDS = "the users private words 7f3a"


def recorded(n: int = 5) -> tuple[RecordedRequest, ...]:
    out = []
    for i in range(1, n + 1):
        body = json.dumps({"messages": [{"role": "user", "content": f"{SECRET_WORDS} #{i}"}], "stream": i == n,
                           "max_tokens": 10 * i, "temperature": 0.5, "seed": i}).encode()
        done = i < n - 1  # the last two were in flight at the verdict
        out.append(RecordedRequest(i, f"r{i}", 1e9 + i, 100.0 + i, "c1 127.0.0.1:5000", "POST",
                                   "/v1/chat/completions", i == n, 10 * i, (("Content-Type", "application/json"),),
                                   ("Authorization",), body, status=200 if done else None,
                                   first_token_mono=100.5 + i if done else None,
                                   last_token_mono=100.7 + i if done else None, tokens=3 if done else 0,
                                   finish_reason="stop" if done else None, outcome="ok" if done else None,
                                   ended_mono=101.0 + i if done else None))
    return tuple(out)


async def _bundle(tmp_path):
    bundle = await capture_bundle(CaptureRequest(pid=None, out_dir=tmp_path, label="lab", snapshots=1, spacing=0.1,
                                                 ceiling=10.0, recorded=recorded(), recorded_at=107.0))
    if bundle.lingering is not None:
        bundle.lingering.cancel()
    return bundle


async def test_the_bundle_keeps_the_recorded_requests_private_exact_and_in_order(tmp_path):
    bundle = await _bundle(tmp_path)
    back = load_requests(bundle.path)
    assert [r.body for r in back] == [r.body for r in recorded()]
    assert [r.t for r in back] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [r.in_flight for r in back] == [False, False, False, True, True]
    assert back[0].headers == (("Content-Type", "application/json"),)
    for path in (bundle.path / "requests").iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    entry = bundle.manifest["requests"]
    # delivery stopped when #4 arrived (104.0: the last token, #3's, came at 103.7): #4 was being
    # worked on, #5 came after
    assert [r["seq"] for r in entry["in_flight"]] == [4] and [r["seq"] for r in entry["arrived_after"]] == [5]
    assert [r["seq"] for r in entry["just_before"]] == [1, 2, 3] and entry["stopped_s_before_verdict"] == 3.0
    summary = (bundle.path / "summary.md").read_text()
    assert "The server was working on these when delivery stopped (3s before the verdict):\n- #4 " in summary
    assert "Arrived after delivery had stopped (waiting at the verdict):\n- #5 " in summary
    assert ("- #5 `/v1/chat/completions` 2s before the verdict: prompt 31 chars in 1 message(s), max_tokens 50, "
            "stream true, sampling temperature=0.5, seed=5; 0 token(s) delivered") in summary
    assert SECRET_WORDS not in summary and SECRET_WORDS not in json.dumps(bundle.manifest)


async def test_an_export_leaves_the_bodies_out_unless_asked(tmp_path):
    bundle = await _bundle(tmp_path)
    for redact in (True, False):
        plain = export_bundle(bundle.path, tmp_path / f"plain-{redact}.tar.gz", redact=redact)
        with tarfile.open(plain) as tar:
            names = tar.getnames()
            data = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())
        assert not [n for n in names if "/requests/body-" in n] and any(n.endswith("requests/requests.json")
                                                                      for n in names)
        assert SECRET_WORDS.encode() not in data
    full = export_bundle(bundle.path, tmp_path / "full.tar.gz", request_bodies=True)
    with tarfile.open(full) as tar:
        bodies = sorted(n for n in tar.getnames() if "/requests/body-" in n)
        got = [tar.extractfile(n).read() for n in bodies]
        manifest = json.loads(tar.extractfile(f"{bundle.path.name}/manifest.json").read())
    assert got == [r.body for r in recorded()] and manifest["request_bodies"] is True


async def test_an_export_with_the_bodies_replays(tmp_path):
    """The export made to attach to an upstream issue (redacted, --with-request-bodies) must be
    one `mlxwatch replay` takes: the redaction took each body's SHA-256 for a token ("[redacted]"),
    and the replay refused every body as changed since the capture (exit 2)."""
    bundle = await _bundle(tmp_path)
    full = export_bundle(bundle.path, tmp_path / "full.tar.gz", request_bodies=True)
    with tarfile.open(full) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    back = load_requests(tmp_path / "x" / bundle.path.name)
    assert [r.body for r in back] == [r.body for r in recorded()]
    plain = export_bundle(bundle.path, tmp_path / "plain.tar.gz")  # without the bodies: no hash of users' words
    with tarfile.open(plain) as tar:
        index = json.loads(tar.extractfile(f"{bundle.path.name}/requests/requests.json").read())
    assert {e["body_sha256"] for e in index} == {"[redacted]"}
