"""``mlxwatch replay --launch`` stopped early (Ctrl-C) stops the server it started and removes
its directory, at once, while that server starts or while the replay runs. Found by trying it:
Ctrl-C during a slow start waited out the start (the wait ran in a worker thread the interrupt
never reached), then left the server it had started running, with its temp dir.

No model server: the recorded command line is a process that writes its PID and never becomes
ready, or one that serves (the stand-in) and hangs every request."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from lab.standin import STANDIN
from test_replay import _bundle

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "from mlxwatch.cli.app import main; main(sys.argv[1:])")
NEVER_READY = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(300)"
# The stand-in on the port replay gives it (its --port), its PID written first; every request hangs.
SERVING = ("import os, sys; a = sys.argv; port = a[a.index('--port') + 1]; open(a[1], 'w').write(str(os.getpid())); "
           "os.execv(sys.executable, [sys.executable, a[2], '--ports', f'{port}-{port}', '--mode', 'hang'])")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["starting", "replaying"])
def test_ctrl_c_stops_the_launched_server_and_removes_its_directory(tmp_path, when):
    bundle = _bundle(tmp_path)
    pid_file = tmp_path / "server.pid"
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["target"]["cmdline"] = ([sys.executable, "-c", NEVER_READY, str(pid_file)] if when == "starting" else
                                     [sys.executable, "-c", SERVING, str(pid_file), STANDIN])
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, "replay", str(bundle), "--launch", "--speed", "0.05",
                             "--stall-timeout", "60s"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    server = None
    try:
        deadline = time.monotonic() + 30
        while server is None and time.monotonic() < deadline:
            if pid_file.exists() and pid_file.read_text():
                server = int(pid_file.read_text())
            time.sleep(0.1)
        assert server is not None, proc.stderr.read() if proc.poll() is not None else "no server started"
        time.sleep(2.0 if when == "replaying" else 0.5)  # ready and the first requests sent; or still starting
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
        assert proc.returncode == 130 and err.strip().endswith("mlxwatch: interrupted"), err
        assert took < 10, took  # not the start's wait, nor a request's
        assert _gone(server)
        assert list(tmp.iterdir()) == []  # the server's log directory
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if server is not None and not _gone(server):
            os.kill(server, signal.SIGKILL)
