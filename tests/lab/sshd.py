"""A loopback sshd of the test's own, for a "remote" rank: Debian's ``/usr/sbin/sshd``
(``scripts/debian-tools.sh``: ``install_sshd``) run in the foreground with a config, host key and
client key made in a temp dir, listening on ``127.0.0.2`` (a second loopback address, so that
``mlx.launch --hosts 127.0.0.1,127.0.0.2`` runs rank 1 through ssh, as it runs every host but
``127.0.0.1``)::

    with LabSshd.start(workdir) as sshd:
        sshd.bin_dir      # holds ``ssh``: /usr/bin/ssh -F <this config>; put it first on PATH
        sshd.run("true")  # ssh 127.0.0.2 true

Neither ``mlx.launch`` nor mlxwatch is told anything: both run ``ssh HOST`` from PATH, and the
wrapper gives it the port, key and known host of this sshd (no ``~/.ssh`` is read or written).
Sessions get ``TMPDIR`` inside the temp dir (``SetEnv``), so the files ``mlx.launch`` makes with
``mktemp`` on the remote side go there too. ``stop`` ends the listener by its PID and the
session processes it started.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # Debian's sshd refuses to start without it (the package's service makes it)

SSHD_CONFIG = """\
ListenAddress {host}:{port}
HostKey {dir}/host_ed25519
PidFile {dir}/sshd.pid
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
SetEnv TMPDIR={dir}/remote-tmp
LogLevel VERBOSE
"""

SSH_CONFIG = """\
Host {host}
  Port {port}
  User {user}
  IdentityFile {dir}/client_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile {dir}/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
"""


def sshd_missing() -> str | None:
    """Why a loopback sshd cannot run here, or None."""
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} not installed (Debian's openssh-server: scripts/debian-tools.sh)"
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} not on PATH (Debian's openssh-client)"
    if not PRIVSEP_DIR.is_dir() and os.geteuid() != 0:
        return f"{PRIVSEP_DIR} missing and not root to make it"
    return None


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mlxwatch-test", "-f", str(path)],
                   check=True, capture_output=True, timeout=30)
    return path.with_suffix(".pub").read_text().strip()


@dataclass
class LabSshd:
    dir: Path
    host: str
    port: int
    proc: subprocess.Popen

    @property
    def bin_dir(self) -> Path:
        return self.dir / "bin"

    @property
    def log_path(self) -> Path:
        return self.dir / "sshd.log"

    @property
    def remote_tmp(self) -> Path:
        return self.dir / "remote-tmp"

    @classmethod
    def start(cls, workdir: Path, host: str = "127.0.0.2", ready_timeout: float = 60.0) -> "LabSshd":
        workdir.mkdir(parents=True, exist_ok=True)
        workdir.chmod(0o700)
        (workdir / "bin").mkdir(exist_ok=True)
        (workdir / "remote-tmp").mkdir(exist_ok=True)
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        host_pub = _keygen(workdir / "host_ed25519")
        (workdir / "authorized_keys").write_text(_keygen(workdir / "client_ed25519") + "\n")
        port = _free_port(host)
        fields = {"host": host, "port": port, "dir": workdir, "user": getpass.getuser()}
        (workdir / "sshd_config").write_text(SSHD_CONFIG.format(**fields))
        (workdir / "ssh_config").write_text(SSH_CONFIG.format(**fields))
        (workdir / "known_hosts").write_text(f"[{host}]:{port} {host_pub}\n")
        ssh = shutil.which("ssh")
        wrapper = workdir / "bin" / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {ssh} -F {workdir}/ssh_config "$@"\n')
        wrapper.chmod(0o755)
        with open(workdir / "sshd.log", "ab") as log:
            proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(workdir / "sshd_config")], stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        sshd = cls(workdir, host, port, proc)
        try:
            sshd._wait_ready(ready_timeout)
        except BaseException:
            sshd.stop()
            raise
        return sshd

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"sshd not listening on {self.host}:{self.port} after {timeout:g}s")
        done = self.run("true", timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"ssh {self.host} true: exit {done.returncode}: {done.stderr.strip()[-500:]}; "
                               f"sshd log: {self.log_path.read_text()[-1500:]}")

    def run(self, command: str, timeout: float = 30.0) -> "subprocess.CompletedProcess[str]":
        """``ssh HOST command`` through the wrapper."""
        return subprocess.run([str(self.bin_dir / "ssh"), self.host, command], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def stop(self, grace: float = 5.0) -> None:
        """End the listener (by its PID) and the session processes it started, then remove what
        the sessions left in ``remote_tmp``."""
        try:
            sessions = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            sessions = []
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for child in sessions:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(sessions, timeout=grace)
        shutil.rmtree(self.remote_tmp, ignore_errors=True)

    def __enter__(self) -> "LabSshd":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
