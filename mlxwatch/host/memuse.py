"""How much memory a server holds, and how much more it can take before it is killed.

- **Linux**: its resident size (psutil); the limit it meets is its memory cgroup's
  (``host.cgroup``: the smallest on the way to the root), else the machine's memory. The room
  left is the limit less what the cgroup holds that cannot be reclaimed (its usage less its
  inactive file cache), or the machine's available memory.
- **macOS**: its *physical footprint*, what jetsam and Activity Monitor's "Memory" count (RSS
  under-reports a Metal server: GPU buffers are not resident pages). ``proc_pid_rusage(pid,
  RUSAGE_INFO_V0, &info)`` (libproc.h) gives ``ri_phys_footprint`` for one's own processes
  without root: ``struct rusage_info_v0`` in xnu's ``bsd/sys/resource.h`` is a 16-byte uuid and
  then ten ``uint64_t``, the footprint the eighth (osquery reads it the same way). The limit is
  the GPU's wired limit, ``sysctl iogpu.wired_limit_mb`` (0: the system's default, then the
  machine's memory ``hw.memsize`` is the bound shown), and ``kern.memorystatus_vm_pressure_level``
  (1 normal, 2 warn, 4 critical) says how hard the system presses. Not run on a Mac here (see
  docs/verified.md).

::

    reading = read_memory(pid)        # MemoryReading(used=..., limit=..., room=..., bound="cgroup /lab") or None
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from dataclasses import dataclass

import psutil

from mlxwatch.host import cgroup

SYSCTL = "/usr/sbin/sysctl"
SYSCTL_NAMES = ("iogpu.wired_limit_mb", "kern.memorystatus_vm_pressure_level", "hw.memsize")
SYSCTL_TIMEOUT = 5.0
PRESSURE = {1: "normal", 2: "warn", 4: "critical"}  # kern.memorystatus_vm_pressure_level
RUSAGE_INFO_V0 = 0
FOOTPRINT_INDEX = 7  # ri_phys_footprint: the eighth uint64_t after the 16-byte uuid
MiB = 1024 * 1024


@dataclass(frozen=True)
class MemoryReading:
    used: int  # bytes: resident size (Linux) or physical footprint (macOS)
    measure: str  # "rss" | "phys_footprint"
    limit: int | None  # the bound it runs under, bytes
    room: int | None  # bytes it can still take before that bound kills it
    bound: str  # what the limit is: "cgroup /lab", "machine memory", "iogpu.wired_limit_mb"
    pressure: str | None = None  # macOS: normal | warn | critical

    def to_dict(self) -> dict:
        return {"used": self.used, "measure": self.measure, "limit": self.limit, "room": self.room,
                "bound": self.bound, "pressure": self.pressure}


def read_memory(pid: int) -> MemoryReading | None:
    """The server's memory now (blocking); None when it is gone or cannot be read."""
    if sys.platform.startswith("darwin"):
        return _read_macos(pid)
    try:
        rss = psutil.Process(pid).memory_info().rss
    except (psutil.Error, OSError):
        return None
    cg = cgroup.memory_cgroup(pid)
    counters = cg.read() if cg is not None else {}
    if cg is not None and "limit" in counters:
        held = counters.get("usage", rss) - counters.get("inactive_file", 0)
        return MemoryReading(rss, "rss", counters["limit"], max(0, counters["limit"] - held), f"cgroup {cg.path}")
    vm = psutil.virtual_memory()
    return MemoryReading(rss, "rss", vm.total, vm.available, "machine memory")


# --- macOS


def sysctl_command(names: tuple[str, ...] = SYSCTL_NAMES) -> list[str]:
    """``sysctl name ...`` (sysctl(8): ``sysctl [-bdehiNnoqx] name[=value] ...``): each answer
    as ``name: value``, so a name this Mac lacks (an Intel Mac has no ``iogpu``) costs only its line."""
    return [SYSCTL, *names]


def parse_sysctl(text: str) -> dict[str, int]:
    """``name: value`` lines (``name = value`` on older systems) to numbers; others skipped."""
    out = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if not sep:
            name, sep, value = line.partition("=")
        try:
            out[name.strip()] = int(value.strip())
        except ValueError:
            continue
    return out


def macos_limits(values: dict[str, int]) -> tuple[int | None, str, str | None]:
    """(limit bytes, what it is, pressure) from the sysctl values."""
    wired = values.get("iogpu.wired_limit_mb")
    memsize = values.get("hw.memsize")
    pressure = PRESSURE.get(values.get("kern.memorystatus_vm_pressure_level", 0))
    if wired:
        return wired * MiB, "iogpu.wired_limit_mb", pressure
    return memsize, "machine memory (hw.memsize; iogpu.wired_limit_mb is the default)", pressure


def phys_footprint(pid: int) -> int | None:
    """``ri_phys_footprint`` from ``proc_pid_rusage`` (macOS; own processes without root)."""
    try:
        libproc = ctypes.CDLL("/usr/lib/libproc.dylib")
    except OSError:
        return None
    buf = (ctypes.c_uint64 * 64)()  # larger than any rusage_info version: the kernel writes v0's size
    if libproc.proc_pid_rusage(ctypes.c_int(pid), ctypes.c_int(RUSAGE_INFO_V0), ctypes.byref(buf)) != 0:
        return None
    return int(buf[2 + FOOTPRINT_INDEX])  # the uuid is two uint64_t's worth


def _read_macos(pid: int) -> MemoryReading | None:
    used = phys_footprint(pid)
    if used is None:
        return None
    try:
        done = subprocess.run(sysctl_command(), capture_output=True, text=True, timeout=SYSCTL_TIMEOUT)
        values = parse_sysctl(done.stdout)
    except (OSError, subprocess.SubprocessError):
        values = {}
    limit, bound, pressure = macos_limits(values)
    room = max(0, limit - used) if limit is not None else None
    return MemoryReading(used, "phys_footprint", limit, room, bound, pressure)
