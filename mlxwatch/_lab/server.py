"""Start a real ``mlx_lm.server`` with a switchable fault: the server ``mlxwatch demo`` watches.

The server is the stock ``mlx_lm.server`` console script of ``python``'s environment (any
interpreter with mlx-lm installed), with ``fault_server.py`` patched in at start by
``inject/sitecustomize.py``; its command line is a real server's. A tiny random model is made in
``workdir``. Everything stays on 127.0.0.1 and only the PID started here is ever signalled::

    server = LabServer.start(sys.executable, Path("/tmp/lab"))
    server.set_fault("spin")   # the next batch step livelocks
    server.relaunch()          # stop our PID, clear the fault, start again on the same port
    server.stop()

The launch recipe is saved as ``lab.json`` beside the log so that the demo's restart hook
(``python -m mlxwatch._lab.relaunch DIR``) can do the same from the daemon's side. The
test suite's lab (``tests/lab``) extends this class; nothing here is for tests only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from mlxwatch.host.process import ProcessIdentity

LAB_DIR = Path(__file__).parent
TINY_MODEL_SCRIPT = LAB_DIR / "tiny_model.py"
INJECT_DIR = LAB_DIR / "inject"  # holds the sitecustomize that installs the fault
SPEC_NAME = "lab.json"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_tiny_model(python: str, out_dir: Path) -> Path:
    """Write the tiny model with the server's interpreter (it needs mlx and tokenizers)."""
    if not (out_dir / "model.safetensors").exists():
        subprocess.run([python, str(TINY_MODEL_SCRIPT), str(out_dir)], check=True, capture_output=True, timeout=300)
    return out_dir


def server_version(python: str) -> str:
    """mlx-lm's version as ``python`` sees it."""
    out = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('mlx-lm'))"],
        check=True, capture_output=True, text=True, timeout=60,
    )
    return out.stdout.strip()


class LabFiles:
    """Where a lab server (one process, or a group's rank 0) listens and keeps its files: all in
    its ``workdir``."""

    workdir: Path
    port: int
    LOG = "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / self.LOG

    @property
    def fault_file(self) -> Path:
        return self.workdir / "fault"

    @property
    def model_dir(self) -> Path:
        return self.workdir / "model"


@dataclass
class LabServer(LabFiles):
    """One real server we started; owns its PID, log, fault file and launch recipe.

    Fields whose names start with ``_`` are this process's own; the others are the recipe."""

    workdir: Path
    python: str
    port: int
    pid: int = 0
    create_time: float = 0.0
    started: float | None = None  # host.process.start_stamp: what proves it is still our process
    start_fault: str = ""  # the fault file's text at every (re)launch: e.g. "prefill 12", slow from its start
    _popen: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    @property
    def pid_file(self) -> Path:
        return self.workdir / "server.pid"

    @classmethod
    def start(cls, python: str, workdir: Path, *, port: int | None = None, ready_timeout: float = 120.0,
              **recipe: Any) -> "LabServer":
        """Make the model if needed, launch, and wait until a real completion succeeds.
        ``recipe``: a subclass's own fields."""
        workdir.mkdir(parents=True, exist_ok=True)
        server = cls(workdir, os.path.abspath(python), port or _free_port(), **recipe)  # not resolved: a venv python is a symlink
        make_tiny_model(python, server.model_dir)
        server._save_spec()
        server.launch(ready_timeout)
        return server

    @classmethod
    def load(cls, workdir: Path) -> "LabServer":
        return cls(workdir, **json.loads((workdir / SPEC_NAME).read_text()))

    def _save_spec(self) -> None:
        spec = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "workdir" and not f.name.startswith("_")}
        tmp = self.workdir / (SPEC_NAME + ".tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, self.workdir / SPEC_NAME)

    def command(self) -> list[str]:
        script = Path(self.python).parent / "mlx_lm.server"  # the console script a user runs
        return [self.python, str(script), "--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port)]

    def environment(self) -> dict[str, str]:
        """The server's environment: offline, and the fault injector loaded at start."""
        return {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_HUB_CACHE": str(self.workdir / "hf-cache"),  # /v1/models scans it and errors if it is missing
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(INJECT_DIR),
            "MLXWATCH_FAULT_FILE": str(self.fault_file),
        }

    def launch(self, ready_timeout: float = 120.0) -> None:
        """Start the server process (fault reset to ``start_fault``) and wait until it generates
        (``ready_timeout`` 0: do not wait). If it never does, or the wait is interrupted, the
        process is ended before the exception goes on."""
        self.set_fault(self.start_fault)
        (self.workdir / "hf-cache").mkdir(exist_ok=True)
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.environment(), cwd=self.workdir, start_new_session=True,
            )
        try:
            self._popen = proc
            self.pid = proc.pid
            me = ProcessIdentity.of(proc.pid)
            self.create_time, self.started = me.create_time, me.started
            self.pid_file.write_text(f"{proc.pid}\n")
            self._save_spec()
            if ready_timeout > 0:
                self.wait_ready(ready_timeout)
        except BaseException:  # never ready, or interrupted (Ctrl-C, SIGTERM): it must not outlive us
            self._end_child(proc)
            raise

    def _end_child(self, proc: subprocess.Popen, grace: float = 5.0) -> None:
        """End the process ``launch`` just started, by its Popen: until we reap it, its PID
        cannot be anyone else's. SIGTERM, SIGKILL after ``grace``."""
        try:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(grace)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        finally:
            if self._popen is proc:
                self._popen = None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        body = {"messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
        with httpx.Client(trust_env=False, timeout=10) as client:
            while time.monotonic() < deadline:
                if not self.owned_process_alive():
                    raise RuntimeError(f"lab server exited during start; see {self.log_path}")
                try:
                    if client.post(f"{self.url}/v1/chat/completions", json=body).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"lab server not ready after {timeout:g}s; see {self.log_path}")

    def set_fault(self, fault: str, arg: float | None = None) -> None:
        """Switch a fault on (``die``, ``block``, ``spin``, ``slow``) or off (``""``)."""
        text = fault if arg is None else f"{fault} {arg}"
        tmp = self.fault_file.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.fault_file)

    def owned_process(self) -> psutil.Process | None:
        """Our server process, or None if it is gone or the PID now belongs to someone else."""
        if not self.pid or not ProcessIdentity(self.pid, self.create_time, (), None, self.started).alive():
            return None
        try:
            return psutil.Process(self.pid)
        except psutil.Error:
            return None

    def owned_process_alive(self) -> bool:
        return self.owned_process() is not None

    def refresh(self) -> None:
        """Adopt the PID recorded in lab.json: a restart hook may have relaunched the server."""
        try:
            spec = json.loads((self.workdir / SPEC_NAME).read_text())
        except (OSError, ValueError):
            return
        self.pid, self.create_time, self.started = spec["pid"], spec["create_time"], spec.get("started")

    def _wait_gone(self, timeout: float) -> bool:
        """Until our process is gone. A zombie counts as gone: its parent may be another process."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.owned_process() is None:
                return True
            time.sleep(0.05)
        return self.owned_process() is None

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM our PID (a SIGSTOPped one is continued first), SIGKILL after ``grace``."""
        self.refresh()
        proc = self.owned_process()
        if proc is not None:
            try:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                if not self._wait_gone(grace):
                    proc.kill()
                    self._wait_gone(10)
            except psutil.NoSuchProcess:
                pass
        self._reap()

    def _reap(self) -> None:
        if self._popen is not None:  # our own child (maybe already replaced by a hook): collect it
            if self._popen.poll() is None:
                self._popen.wait(10)
            self._popen = None

    def relaunch(self, ready_timeout: float = 120.0) -> None:
        self.stop()
        self.launch(ready_timeout)
