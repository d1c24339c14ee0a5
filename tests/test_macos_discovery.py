"""Discovery by launchd label: an instance with `url` and `restart: {launchd: LABEL}` gets its
server's PID (and, without a `log`, its log) from launchd, proven by the exact address.

launchctl is replaced at its seam (`mlxwatch.host.launchctl.runner`) by one that answers with the
real `launchctl print` output recorded in boxen/puppet-boxen#104 (tests/data), its `pid` and
`path` lines pointed at this test's own processes and files. The servers are real processes
listening on loopback (mlxwatch's token-streaming stand-in, whose command line is not mlx-lm's:
the label, like a pid_file, is what proves it).
"""

from __future__ import annotations

import asyncio
import plistlib
import re
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from mlxwatch.capture.classify import Classification
from mlxwatch.capture.collector import Bundle
from mlxwatch.config import CaptureConfig, parse_config
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.host import launchctl
from mlxwatch.host.commands import CommandResult
from mlxwatch.host.process import lookup_server
from mlxwatch.journal.incidents import Journal
from lab.ports import free_port  # a loopback port free a moment ago
from lab.standin import STANDIN  # the token-streaming stand-in's script
from mlxwatch.restart.methods import restart

DATA = Path(__file__).parent / "data"
RECORDED = (DATA / "launchctl-print-boxen-104.txt").read_text().split("# ----- output below, as quoted -----\n", 1)[1]


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def start(argv: list[str], ready: bool = False) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE if ready else subprocess.DEVNULL, text=True)
        started.append(proc)
        if ready:
            assert proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in started:  # only the PIDs started here
        proc.kill()
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()


def standin(procs, tmp_path: Path, mode: str = "ok") -> tuple[str, Path, subprocess.Popen]:
    port = free_port()
    mode_file = tmp_path / f"mode-{port}"
    mode_file.write_text(mode)
    proc = procs([sys.executable, STANDIN, "--ports", f"{port}-{port}",
                  "--mode-file", str(mode_file)], ready=True)
    return f"http://127.0.0.1:{port}", mode_file, proc


def wait_listening(url: str, timeout: float = 20.0) -> None:
    port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {url}")


class Launchd:
    """gui/501 with one job: `print` answers the recorded output for its current PID and plist."""

    def __init__(self, label: str, plist: Path | None, pid: int | None):
        self.label, self.plist, self.pid = label, plist, pid
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        argv = list(argv)
        self.calls.append(argv)
        if argv[1] == "print" and argv[-1] == f"gui/501/{self.label}":
            text = RECORDED
            text = re.sub(r"pid = \d+", f"pid = {self.pid}", text) if self.pid else re.sub(r"\n\s*pid = \d+", "", text)
            if self.plist is not None:
                text = text.replace("/Library/LaunchDaemons/dev.mysql.plist", str(self.plist))
            return launchctl.Result(0, text, "")
        return launchctl.Result(113, "", f'Could not find service "{argv[-1].rsplit("/", 1)[-1]}" in domain for user gui: 501')


@pytest.fixture
def user_501(monkeypatch):
    """The daemon runs as the logged-in user 501 (this test process is root in CI)."""
    monkeypatch.setattr(launchctl, "effective_uid", lambda: 501)
    monkeypatch.setattr(launchctl, "real_uid", lambda: 501)


def job_plist(tmp_path: Path, log: Path) -> Path:
    path = tmp_path / "dev.mysql.plist"
    path.write_bytes(plistlib.dumps({"Label": "dev.mysql", "StandardErrorPath": str(log), "StandardOutPath": str(log)}))
    return path


def test_the_labels_pid_listening_on_the_address_is_the_server(procs, tmp_path, monkeypatch, user_501):
    url, _, server = standin(procs, tmp_path)
    log = tmp_path / "server.log"
    fake = Launchd("dev.mysql", job_plist(tmp_path, log), server.pid)
    monkeypatch.setattr(launchctl, "runner", fake)
    plain = lookup_server(url)
    assert plain.identity is None and "port" in (plain.stranger or "")  # by port: a stranger (not mlx-lm)
    found = lookup_server(url, launchd_label="dev.mysql")
    assert found.identity is not None and found.identity.pid == server.pid
    assert found.identity.address == ("127.0.0.1", int(url.rsplit(":", 1)[1]))
    assert found.log == log  # from the job's plist (StandardErrorPath), not print's stderr path
    assert fake.calls == [["launchctl", "print", "gui/501/dev.mysql"]]


def test_a_process_the_job_started_may_be_the_listener(procs, tmp_path, monkeypatch, user_501):
    """`uv run mlx_lm server ...` under launchd: the job's PID is uv, its child listens."""
    port = free_port()
    wrapper = procs([sys.executable, "-c",
                     "import subprocess, sys; subprocess.run([sys.executable, "
                     f"{STANDIN!r}, '--ports', '{port}-{port}'])"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_listening(url)
        monkeypatch.setattr(launchctl, "runner", Launchd("dev.mysql", None, wrapper.pid))
        found = lookup_server(url, launchd_label="dev.mysql")
        assert found.identity is not None and found.identity.pid != wrapper.pid
        assert STANDIN in found.identity.cmdline
        assert found.log == Path("/opt/boxen/log/mysql/console.log")  # no readable plist: print's stderr path
    finally:  # the wrapper's child is ours too (the fixture ends only the wrapper): end it by its PID
        for child in psutil.Process(wrapper.pid).children(recursive=True):
            child.kill()


def test_a_labels_pid_that_does_not_listen_there_is_reported_never_proven(procs, tmp_path, monkeypatch, user_501):
    url, _, server = standin(procs, tmp_path)
    other = procs([sys.executable, "-c", "import time; time.sleep(60)"])
    monkeypatch.setattr(launchctl, "runner", Launchd("dev.mysql", None, other.pid))
    found = lookup_server(url, launchd_label="dev.mysql")
    assert found.identity is None
    assert found.loading is not None and found.loading.pid == other.pid  # alive, not listening: loading
    assert found.stranger is not None and f"PID {server.pid}" in found.stranger
    assert f"launchd label dev.mysql runs PID {other.pid}" in found.detail and "does not listen" in found.detail


def test_a_label_launchd_does_not_know_falls_back_to_the_port(procs, tmp_path, monkeypatch, user_501):
    url, _, server = standin(procs, tmp_path)
    monkeypatch.setattr(launchctl, "runner", Launchd("other.label", None, None))
    found = lookup_server(url, launchd_label="dev.mysql")
    assert found.identity is None and f"PID {server.pid}" in (found.stranger or "")
    assert found.detail.startswith('launchd label dev.mysql: launchctl print gui/501/dev.mysql: Could not find service')


def test_a_loaded_job_without_a_pid_falls_back_and_still_names_its_log(procs, tmp_path, monkeypatch, user_501):
    url, _, _ = standin(procs, tmp_path)
    monkeypatch.setattr(launchctl, "runner", Launchd("dev.mysql", None, None))
    found = lookup_server(url, launchd_label="dev.mysql")
    assert found.identity is None and "no PID" in found.detail
    assert found.log == Path("/opt/boxen/log/mysql/console.log")


def test_as_root_without_a_uid_the_label_is_not_asked_and_the_reason_is_given(procs, tmp_path, monkeypatch):
    url, _, _ = standin(procs, tmp_path)
    monkeypatch.setattr(launchctl, "effective_uid", lambda: 0)
    fake = Launchd("dev.mysql", None, None)
    monkeypatch.setattr(launchctl, "runner", fake)
    found = lookup_server(url, launchd_label="dev.mysql")
    assert fake.calls == [] and "set restart.uid" in found.detail
    fake.pid = 1
    lookup_server(url, launchd_label="dev.mysql", launchd_uid=501)
    assert fake.calls == [["launchctl", "print", "gui/501/dev.mysql"]]


async def test_only_url_and_a_launchd_label_end_to_end(procs, tmp_path, monkeypatch, user_501):
    """The whole path with a config that names only the URL and the label: the server is proven
    by launchd's PID, its log (from the job's plist) is followed and handed to the capture, the
    hang is captured from that PID, and the restart is `launchctl kickstart -k gui/501/LABEL`."""
    url, mode_file, server = standin(procs, tmp_path)
    log = tmp_path / "server.log"
    log.write_text("2026-01-01 00:00:00,000 - INFO - Starting httpd at 127.0.0.1 on port 1...\n")
    monkeypatch.setattr(launchctl, "runner", Launchd("dev.mysql", job_plist(tmp_path, log), server.pid))
    cfg = parse_config({"instances": [{
        "name": "local", "url": url, "restart": {"launchd": "dev.mysql"},
        "probe": {"interval": 0.2, "suspect_interval": 0.1, "first_token_timeout": 0.5, "timeout": 1.0,
                  "failures": 1, "endpoint_timeout": 0.3, "startup_timeout": 30},
    }]}, "test.yaml")
    inst = cfg.instances[0]
    assert inst.log is None and inst.pid_file is None
    cfg = replace(cfg, state_dir=tmp_path / "state", capture=CaptureConfig(snapshots=1, spacing=0.1, ceiling=5.0))
    captured, kicked = [], []

    async def capture(request):
        captured.append(request)
        return Bundle(tmp_path / "bundle", Classification("blocked", "high", ["test"]), {})

    async def fake_runner(argv, timeout):
        kicked.append(list(argv))
        mode_file.write_text("ok")  # launchd restarted it
        return CommandResult(list(argv), 0, b"", b"", 0.01)

    daemon = Daemon(cfg, cfg.state_dir, heartbeat=3600.0, shared_overrides={
        "capture_fn": capture, "restart_fn": lambda ctx: restart(ctx, runner=fake_runner)})
    stop, reload = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(daemon.run(stop, reload, load_config=lambda: cfg))
    journal = Journal(cfg.state_dir)

    async def until(pred, what, timeout=20.0):
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    try:
        await until(lambda: "local" in getattr(daemon, "watchers", {}) and daemon.watchers["local"].identity,
                    "the server proven by label")
        watcher = daemon.watchers["local"]
        assert watcher.identity.pid == server.pid and watcher.log_source.tracker.log == log
        mode_file.write_text("hang")
        await until(lambda: kicked, "the restart")
        await until(lambda: any(r.get("event") == "recovered" for r in journal.records()), "recovery")
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
    assert captured[0].pid == server.pid and captured[0].log == log
    assert kicked == [["launchctl", "kickstart", "-k", "gui/501/dev.mysql"]]
