"""The GPU on macOS: its utilisation, for the cadence (``mlxwatch.evidence.gpu``: on a Mac the
GPU reads a prompt while the server process sits near 0 % CPU, so the process's CPU alone
cannot say it works), and its in-use memory, for the restart's wait until a stopped server's
memory is given back (``mlxwatch.restart.release``).

``ioreg -r -d 1 -w 0 -c IOAccelerator`` prints each accelerator's ``PerformanceStatistics``
(``"Device Utilization %"=16``, ``"In use system memory"=2363801600``, ...) without root. Its
text form is parsed defensively (``ioreg`` output is not an API): a value that is missing, out
of range or not a number is unknown, never an error. Several accelerators: the busiest.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from mlxwatch.host.commands import run_command

IOREG = "/usr/sbin/ioreg"  # a launchd agent's PATH has /usr/sbin, a user's shell may not
IOREG_TIMEOUT = 5.0
_STATS = re.compile(r'"PerformanceStatistics"\s*=\s*\{([^}]*)\}')
_NUMBER = r'"{key}"\s*=\s*(\d+)'


@dataclass(frozen=True)
class GpuReading:
    busy: float | None = None  # the busiest accelerator's device utilisation, 0..1
    in_use_bytes: int | None = None  # its "In use system memory"
    error: str | None = None


def ioreg_argv() -> list[str]:
    """Accelerators only (``-c IOAccelerator``), as roots (``-r``), without their children
    (``-d 1``), lines unclipped (``-w 0``)."""
    return [IOREG, "-r", "-d", "1", "-w", "0", "-c", "IOAccelerator"]


def _value(stats: str, key: str) -> int | None:
    m = re.search(_NUMBER.format(key=re.escape(key)), stats)
    return int(m.group(1)) if m else None


def parse_ioreg(text: str) -> GpuReading:
    """The busiest accelerator's utilisation and memory in use, from ``ioreg``'s text."""
    best: GpuReading | None = None
    for m in _STATS.finditer(text):
        stats = m.group(1)
        pct = _value(stats, "Device Utilization %")
        if pct is None:
            pct = _value(stats, "Renderer Utilization %")
        if pct is None or pct > 100:
            continue
        reading = GpuReading(pct / 100, _value(stats, "In use system memory"))
        if best is None or (reading.busy or 0) > (best.busy or 0):
            best = reading
    return best or GpuReading(error="no accelerator's PerformanceStatistics in ioreg's output")


async def read_gpu() -> GpuReading:
    result = await run_command(ioreg_argv(), IOREG_TIMEOUT)
    if result.error:
        return GpuReading(error=f"ioreg: {result.error}")
    return parse_ioreg(result.stdout.decode("utf-8", "replace"))


def read_gpu_now() -> GpuReading:
    """One bounded ``ioreg`` run, blocking (a worker thread's: the restart's wait for memory)."""
    try:
        done = subprocess.run(ioreg_argv(), capture_output=True, text=True, timeout=IOREG_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as exc:
        return GpuReading(error=f"ioreg: {exc}")
    return parse_ioreg(done.stdout)
