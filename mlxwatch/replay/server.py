"""A server started for a replay (``--launch``): the bundle's recorded command line, on a free
loopback port, with this process's environment.

The prompt cache is part of a trigger (issue 35: two cache-priming requests before the long
one), so a replay that must start from a clean server starts one of its own, and ``--shrink``
one per trial. Only the PID started here is ever signalled, by its ``Popen``::

    server = launch(cmdline, cwd=None, startup_timeout=600)   # ReplayError if it never answers
    server.url, server.pid
    server.stop()
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mlxwatch.errors import ReplayError

READY_POLL = 0.25  # seconds between readiness checks of a starting server
STOP_GRACE = 5.0  # SIGTERM -> SIGKILL


def _loopback_port() -> int:
    """A loopback port free a moment ago, for a launched server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def on_port(cmdline: list[str], port: int) -> list[str]:
    """The command line listening on 127.0.0.1:``port``: its ``--port`` and ``--host`` replaced
    (either form, ``--port N`` or ``--port=N``), or added."""
    out: list[str] = []
    skip = False
    for arg in cmdline:
        if skip:
            skip = False
            continue
        if arg in ("--port", "--host"):
            skip = True
            continue
        if arg.startswith(("--port=", "--host=")):
            continue
        out.append(arg)
    return [*out, "--host", "127.0.0.1", "--port", str(port)]


@dataclass
class LaunchedServer:
    """One server this replay started."""

    cmdline: list[str]
    url: str
    log_path: Path
    _popen: subprocess.Popen = field(repr=False)

    @property
    def pid(self) -> int:
        return self._popen.pid

    def alive(self) -> bool:
        return self._popen.poll() is None

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM our child, SIGKILL after STOP_GRACE; reaped either way. Its log's directory
        goes with it, unless ``keep_log`` (a start that failed names the log to read)."""
        try:
            if self._popen.poll() is None:
                self._popen.terminate()
                try:
                    self._popen.wait(STOP_GRACE)
                except subprocess.TimeoutExpired:
                    self._popen.kill()
                    self._popen.wait(10)
        finally:
            if not keep_log:
                shutil.rmtree(self.log_path.parent, ignore_errors=True)


class LaunchCancelled(Exception):
    """The wait for a launched server was given up (``cancel`` set: Ctrl-C); the server is stopped."""


def launch(cmdline: list[str], *, cwd: str | None, startup_timeout: float, log_dir: Path | None = None,
           cancel: threading.Event | None = None) -> LaunchedServer:
    """Start ``cmdline`` on a free loopback port (environment inherited) and wait until it
    answers ``GET /v1/models`` (no generation: a readiness prompt would prime the cache);
    ReplayError, the process ended, if it exits or does not answer within ``startup_timeout``.
    Run in a worker thread, it hears no Ctrl-C: the caller sets ``cancel`` (LaunchCancelled, the
    server stopped and its directory removed), else the wait goes on and the server outlives it."""
    if not cmdline:
        raise ReplayError("the bundle records no server command line (manifest target.cmdline): give --to URL")
    port = _loopback_port()
    argv = on_port(cmdline, port)
    where = Path(tempfile.mkdtemp(prefix="mlxwatch-replay-", dir=log_dir))
    log_path = where / "server.log"
    if cwd is not None and not os.path.isdir(cwd):
        cwd = None
    try:
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                                     start_new_session=True)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in an argument
        shutil.rmtree(where, ignore_errors=True)
        raise ReplayError(f"cannot start the recorded server command {argv[0][:200]}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    server = LaunchedServer(argv, f"http://127.0.0.1:{port}", log_path, popen)
    try:
        _wait_ready(server, startup_timeout, cancel or threading.Event())
    except ReplayError:
        server.stop(keep_log=True)  # the error names the log
        raise
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: LaunchedServer, timeout: float, cancel: threading.Event) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if cancel.is_set():
                raise LaunchCancelled()
            if not server.alive():
                raise ReplayError(f"the launched server exited during its start (code {server._popen.returncode}); "
                                  f"see {server.log_path}")
            try:
                if client.get(f"{server.url}/v1/models").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            cancel.wait(READY_POLL)
    raise ReplayError(f"the launched server did not answer within {timeout:g}s; see {server.log_path}")
