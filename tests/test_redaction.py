"""Redaction that holds: planted secrets in every place a bundle copies text from never reach a
redacted export, the raw bundle loses its environment and URL passwords unless the user asks
for it whole (``capture.redact: false``), and the evidence (frames, paths, line numbers, PIDs,
token counts, hex thread ids) survives every level."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest

import mlxwatch.probes
from mlxwatch.capture import CaptureRequest, capture_bundle, export_bundle, pyspy
import mlxwatch.cli as cli
from mlxwatch.shim import heartbeat, layout

sys.path.insert(0, str(Path(__file__).parent))
from shim_standin import write_standin

# Each planted secret is a unique string: none of it may appear in any byte of the export.
SECRETS = {
    "api_key": "sk-proj-Pl4ntedApiKeyValue0123456789",
    "flag_token": "Pl4nted-flag-token-4711",  # after --token: not token-shaped, only the flag says so
    "flag_eq": "Pl4ntedEqualsSecret",  # --client-secret=...
    "url_password": "Pl4ntedUrlPassw0rd",
    "url_user": "pl4ntedurluser",
    "query_token": "Pl4ntedQueryTok3n",
    "db_password": "Pl4ntedDbPassw0rd",
    "passphrase": "Pl4ntedPassphraseWords",
    "env_api_key": "Pl4ntedEnvApiKey",
    "hf": "hf_Pl4ntedHuggingFace0123456789",
    "gh": "ghp_Pl4ntedGitHubToken0123456789abcd",
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJwbGFudGVkIn0.Pl4ntedSig_123",
    "hex": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "bearer": "Pl4ntedBearerValue12345",
    "cookie": "Pl4ntedCookieValue777",
    "probe_body": "sk-Pl4ntedInAProbeBody0123456789",
    "verdict": "ghp_Pl4ntedInTheVerdict0123456789ab",
    "prior": "hf_Pl4ntedInAPriorProbe0123456789",
    "marker_private": "my diary Pl4ntedDiarySentence is here",  # a private sentence in a marker line
    "marker_params": "Pl4ntedParamsCaller",
    "env_hex": "0123456789abcdef0123456789abcdef01234567",  # a 40-hex token (GitHub classic PAT shape)
    "env_pass": "Pl4ntedConnPass",
}
S = SECRETS
ARGV_SECRETS = ["--api-key", S["api_key"], "--token", S["flag_token"], f"--client-secret={S['flag_eq']}",
                "--db", f"https://{S['url_user']}:{S['url_password']}@db.example.invalid/x?token={S['query_token']}",
                "--max-tokens", "4"]
ENV_SECRETS = {"DATABASE_URL": f"postgres://app:{S['db_password']}@db.example.invalid/prod",
               "BACKUP_PASSPHRASE": S["passphrase"], "OPENAI_API_KEY": S["env_api_key"], "HF_TOKEN": S["hf"],
               "GH_PAT": S["env_hex"], "MYAPP_CONN": f"user=app pass={S['env_pass']} host=db",
               "MLXWATCH_TEST_KEEP": "kept-plain-value"}
LOG_LINES = [
    f'127.0.0.1 - - [05/Jul/2026 08:19:41] "GET /v1/models?api_key={S["api_key"]} HTTP/1.1" 200 -',
    f'127.0.0.1 - - [05/Jul/2026 08:19:42] "GET /v1/models?token={S["query_token"]}&max_tokens=4 HTTP/1.1" 200 -',
    f"2026-07-05 08:19:43,000 - INFO - headers: Authorization: Bearer {S['bearer']}; Cookie: sid={S['cookie']}",
    f"[METAL] Insufficient Memory while serving alice prompt: {S['marker_private']}",
    f"Missing 3 parameters in the request of {S['marker_params']}",
    "Traceback (most recent call last):",
    '  File "/opt/srv/upstream.py", line 12, in connect',
    f"ValueError: cannot reach https://{S['url_user']}:{S['url_password']}@db.example.invalid with {S['gh']} "
    f"and {S['jwt']} (key {S['hex']})",
    "Prompt processing progress: 512/2048",
]
# Started after the stand-in server: its log lines come after its startup, a thread named with a
# token shows in every stack dump (py-spy's and the shim's), and the process waits.
PROGRAM = f"""
import sys, threading, time
def leak():
    time.sleep(0.3)
    print({chr(10).join(LOG_LINES)!r}, flush=True)
    time.sleep(600)
threading.Thread(target=leak, name="refresher {S['gh']}", daemon=True).start()
import mlx_lm.server as s; s.main()
"""


class _Probe:
    """Stands in for run_check: a failed probe whose transcript and detail quote secrets."""

    async def __call__(self, client, url, *, first_token_timeout, timeout, endpoint_timeout, linger=0.0):
        from mlxwatch.probes import CheckReport, EndpointResult, GenerationProbeResult

        gen = GenerationProbeResult(url, time.time(), ok=False, status=500, failure="http_error",
                                    detail=f'HTTP 500: {{"error": "bad key {S["probe_body"]}"}}',
                                    transcript=[{"t": 0.1, "kind": "error", "text": f"upstream said {S['probe_body']}"}])
        return CheckReport(url, gen, EndpointResult("/health", 200, "ok"),
                           EndpointResult("/v1/models", 200, f'{{"auth": "{S["probe_body"]}"}}'))


@pytest.fixture
def secret_server(tmp_path, monkeypatch):
    """The stand-in mlx-lm server through `mlxwatch launch` (so it has the shim), its argv and
    environment full of secrets, logging them; a fake probe quoting more."""
    monkeypatch.setenv(layout.RUNTIME_ENV, str(tmp_path / "run"))
    monkeypatch.setattr(mlxwatch.probes, "run_check", _Probe())
    root = write_standin(tmp_path / "pkg", True)
    mode = tmp_path / "mode"
    mode.write_text("block")
    log = tmp_path / "server.log"
    env = {**os.environ, "PYTHONPATH": str(root), "STANDIN_MODE_FILE": str(mode), "PYTHONUNBUFFERED": "1",
           layout.RUNTIME_ENV: str(tmp_path / "run"), **ENV_SECRETS}
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlxwatch", "launch", "--", sys.executable, "-c", PROGRAM,
                                 *ARGV_SECRETS], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        create_time = psutil.Process(proc.pid).create_time()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            hb, _ = heartbeat.read(proc.pid, create_time, str(tmp_path / "run"))
            if hb is not None and S["hex"] in log.read_text(errors="replace"):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"stand-in not ready; log:\n{log.read_text(errors='replace')}")
        yield proc.pid, log
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _capture(pid: int, log: Path, out: Path, stacks: str, **kw):
    req = CaptureRequest(pid=pid, out_dir=out, url="http://127.0.0.1:9", log=log, label="secrets", snapshots=2,
                         spacing=0.3, ceiling=30, stacks=stacks, verdict=f"2 failed probes: HTTP error: {S['verdict']}",
                         prior_probes=[{"generation": {"detail": f"HTTP 401: token {S['prior']}"}}], **kw)
    return asyncio.run(capture_bundle(req))


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _raw(bundle: Path) -> dict[str, bytes]:
    return {str(p.relative_to(bundle)): p.read_bytes() for p in bundle.rglob("*") if p.is_file()}


def _found(files: dict[str, bytes], secrets) -> list[tuple[str, str]]:
    return [(name, s) for name, data in files.items() for s in secrets if s.encode() in data]


@pytest.mark.parametrize("stacks", ["pyspy", "shim"])
def test_no_planted_secret_reaches_the_export(secret_server, tmp_path, stacks, capsys):
    """Secrets planted in the server's command line (manifest, process.json, stack headers),
    environment, log (access lines, headers, an exception message), thread names (stacks), the
    probe's transcript and the verdict: the default `bundle export` has none of them in any
    byte of any file, says it is redacted, and still holds the evidence."""
    if stacks == "pyspy" and pyspy.find_py_spy() is None:
        pytest.fail("py-spy is a dependency: it must be installed for this test")
    pid, log = secret_server
    bundle = _capture(pid, log, tmp_path / "bundles", stacks)
    raw = _raw(bundle.path)
    assert S["api_key"].encode() in raw["process.json"]  # planted where the issue measured them...
    assert any(S["gh"].encode() in data for name, data in raw.items() if name.startswith("stacks/"))
    assert S["hex"].encode() in raw["log-tail.txt"] and S["probe_body"].encode() in raw["probe.json"]
    assert S["marker_private"].encode() in raw["summary.md"] and S["marker_params"].encode() in raw["summary.md"]
    assert cli.run(["bundle", "export", str(bundle.path), "--out", str(tmp_path)]) == 0  # the default is redacted
    captured = capsys.readouterr()
    archive = Path(captured.out.strip())
    assert archive.name == f"{bundle.path.name}-redacted.tar.gz" and "redacted" in captured.err
    files = _members(archive)
    assert _found(files, SECRETS.values()) == []
    manifest = json.loads(files["manifest.json"])
    assert manifest["redacted"] is True and "--no-redact" in manifest["redaction"]
    # ...and the evidence survives: the frames, the PID, the log's markers, the flags and counts
    stack_text = b"".join(d for n, d in files.items() if n.startswith("stacks/") and n.endswith(".txt")).decode()
    assert "_generate" in stack_text and "server.py" in stack_text
    assert manifest["name"] == bundle.path.name and manifest["target"]["pid"] == pid
    assert "--max-tokens" in manifest["target"]["cmdline"]
    assert manifest["target"]["cmdline"][manifest["target"]["cmdline"].index("--max-tokens") + 1] == "4"
    tail = files["log-tail.txt"].decode()
    assert '"GET /v1/models?api_key=[redacted] HTTP/1.1" 200' in tail
    assert "Prompt processing progress: 512/2048" in tail
    assert '  File "/opt/srv/upstream.py", line 12, in connect' in tail
    markers = json.loads(files["log-markers.json"])
    assert markers["last_traceback"][-1].startswith("ValueError: cannot reach https://[redacted]@db.example.invalid")
    assert sorted(files) == sorted(_members(export_bundle(bundle.path, tmp_path / "raw.tar.gz", redact=False)))


def test_raw_bundle_drops_environment_and_url_passwords_unless_asked(secret_server, tmp_path):
    """By default the raw bundle has no environment secret and no URL password in any file, and
    keeps the rest (the command line's other arguments, plain environment values); with
    ``capture.redact: false`` it is complete, and the raw export (`--no-redact`) says so."""
    pid, log = secret_server
    private = _raw(_capture(pid, log, tmp_path / "private", "shim").path)
    gone = [S["db_password"], S["passphrase"], S["env_api_key"], S["hf"], S["url_password"], S["env_hex"],
            S["env_pass"]]
    assert _found(private, gone) == []
    process = json.loads(private["process.json"])
    assert process["environment"]["MYAPP_CONN"] == "user=app pass=[redacted] host=db"
    assert process["environment"]["DATABASE_URL"] == "postgres://app:[redacted]@db.example.invalid/prod"
    assert process["environment"]["MLXWATCH_TEST_KEEP"] == "kept-plain-value"
    assert S["api_key"] in process["cmdline"] and S["flag_token"] in process["cmdline"]
    complete = _capture(pid, log, tmp_path / "complete", "shim", redact=False)
    files = _raw(complete.path)
    assert [s for s in gone if not any(s.encode() in d for d in files.values())] == []
    assert json.loads(files["manifest.json"])["settings"]["redact"] is False
    assert cli.run(["bundle", "export", str(complete.path), "--no-redact", "--out", str(tmp_path)],
                   out=None) == 0
    archive = tmp_path / f"{complete.path.name}.tar.gz"
    exported = _members(archive)
    assert json.loads(exported["manifest.json"])["redacted"] is False
    assert S["db_password"].encode() in exported["process.json"]


EVIDENCE = """\
Process 4242: /opt/homebrew/bin/python3.12 -m mlx_lm.server --model mlx-community/Meta-Llama-3-70B-Instruct-4bit --max-tokens 512
Python v3.12.8 (/opt/homebrew/Cellar/python@3.12/3.12.8/bin/python3.12)

Thread 0x16FF87000 (active): "Thread-1 (_generate)"
    _step (mlx_lm/generate.py:1369)
    next (mlx_lm/generate.py:1415)
    _generate (/opt/srv/venv/lib/python3.12/site-packages/mlx_lm/server.py:853)
Thread 0x00007f3a2b1c4740 (most recent call first):
  File "/opt/srv/venv/lib/python3.12/site-packages/mlx_lm/server.py", line 1266 in handle_completion
2026-07-05 08:19:39,913 - INFO - Prompt processing progress: 2048/8192
127.0.0.1 - - [05/Jul/2026 08:19:41] "POST /v1/chat/completions HTTP/1.1" 200 -
RuntimeError: [metal::malloc] Resource limit (499000) exceeded. pid=4242 max_tokens=512 tokens=31
/opt/hf/hub/models--mlx-community--Qwen3-8B-4bit/snapshots/0123456789abcdef0123456789abcdef01234567/config.json
"""


@pytest.mark.parametrize("level", ["private", "public"])
def test_evidence_survives_redaction(level):
    """Stack frames, file paths, line numbers, PIDs, token counts, model names and hex thread
    ids pass every level unchanged (no home directory in this text to fold)."""
    from mlxwatch.capture.redact import redact_text

    assert redact_text(EVIDENCE, level) == EVIDENCE


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
@pytest.mark.parametrize("fault", ["block", "die"])
def test_a_real_bundle_keeps_its_evidence_through_the_export(lab, tmp_path, fault):
    """A real server's bundle, exported with the defaults: every py-spy stack dump is the raw
    one with only home paths folded (thread ids, frames, line numbers, the fault's frame), and
    every kept log line, and the last traceback's frame and exception lines, are unchanged."""
    import httpx

    from mlxwatch.capture.redact import redact_home

    lab.set_fault(fault)
    try:
        httpx.post(f"{lab.url}/v1/chat/completions", trust_env=False, timeout=2.0,
                   json={"messages": [{"role": "user", "content": "trigger"}], "max_tokens": 2})
    except httpx.HTTPError:
        pass
    bundle = asyncio.run(capture_bundle(CaptureRequest(
        pid=lab.pid, out_dir=tmp_path, url=lab.url, log=lab.log_path, label="lab", snapshots=2, spacing=1.0,
        ceiling=30.0, probe_first_token_timeout=3.0, probe_timeout=5.0)))
    raw = _raw(bundle.path)
    files = _members(export_bundle(bundle.path))
    stacks = sorted(n for n in raw if n.startswith("stacks/pyspy-") and n.endswith(".txt"))
    assert stacks
    for name in stacks:
        assert files[name].decode() == redact_home(raw[name].decode()), name
    text = "".join(files[n].decode() for n in stacks)
    assert "serve_forever" in text
    if fault == "block":
        assert "_generate (mlx_lm/server.py" in text and "next (" in text
    raw_tail = redact_home(raw["log-tail.txt"].decode()).splitlines()
    kept = [line for line in files["log-tail.txt"].decode().splitlines() if not line.startswith("[redacted ")]
    assert kept and all(line in raw_tail for line in kept)
    assert any("Starting httpd at" in line for line in kept)
    markers = json.loads(files["log-markers.json"])
    raw_markers = json.loads(raw["log-markers.json"])
    if fault == "die":
        raw_frames = [redact_home(line) for line in raw_markers["last_traceback"] if line.startswith("  File ")]
        assert raw_frames and [line for line in markers["last_traceback"] if line.startswith("  File ")] == raw_frames
        assert markers["last_traceback"][-1] == raw_markers["last_traceback"][-1]  # the exception line
        assert markers["thread_exceptions"] == raw_markers["thread_exceptions"]
