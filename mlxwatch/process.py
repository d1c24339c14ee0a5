"""Finding a server's process and making sure it is still the same one.

A PID alone is not an identity: after a restart the number can belong to anything. Every
signal mlxwatch sends is preceded by ``ProcessIdentity.still_ours()``: same PID, same create
time, and still listening on the instance's port.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from mlxwatch.errors import ProcessGoneError


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    create_time: float
    cmdline: tuple[str, ...]

    @classmethod
    def of(cls, pid: int) -> "ProcessIdentity":
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE:
                    raise ProcessGoneError(f"process {pid} has exited (zombie)")
                return cls(pid, proc.create_time(), tuple(_cmdline(proc)))
        except psutil.NoSuchProcess:
            raise ProcessGoneError(f"no process with PID {pid}") from None

    def alive(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return abs(proc.create_time() - self.create_time) < 0.01 and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def still_ours(self, port: int | None) -> bool:
        """Same process as recorded and (when a port is given) still listening on it."""
        if not self.alive():
            return False
        return port is None or self.pid in listening_pids(port)

    def to_dict(self) -> dict:
        return {"pid": self.pid, "create_time": self.create_time, "cmdline": list(self.cmdline)}


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def listening_pids(port: int) -> set[int]:
    """PIDs with a TCP socket listening on ``port``.

    ``net_connections`` needs root on macOS; then each process we may inspect is asked itself.
    """
    try:
        return {c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    except (psutil.AccessDenied, PermissionError):
        pass
    found = set()
    for proc in psutil.process_iter():
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in proc.net_connections("tcp")):
                found.add(proc.pid)
        except psutil.Error:
            continue
    return found


def find_server_pid(port: int, pid_file: Path | None = None) -> int:
    """The server's PID: from ``pid_file`` when given, else the one process listening on ``port``."""
    if pid_file is not None:
        try:
            return int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError) as exc:
            raise ProcessGoneError(f"cannot read a PID from {pid_file}: {exc}") from None
    pids = listening_pids(port)
    if not pids:
        raise ProcessGoneError(f"no process is listening on port {port}")
    if len(pids) > 1:
        raise ProcessGoneError(f"several processes listen on port {port}: {sorted(pids)}; set pid_file")
    return pids.pop()
