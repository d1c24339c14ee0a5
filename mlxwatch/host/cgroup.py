"""A process's memory cgroup on Linux: the limit it runs under and the kernel's counters.

``/proc/PID/cgroup`` names the cgroup: ``N:memory:/path`` for the v1 memory controller (its
files under ``/sys/fs/cgroup/memory/path``), ``0::/path`` for v2 (``/sys/fs/cgroup/path``). The
limit a process meets is the smallest on its path to the root (v1's ``memory.stat`` says it as
``hierarchical_memory_limit``; v2's ancestors are read). The counters:

- v1: ``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``memory.max_usage_in_bytes``,
  ``memory.failcnt``, ``memory.oom_control``'s ``oom_kill`` and ``memory.stat``'s
  ``total_inactive_file`` (Documentation/admin-guide/cgroup-v1/memory.rst);
- v2: ``memory.max``, ``memory.current``, ``memory.peak``, ``memory.events``'s ``oom``,
  ``oom_kill`` and ``max`` (as ``max_events``), and ``memory.stat``'s ``inactive_file``
  (Documentation/admin-guide/cgroup-v2.rst).

The inactive file cache is what the kernel reclaims before it kills: the room left under the
limit is the limit less the usage without it.

A value the kernel does not have (no ``memory.peak`` before 5.19) is left out. ::

    cg = memory_cgroup(pid)          # MemoryCgroup(version=1, path="/lab", dir=...) or None
    cg.read()                        # {"limit": 104857600, "usage": ..., "oom_kill": 1, ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 62  # v1 writes "no limit" as a huge page-rounded number (9223372036854771712)


@dataclass(frozen=True)
class MemoryCgroup:
    version: int  # 1 or 2
    path: str  # as /proc/PID/cgroup and the OOM killer's task_memcg say it: "/lab/server"
    root: Path = ROOT

    @property
    def dir(self) -> Path:
        base = self.root / "memory" if self.version == 1 else self.root
        return base / self.path.lstrip("/")

    def read(self) -> dict[str, int]:
        """The counters now (bytes, counts); {} when the cgroup is gone. ``limit`` is the
        smallest on the way to the root; absent: no limit."""
        d = self.dir
        out: dict[str, int] = {}
        if self.version == 1:
            names = {"usage": "memory.usage_in_bytes", "peak": "memory.max_usage_in_bytes", "failcnt": "memory.failcnt"}
            for key, name in names.items():
                if (v := _int(d / name)) is not None:
                    out[key] = v
            out.update({k: v for k, v in _pairs(d / "memory.oom_control").items() if k == "oom_kill"})
            stat = _pairs(d / "memory.stat")
            if "total_inactive_file" in stat:
                out["inactive_file"] = stat["total_inactive_file"]
            limit = stat.get("hierarchical_memory_limit", _int(d / "memory.limit_in_bytes"))
        else:
            for key, name in {"usage": "memory.current", "peak": "memory.peak"}.items():
                if (v := _int(d / name)) is not None:
                    out[key] = v
            if "inactive_file" in (stat := _pairs(d / "memory.stat")):
                out["inactive_file"] = stat["inactive_file"]
            events = _pairs(d / "memory.events")
            out.update({name: events[k] for k, name in (("oom", "oom"), ("oom_kill", "oom_kill"), ("max", "max_events"))
                        if k in events})
            limits = [v for p in (d, *d.parents) if p.is_relative_to(self.root)
                      and (v := _int(p / "memory.max")) is not None]
            limit = min(limits) if limits else None
        if limit is not None and limit < UNLIMITED:
            out["limit"] = limit
        return out


def memory_cgroup(pid: int, root: Path = ROOT, proc: Path = Path("/proc")) -> MemoryCgroup | None:
    """The memory cgroup ``pid`` runs in, or None (no such process, no memory controller)."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return None
    return of_lines(text, root)


def of_lines(text: str, root: Path = ROOT) -> MemoryCgroup | None:
    """From ``/proc/PID/cgroup``'s text: v1's memory line first (a hybrid system mounts v2 at
    ``unified`` without the memory controller), else v2's unified line where v2 is mounted at
    the root (its ``cgroup.controllers`` lists memory)."""
    unified = None
    for line in text.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            return MemoryCgroup(1, path or "/", root)
        if hier == "0" and controllers == "":
            unified = path or "/"
    if unified is not None and "memory" in _text(root / "cgroup.controllers").split():
        return MemoryCgroup(2, unified, root)
    return None


def of_oom_kill(memcg: str, root: Path = ROOT) -> MemoryCgroup | None:
    """The cgroup an OOM kill names (``task_memcg=/path``), on this machine's hierarchy."""
    for version in (1, 2):
        cg = MemoryCgroup(version, memcg, root)
        if (version == 1 and (root / "memory").is_dir() and cg.dir.is_dir()) or \
                (version == 2 and (root / "cgroup.controllers").exists() and cg.dir.is_dir()):
            return cg
    return None


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _int(path: Path) -> int | None:
    text = _text(path).strip()
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _pairs(path: Path) -> dict[str, int]:
    out = {}
    for line in _text(path).splitlines():
        key, _, value = line.partition(" ")
        try:
            out[key] = int(value)
        except ValueError:
            continue
    return out
