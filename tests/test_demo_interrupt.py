"""`mlxwatch demo` stopped early (Ctrl-C, SIGTERM), while its server starts or while it watches,
stops the server it started and removes its directory, and ends with one line and the shell's
code (130, 143). Found by a new user: the server kept listening and the model stayed in /tmp.

No mlx_lm.server here: the demo runs for real through the CLI in its own process, with only its
server's command and model swapped at the boundary (``LabServer.command``, ``make_tiny_model``):
a process that never becomes ready, or the token-streaming stand-in, started the same way (own
session, PID file, lab.json). What is checked is real: that process is gone, the directory too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lab.standin import STANDIN
from mlxwatch._lab import server as lab_server

ROOT = Path(__file__).resolve().parents[1]
NEVER_READY = "import time; time.sleep(300)"  # a server whose readiness never comes

# Runs `mlxwatch demo` (the CLI's own main) with the server swapped: argv[1] "start" = never
# ready, "watch" = the stand-in on the demo's port (ready at once, so the demo goes on to watch).
DRIVER = f"""
import importlib.util, signal, sys
# Ctrl-C as in a terminal: started from a script's background job (as .ci/run may be), this
# process would begin with SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
signal.signal(signal.SIGINT, signal.default_int_handler)
from mlxwatch._lab import server
from mlxwatch.cli.app import main

find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: object() if name == "mlx_lm" else find_spec(name, *a)

def tiny_model(python, out_dir):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "model.safetensors").write_bytes(b"weights")
    return out_dir

def command(self):
    if sys.argv[1] == "start":
        return [sys.executable, "-c", {NEVER_READY!r}]
    return [sys.executable, {STANDIN!r}, "--ports", str(self.port)]

server.make_tiny_model = tiny_model
server.server_version = lambda python: "0.0-test"
server.LabServer.command = command
main(["demo"])
"""


def _alive(pid: int, marker: str) -> bool:
    """Our child is still running: that PID, not a zombie, its command line naming ``marker``."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and marker in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def servers():
    """PIDs of the servers a test saw started, each with what its command line names; any still
    running at the end (the bug) is ended by that PID, never by name."""
    started: list[tuple[int, str]] = []
    yield started
    for pid, marker in started:
        if _alive(pid, marker):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("phase", ["start", "watch"])
@pytest.mark.parametrize(("signum", "code", "line"), [(signal.SIGINT, 130, "mlxwatch: interrupted"),
                                                      (signal.SIGTERM, 143, "mlxwatch: terminated")],
                         ids=["SIGINT", "SIGTERM"])
def test_demo_stopped_early_stops_its_server_and_removes_its_dir(tmp_path, servers, phase, signum, code, line):
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(out, "wb") as o, open(err, "wb") as e:
        demo = subprocess.Popen([sys.executable, "-c", DRIVER, phase], stdout=o, stderr=e, env=env, cwd=tmp_path)
    try:
        _wait_for(lambda: list(tmp.glob("mlxwatch-demo-*/server/server.pid")))
        workdir = next(tmp.glob("mlxwatch-demo-*"))
        pid_file = workdir / "server" / "server.pid"
        _wait_for(lambda: pid_file.read_text().endswith("\n"))
        pid = int(pid_file.read_text())
        servers.append((pid, NEVER_READY if phase == "start" else STANDIN))
        assert _alive(pid, servers[-1][1])
        if phase == "watch":  # asyncio.run is watching the stand-in
            _wait_for(lambda: "Server PID" in out.read_text())
            time.sleep(1.0)
        demo.send_signal(signum)
        demo.wait(60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == code, err.read_text()
    assert err.read_text().splitlines() == [line]  # one line, no traceback
    assert not _alive(pid, servers[-1][1])  # the server it started is gone ...
    assert list(tmp.iterdir()) == []  # ... and so is its directory, the model with it


def test_lab_server_that_never_gets_ready_is_ended(tmp_path, monkeypatch):
    """``LabServer.start`` raises when its server never answers; the process it started must not
    outlive that (the demo's server was left running after a failed or interrupted start)."""
    monkeypatch.setattr(lab_server, "make_tiny_model", lambda python, out_dir: out_dir)
    monkeypatch.setattr(lab_server.LabServer, "command", lambda self: [sys.executable, "-c", NEVER_READY])
    workdir = tmp_path / "server"
    with pytest.raises(RuntimeError, match="not ready after"):
        lab_server.LabServer.start(sys.executable, workdir, ready_timeout=1.0)
    pid = int((workdir / "server.pid").read_text())
    try:
        assert not _alive(pid, NEVER_READY)
    finally:
        if _alive(pid, NEVER_READY):
            os.kill(pid, signal.SIGKILL)
