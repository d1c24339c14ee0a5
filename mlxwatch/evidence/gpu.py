"""The GPU's utilisation as a sign of work, on macOS (``mlxwatch.host.gpu``): read while the
instance is suspect or a probe waits (every ``POLL`` s), rarely otherwise.

It is no delivery and no progress by itself (a livelock that evaluates keeps the GPU busy too):
the cadence (``mlxwatch.evidence.cadence``) reads it as it reads the process's CPU, to allow a
prompt owed reading as long again (at most a chunk) when it runs late on a busy GPU. Elsewhere
(Linux, no ``ioreg``) the source says nothing.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from mlxwatch.evidence import Evidence, Seeing, Window
from mlxwatch.host.gpu import GpuReading, read_gpu

POLL = 2.0  # seconds between readings while suspect or a probe waits
POLL_HEALTHY = 10.0  # ... otherwise


@dataclass
class GpuSource:
    read: Callable[[], Awaitable[GpuReading]] = read_gpu
    name: str = "gpu"
    last: GpuReading | None = None
    read_at: float | None = None
    said: set[str] = field(default_factory=set)

    async def prime(self) -> None:
        return None

    async def look(self, window: Window) -> Evidence:
        every = POLL if window.suspect or window.probe is not None else POLL_HEALTHY
        if self.read_at is None or window.end - self.read_at >= every:
            self.last, self.read_at = await self.read(), window.end
        reading = self.last
        if reading is None or reading.error:
            why = (reading.error if reading else None) or "no reading"
            note = () if why in self.said else (f"GPU utilisation unreadable ({why}): the cadence uses the CPU alone",)
            self.said.add(why)
            return Evidence(notes=note, detail={"gpu": {"unavailable": why}})
        return Evidence(detail={"gpu": {"busy": reading.busy, "in_use_bytes": reading.in_use_bytes}})


def build(seeing: Seeing, platform: str = sys.platform) -> GpuSource | None:
    """The GPU source where ``ioreg`` can show the GPU (macOS), else None."""
    return GpuSource() if platform == "darwin" else None
