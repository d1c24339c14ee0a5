"""The newcomer's commands against a real ``mlx_lm.server`` (each mlx-lm version under test):
doctor, config init, capture's refusal of a process that is not the server, bundle list/show
of a real bundle and its archive, check --wait and a large --max-tokens, status exit codes and
--watch with a real daemon watching the real server."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from rich.console import Console

import mlxwatch.cli as cli
from mlxwatch.config import load_config
from lab.ports import free_port  # a loopback port free a moment ago


@pytest.fixture(autouse=True)
def no_user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "home" / "state"))
    monkeypatch.delenv("MLXWATCH_CONFIG", raising=False)


def write_config(tmp_path: Path, lab, **extra) -> Path:
    inst = {"name": "lab", "url": lab.url, "log": str(lab.log_path), "probe": {"interval": "1s"}, **extra}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "instances": [inst]}))
    return path


def mlxwatch(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.run(list(argv), out=Console(file=sys.stdout, width=200))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "internal error" not in captured.err, captured.err
    return code, captured.out, captured.err


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_doctor_on_the_real_server(lab, tmp_path, capsys):
    """Proven server, a probe with tokens, a real py-spy dump, the log the server writes: exit 0.
    A log the server does not write is a warning; a URL nothing listens on fails (exit 1)."""
    cfg = write_config(tmp_path, lab)
    code, out, _ = mlxwatch(capsys, "doctor", "--config", str(cfg), "--json")
    data = json.loads(out)
    found = {(f["instance"], f["check"]): f for f in data["findings"]}
    assert code == 0 and data["ok"], out
    assert found[("lab", "server")]["status"] == "ok" and f"PID {lab.pid}" in found[("lab", "server")]["message"]
    assert found[("lab", "probe")]["status"] == "ok"
    assert found[("lab", "stacks")]["status"] == "ok", found[("lab", "stacks")]
    assert found[("lab", "log")]["status"] == "ok" and f"written by PID {lab.pid}" in found[("lab", "log")]["message"]
    assert found[(None, "daemon")]["status"] == "warn"

    other = tmp_path / "other.log"
    other.write_text("")
    cfg = write_config(tmp_path, lab, log=str(other))
    code, out, _ = mlxwatch(capsys, "doctor", "--config", str(cfg))
    flat = " ".join(out.split())  # reflowed to 80 columns: a line may break between any two words
    assert code == 0 and f"does not write {other}" in flat and str(lab.log_path) in flat

    path = tmp_path / "dead.yaml"
    path.write_text(f"state_dir: {tmp_path / 'state'}\ninstances: [{{name: dead, url: 'http://127.0.0.1:{free_port()}'}}]\n")
    code, out, _ = mlxwatch(capsys, "--config", str(path), "doctor")
    assert code == 1 and "FAIL  server" in out and "1 problem(s) to fix" in out


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_config_init_finds_the_real_server(lab, tmp_path, capsys):
    """The running server is found with its address and its log; the file written validates and
    is never written over."""
    target = tmp_path / "conf" / "config.yaml"
    target.parent.mkdir()
    code, out, _ = mlxwatch(capsys, "config", "init", "--out", str(target))
    assert code == 0, out
    config = load_config(target)
    (ours,) = [i for i in config.instances if i.url == lab.url]
    assert ours.log == lab.log_path and ours.restart.method == "none"
    assert f"PID {lab.pid}" in target.read_text()
    code, _, err = mlxwatch(capsys, "config", "init", "--out", str(target))
    assert code == 2 and "exists; not overwriting" in err
    code, printed, _ = mlxwatch(capsys, "config", "init", "--print")
    assert code == 0 and lab.url in printed


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_capture_refuses_what_is_not_the_server_then_bundles_browse(lab, tmp_path, sleeper, capsys):
    """A PID that is not the mlx-lm server at the URL is refused (exit 2, one line) unless --force;
    the server's own PID is captured (URL found from where it listens), listed, shown and exported."""
    code, _, err = mlxwatch(capsys, "capture", str(sleeper), "--url", lab.url)
    assert code == 2 and f"that is PID {lab.pid}" in err and len(err.strip().splitlines()) == 1
    code, _, err = mlxwatch(capsys, "capture", str(lab.pid), "--url", f"http://127.0.0.1:{free_port()}")
    assert code == 2 and "is not the mlx-lm server listening at" in err and "--force" in err

    out_dir = tmp_path / "bundles"
    out_dir.mkdir()
    code, out, err = mlxwatch(capsys, "capture", str(lab.pid), "--out", str(out_dir), "--snapshots", "1", "--json")
    assert code == 0, err
    manifest = json.loads(out)
    assert manifest["target"]["url"] == lab.url and manifest["classification"]["kind"] == "healthy"
    bundle = Path(manifest["path"])

    cfg = write_config(tmp_path, lab)
    archive = tmp_path / "lab.tar.gz"
    code, out, err = mlxwatch(capsys, "--config", str(cfg), "capture", "--instance", "lab", "--out", str(archive),
                              "--snapshots", "1")
    assert code == 0 and archive.exists() and f"archive: {archive}" in " ".join(out.split()), err

    code, out, _ = mlxwatch(capsys, "bundle", "list", "--dir", str(out_dir), "--json")
    assert [b["path"] for b in json.loads(out)["bundles"]] == [str(bundle)]
    code, out, _ = mlxwatch(capsys, "--config", str(cfg), "bundle", "list")
    assert code == 0 and "lab " in out and "healthy" in out
    code, shown, _ = mlxwatch(capsys, "bundle", "show", str(archive))
    assert code == 0 and shown.startswith("# mlxwatch bundle: healthy") and "- target: PID" in shown
    code, out, _ = mlxwatch(capsys, "bundle", "show", "--json", str(archive))
    assert json.loads(out)["target"]["label"] == "lab"
    code, shown_dir, _ = mlxwatch(capsys, "bundle", "show", str(bundle))
    assert code == 0 and "None" not in shown_dir.splitlines()[2]  # "- target: PID N", no label given


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_check_wait_and_a_long_reply_on_the_real_server(lab, capsys):
    """--wait on a ready server: one probe, healthy at once. --max-tokens 1000 is healthy (the
    size limit scales with the tokens asked for), and leaves no broken pipe in the server's log."""
    code, out, _ = mlxwatch(capsys, "check", "--wait", "60s", lab.url)
    assert code == 0 and re.search(r"waited\s+\S+, 1 probe\b", out), out
    size = lab.log_path.stat().st_size
    code, out, _ = mlxwatch(capsys, "check", lab.url, "--max-tokens", "1000", "--json")
    data = json.loads(out)
    assert code == 0 and data["healthy"], data["reason"]
    with open(lab.log_path, "rb") as fh:
        fh.seek(size)
        assert b"BrokenPipeError" not in fh.read()


def _status(config: Path) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "mlxwatch", "status", "--config", str(config), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert "Traceback" not in proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
def test_status_exit_codes_and_watch_with_a_real_daemon(lab, tmp_path):
    """Daemon watching the real server: 0 once it is healthy; --watch prints each update; the
    daemon's log has no per-request httpx lines; stopped daemon: 1."""
    cfg = write_config(tmp_path, lab)
    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "mlxwatch", "run", "--config", str(cfg)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 90
        while True:  # until the daemon says so: its state file is the event
            code, status = _status(cfg)
            if code == 0:
                break
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        (inst,) = status["instances"]
        assert status["daemon"]["running"] and inst["state"] == "healthy" and inst["last_probe"]["ok"]
        human = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(cfg), "status", "--watch", "100ms",
                                "--count", "2"], capture_output=True, text=True, timeout=60)
        assert human.returncode == 0 and human.stdout.count("--- ") == 2 and "lab" in human.stdout
        assert all(len(line) <= 80 for line in human.stdout.splitlines() if line.startswith(("lab", "INSTANCE")))
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        log.close()
    assert daemon.returncode == 0
    text = (tmp_path / "daemon.log").read_text()
    assert "HTTP Request" not in text and "lab: healthy" in text
    code, status = _status(cfg)
    assert code == 1 and status["daemon"]["running"] is False
