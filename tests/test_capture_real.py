"""`mlxwatch capture` against the real mlx_lm.server in each failure shape, both versions.

Every assertion is on the bundle as written: real py-spy output, the classification, the
manifest's step records, and what a redacted export leaves out.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from mlxwatch.capture import CaptureRequest, capture_bundle, export_bundle
from mlxwatch.capture.classify import IDLE_CPU
from lab.clients import retry_every
from lab.server import LabServer

CEILING = 30.0


def request_for(lab, out: Path, **kw) -> CaptureRequest:
    return CaptureRequest(pid=lab.pid, out_dir=out, url=lab.url, log=lab.log_path, label="lab",
                          snapshots=3, spacing=1.0, ceiling=CEILING, probe_first_token_timeout=3.0,
                          probe_timeout=5.0, **kw)


def trigger(lab, fault: str) -> None:
    """Switch the fault on and send one request so the batch loop takes a faulty step."""
    lab.set_fault(fault)
    try:
        httpx.post(f"{lab.url}/v1/chat/completions", trust_env=False, timeout=2.0,
                   json={"messages": [{"role": "user", "content": "trigger"}], "max_tokens": 2})
    except httpx.HTTPError:
        pass


def capture(lab, out: Path, **kw):
    t0 = time.monotonic()
    bundle = asyncio.run(capture_bundle(request_for(lab, out, **kw)))
    return bundle, time.monotonic() - t0


def stacks_text(bundle) -> str:
    return "".join(p.read_text() for p in sorted((bundle.path / "stacks").glob("pyspy-*.txt")))


def assert_spin_kind(bundle) -> None:
    """A spinning server's kind is decided by evidence that moves with load: a stack that moves
    (livelock) or, where every snapshot caught it in mx.eval, the process CPU. Stable: it is a
    hang (never busy, healthy or unknown), and a livelock whenever the process computed at all."""
    c, cpu = bundle.classification, bundle.manifest["cpu"]["process"]
    assert c.kind in ("livelock", "blocked"), c
    if cpu is not None and cpu >= IDLE_CPU:
        assert c.kind == "livelock", (cpu, c)


@pytest.mark.parametrize("fault, kind, mark", [("spin", None, "_spin_step"), ("block", "blocked", "_block_forever"),
                                               ("die", "dead_thread", None)])
def test_each_fault_is_classified_from_its_evidence(lab, tmp_path, fault, kind, mark):
    """Livelock, block and dead thread: real stacks with the fault's frame, inside the ceiling;
    the kind exactly where the evidence is deterministic (a thread parked in a wait, a thread
    gone), and consistent with the recorded CPU for the spin."""
    trigger(lab, fault)
    bundle, elapsed = capture(lab, tmp_path)
    assert elapsed < CEILING
    if kind is None:
        assert_spin_kind(bundle)
    else:
        assert bundle.classification.kind == kind, bundle.classification
    text = stacks_text(bundle)
    if mark:
        assert mark in text
    assert "serve_forever" in text  # real py-spy output of the real server's main thread
    if fault == "die":
        assert "_generate" not in text
    else:
        assert "_generate (mlx_lm/server.py" in text and "next (" in text
    steps = {s["name"]: s for s in bundle.manifest["steps"]}
    assert steps["stacks"]["outcome"] == "ok" and steps["cpu"]["outcome"] == "ok"
    assert len(list((bundle.path / "stacks").glob("pyspy-*.json"))) == 3
    probe = json.loads((bundle.path / "probe.json").read_text())
    assert probe["healthy"] is False and probe["models"]["status"] == 200


DEFAULTS_TARGET = 8.0  # issue 7: a bundle of a hung server in <= 8 s with the default settings
LOADED_SLACK = 3.0  # for a loaded 2-core machine shared with other jobs


def test_livelock_capture_with_defaults_is_fast_and_not_fooled_by_admissions(lab, tmp_path):
    """Default settings (3 snapshots 2 s apart, first-token limit 10 s) on a livelocked server
    that a client keeps retrying every 2 s: the bundle is done within the 8 s target (asserted
    with slack for a loaded machine), still says livelock (admissions are not progress), and
    the capture's probe's lingering drain is handed back rather than waited for."""
    from mlxwatch.probes import run_check

    trigger(lab, "spin")
    stop = threading.Event()
    retrier = threading.Thread(target=retry_every, args=(lab.url, 2.0, stop), daemon=True)
    retrier.start()

    async def run():
        t0 = time.monotonic()
        bundle = await capture_bundle(CaptureRequest(pid=lab.pid, out_dir=tmp_path, url=lab.url, log=lab.log_path,
                                                     label="lab"))
        elapsed = time.monotonic() - t0
        handed_back = bundle.lingering is not None and not bundle.lingering.done()
        if bundle.lingering is not None:
            bundle.lingering.cancel()
            await asyncio.gather(bundle.lingering, return_exceptions=True)
        return bundle, elapsed, handed_back

    try:
        time.sleep(2.5)  # the retrying client is admitted at least once before the capture
        bundle, elapsed, handed_back = asyncio.run(run())
    finally:
        stop.set()
        retrier.join(10)
    assert_spin_kind(bundle)  # never busy: the retries were seen, and not taken for progress
    assert bundle.manifest["log_window"]["admissions"] >= 1
    assert "_spin_step" in stacks_text(bundle)
    assert elapsed < DEFAULTS_TARGET + LOADED_SLACK, bundle.manifest["steps"]
    steps = {s["name"]: s for s in bundle.manifest["steps"]}
    assert steps["stacks"]["outcome"] == "ok" and steps["cpu"]["outcome"] == "ok" and steps["log"]["outcome"] == "ok"
    assert len(list((bundle.path / "stacks").glob("pyspy-*.json"))) == 3
    if "linger" in inspect.signature(run_check).parameters:
        assert handed_back


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_healthy_server_is_classified_healthy_in_a_private_hashed_bundle(lab, tmp_path):
    """A working server's bundle says healthy, with the probe's tokens as the evidence; 0700
    dirs, 0600 files, every file in the manifest with its size and sha256. (One capture: both
    were checked on the same healthy server.)"""
    import hashlib

    bundle, _ = capture(lab, tmp_path)
    assert bundle.classification.kind == "healthy"
    assert "_generate" in stacks_text(bundle)
    assert (bundle.path.stat().st_mode & 0o777) == 0o700
    for relname, meta in bundle.manifest["files"].items():
        if relname == "manifest.json":
            continue
        data = (bundle.path / relname).read_bytes()
        assert (bundle.path / relname).stat().st_mode & 0o777 == 0o600
        assert meta == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert not list(tmp_path.glob(".*.partial"))


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_sigstopped_server_completes_within_ceiling(lab, tmp_path):
    """A SIGSTOPped server: py-spy falls back to --nonblocking, HTTP does not answer: wedged."""
    os.kill(lab.pid, signal.SIGSTOP)
    try:
        bundle, elapsed = capture(lab, tmp_path)
    finally:
        os.kill(lab.pid, signal.SIGCONT)
        lab.set_fault("block")  # make the fixture relaunch: a stopped-and-continued server is suspect
    assert elapsed < CEILING
    assert bundle.classification.kind == "wedged", bundle.classification
    assert any("stopped" in line for line in bundle.classification.evidence)
    assert "--nonblocking" in stacks_text(bundle)
    assert "stopped" in bundle.manifest["cpu"]["statuses"]


def test_missing_pid_exits_1_with_one_line(tmp_path):
    """`mlxwatch capture` of a PID that does not exist: exit 1, one line, nothing written."""
    proc = subprocess.run([sys.executable, "-m", "mlxwatch", "capture", "99999999", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["mlxwatch: no process with PID 99999999"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_without_py_spy_the_bundle_still_completes(lab, tmp_path, monkeypatch):
    """py-spy absent from PATH (and from beside the interpreter): recorded, the rest captured."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "empty-bin" / "python"))
    trigger(lab, "block")
    bundle, _ = capture(lab, tmp_path / "bundles")
    steps = {s["name"]: s for s in bundle.manifest["steps"]}
    assert steps["stacks"]["outcome"] == "failed"
    assert steps["stacks"]["error"] == "py-spy not found on PATH (pip install py-spy)"
    assert steps["probe"]["outcome"] == "ok" and steps["cpu"]["outcome"] == "ok"
    assert "py-spy not found" in (bundle.path / "summary.md").read_text()
    assert bundle.classification.kind == "blocked" and bundle.classification.confidence == "low"


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_redacted_export_drops_an_in_flight_secret(server_python, lab_root, tmp_path):
    """A secret sentence in a request in flight reaches the raw bundle (DEBUG log) but no file
    of the redacted export."""
    secret = "The vault combination is 7-4-1-9 and the password is heliotrope."
    server = LabServer.start(server_python, lab_root / f"debug-{Path(server_python).parts[-3]}",
                             extra_args=("--log-level", "DEBUG"))
    try:
        server.set_fault("slow", 0.5)
        body = {"messages": [{"role": "user", "content": secret}], "max_tokens": 40, "stream": True}
        sender = threading.Thread(target=lambda: _send_quietly(server.url, body), daemon=True)
        sender.start()
        deadline = time.monotonic() + 20
        while secret not in server.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        bundle, _ = capture(server, tmp_path)
        raw = b"".join(p.read_bytes() for p in bundle.path.rglob("*") if p.is_file())
        assert secret.encode() in raw  # the raw bundle holds it: the redaction below is tested for real
        archive = export_bundle(bundle.path, redact=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                data = tar.extractfile(member).read()
                assert secret.encode() not in data, member.name
                assert b"heliotrope" not in data, member.name
            manifest = json.loads(tar.extractfile(f"{bundle.path.name}/manifest.json").read())
        assert manifest["redacted"] is True
        with tarfile.open(export_bundle(bundle.path, redact=False)) as tar:  # unredacted export keeps everything
            assert any(secret.encode() in tar.extractfile(m).read() for m in tar.getmembers())
    finally:
        server.stop()


def _send_quietly(url: str, body: dict) -> None:
    try:
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30, trust_env=False)
    except httpx.HTTPError:
        pass


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_capture_cli_then_show_and_export(lab, tmp_path):
    """The CLI path end to end: capture --json, bundle show, bundle export --redact."""
    trigger(lab, "block")
    cli = [sys.executable, "-m", "mlxwatch"]
    proc = subprocess.run(cli + ["capture", str(lab.pid), "--url", lab.url, "--log", str(lab.log_path),
                                 "--out", str(tmp_path), "--snapshots", "2", "--spacing", "0.5", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["classification"]["kind"] == "blocked"
    bundle = Path(result["path"])
    assert bundle.parent == tmp_path
    show = subprocess.run(cli + ["bundle", "show", str(bundle)], capture_output=True, text=True, timeout=60)
    assert show.returncode == 0 and show.stdout.startswith("# mlxwatch bundle: blocked")
    export = subprocess.run(cli + ["bundle", "export", str(bundle), "--redact"], capture_output=True, text=True, timeout=60)
    assert export.returncode == 0 and Path(export.stdout.strip()).name == f"{bundle.name}-redacted.tar.gz"
    bad = subprocess.run(cli + ["bundle", "show", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == (f"mlxwatch: bundle show: {tmp_path} is not a bundle (no "
                                                          "manifest.json or summary.md); `mlxwatch bundle list` shows "
                                                          "the bundles")
