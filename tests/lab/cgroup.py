"""A memory cgroup (v1) for a test: made with a limit, a command started inside it, removed after.

    with LabCgroup.make(limit_mib=180) as cg:      # pytest.skip with the reason where it cannot
        argv = cg.inside(["python", "-m", "x"])     # sh joins the cgroup, then execs the command
        ...
    # every process we started in it is ended by PID; the cgroup is removed

Only the v1 memory controller (``/sys/fs/cgroup/memory``, as on the suite's machines); the
directory is named after the test run so nothing else's cgroup is ever touched.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
import uuid
from pathlib import Path

import pytest

V1 = Path("/sys/fs/cgroup/memory")
MiB = 1024 * 1024


def unusable() -> str | None:
    """Why a v1 memory cgroup cannot be made here (None: it can)."""
    if not (V1 / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {V1}"
    if not os.access(V1, os.W_OK):
        return f"{V1} is not writable (root needed)"
    return None


class LabCgroup:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.started: list[int] = []  # PIDs we put in it (ended by PID at the end)

    @classmethod
    def make(cls, limit_mib: int) -> "LabCgroup":
        reason = unusable()
        if reason:
            pytest.skip(reason)
        path = V1 / f"mlxwatch-test-{uuid.uuid4().hex[:8]}"
        path.mkdir()
        (path / "memory.limit_in_bytes").write_text(str(limit_mib * MiB))
        return cls(path)

    @property
    def name(self) -> str:
        """As the kernel names it (``task_memcg=/NAME``)."""
        return "/" + self.path.name

    def inside(self, argv: list[str] | tuple[str, ...]) -> tuple[str, ...]:
        """``argv`` run inside the cgroup: the shell writes its PID to ``cgroup.procs``, then execs."""
        return ("sh", "-c", f"echo $$ > {shlex.quote(str(self.path / 'cgroup.procs'))} && exec {shlex.join(argv)}")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def counter(self, name: str) -> int:
        if name == "oom_kill":
            for line in (self.path / "memory.oom_control").read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            return 0
        return int((self.path / name).read_text())

    def remove(self, timeout: float = 20.0) -> None:
        """End what runs in it (only processes this test started: it made the cgroup), then remove it."""
        deadline = time.monotonic() + timeout
        while self.path.exists():
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                self.path.rmdir()
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def __enter__(self) -> "LabCgroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
