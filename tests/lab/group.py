"""The test lab's distributed server: a real 2-rank ``mlx.launch`` group on loopback.

``mlx.launch -n 2 --backend ring --starting-port P <venv>/bin/mlx_lm.server --model M --port Q``
with the lab's tiny model and the fault injector in every rank (``set_fault(fault, rank=1)``
switches one rank's fault alone: ``mlxwatch/_lab/inject``). ``hosts`` other than 127.0.0.1 run
through ssh, as mlx.launch does (``tests/lab/sshd.py`` gives a loopback sshd). With
``supervised`` a keep-alive supervisor (``tests/lab/keepalive.py``) starts the launcher again
whenever it exits, as launchd's KeepAlive would, and adopts the ranks a killed launcher leaves::

    group = LabGroup.start(python, tmp_path / "group")
    group.set_fault("block", rank=1)
    group.stop()

Everything the group starts is in one process group (its session) that we created. ``stop``
ends the supervisor by its PID (it ends every process below it by PID, orphans included), then
that process group, stopped ranks continued first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lab.ports import free_port
from mlxwatch._lab.server import INJECT_DIR, LabFiles, make_tiny_model
from mlxwatch.host.group import Group, find_group, signal_ranks, wait_ranks_gone
from mlxwatch.host.process import lookup_server

KEEPALIVE = str(Path(__file__).with_name("keepalive.py"))  # a supervisor, as launchd's KeepAlive


def _two_free_ports() -> int:
    """P such that P and P+1 were free a moment ago on 127.0.0.1 and P+1 on 127.0.0.2 (the ring
    listens on one port per rank, counting up by rank: rank 1 on P+1 at its host's address)."""
    for _ in range(50):
        port = free_port()
        try:
            for host in ("127.0.0.1", "127.0.0.2"):
                with socket.socket() as sock:
                    sock.bind((host, port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two consecutive free ports")


@dataclass
class LabGroup(LabFiles):
    workdir: Path
    python: str
    port: int
    ring_port: int
    hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.1")
    supervised: bool = False
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the launcher
    _popen: subprocess.Popen | None = field(default=None, repr=False)
    LOG = "group.log"  # every rank's output, and the launcher's

    @classmethod
    def start(cls, python: str, workdir: Path, *, hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.1"),
              supervised: bool = False, env: dict[str, str] | None = None, ready_timeout: float = 180.0) -> "LabGroup":
        workdir.mkdir(parents=True, exist_ok=True)
        group = cls(workdir, os.path.abspath(python), free_port(), _two_free_ports(), tuple(hosts), supervised,
                    dict(env or {}))
        make_tiny_model(python, group.model_dir)
        group.launch(ready_timeout)
        return group

    def command(self) -> list[str]:
        bindir = Path(self.python).parent
        if len(set(self.hosts)) == 1:
            where = ["-n", str(len(self.hosts))]
            if self.hosts[0] != "127.0.0.1":
                where += ["--hosts", self.hosts[0]]
        else:
            where = ["--hosts", ",".join(self.hosts)]
        return [str(bindir / "mlx.launch"), *where, "--backend", "ring", "--starting-port", str(self.ring_port),
                *[f"--env={k}={v}" for k, v in self.rank_env().items()],
                "--", str(bindir / "mlx_lm.server"), "--model", str(self.model_dir), "--host", "127.0.0.1",
                "--port", str(self.port)]

    def rank_env(self) -> dict[str, str]:
        """What every rank needs, local or remote (mlx.launch passes it to ssh'd ranks by --env)."""
        return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(self.workdir / "hf-cache"), "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(INJECT_DIR), "MLXWATCH_FAULT_FILE": str(self.fault_file),
                "MLXWATCH_RUNTIME_DIR": os.environ.get("MLXWATCH_RUNTIME_DIR", "")}

    def launch(self, ready_timeout: float = 180.0) -> None:
        for rank in range(len(self.hosts)):
            self.set_fault("", rank)
        (self.workdir / "hf-cache").mkdir(exist_ok=True)
        (self.workdir / "tmp").mkdir(exist_ok=True)
        env = {**os.environ, **self.rank_env(), "TMPDIR": str(self.workdir / "tmp"), **self.env}
        argv = [sys.executable, KEEPALIVE, "--", *self.command()] if self.supervised else self.command()
        with open(self.log_path, "ab") as log:
            # stdin a pipe we keep open: at EOF, mlx.launch's select loop spins on it
            self._popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                           env=env, cwd=self.workdir, start_new_session=True)
        try:
            if ready_timeout > 0:
                self.wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float) -> None:
        """Until a completion through rank 0 succeeds (every rank takes part in it)."""
        deadline = time.monotonic() + timeout
        body = {"messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
        with httpx.Client(trust_env=False, timeout=10) as client:
            while time.monotonic() < deadline:
                if self._popen is None or self._popen.poll() is not None:
                    raise RuntimeError(f"lab group exited during start; see {self.log_path}")
                try:
                    if client.post(f"{self.url}/v1/chat/completions", json=body).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"lab group not ready after {timeout:g}s; see {self.log_path}")

    def answers(self, timeout: float = 10.0) -> bool:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        try:
            with httpx.Client(trust_env=False, timeout=timeout) as client:
                return client.post(f"{self.url}/v1/chat/completions", json=body).status_code == 200
        except httpx.HTTPError:
            return False

    def fault_path(self, rank: int) -> Path:
        return Path(f"{self.fault_file}-rank{rank}")

    def set_fault(self, fault: str, rank: int = 1) -> None:
        """Switch one rank's fault on (``die``, ``block``, ``spin``...) or off (``""``)."""
        path = self.fault_path(rank)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(fault)
        os.replace(tmp, path)

    def faulted(self) -> bool:
        return any(self.fault_path(r).exists() and self.fault_path(r).read_text().strip()
                   for r in range(len(self.hosts)))

    def rank0_pid(self) -> int | None:
        found = lookup_server(self.url)
        return found.identity.pid if found.identity else None

    def group(self) -> Group | None:
        pid = self.rank0_pid()
        return find_group(pid) if pid else None

    def healthy(self) -> bool:
        """Launched by us, no fault, every rank running, and it answers."""
        if self._popen is None or self._popen.poll() is not None or self.faulted():
            return False
        group = self.group()
        return group is not None and not group.missing() and self.answers()

    def stop(self, grace: float = 5.0) -> None:
        """End everything the group started: its process group (our session), stopped members
        continued first; SIGKILL after ``grace``. Remote ranks end with their ssh session."""
        proc = self._popen
        if proc is None:
            return
        group = self.group() if proc.poll() is None else None
        if self.supervised and proc.poll() is None:  # it ends, by PID, all it started or adopted
            proc.terminate()
            try:
                proc.wait(grace + 15.0)
            except subprocess.TimeoutExpired:
                pass
        pgid = proc.pid  # start_new_session: the leader's PID names the process group
        for sig in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.1)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        if proc.stdin:
            proc.stdin.close()
        if group is not None:  # remote ranks: ended with their ssh session; proven, then ended
            remote = [r for r in group.ranks if not r.local]
            if remote and wait_ranks_gone(group, 5.0):
                signal_ranks(group, remote, "SIGCONT")
                signal_ranks(group, remote, "SIGKILL")
        self._popen = None

    def relaunch(self, ready_timeout: float = 180.0) -> None:
        self.stop()
        self.launch(ready_timeout)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
