"""What the server sent its clients during a capture's window, from the kernel's counters read
as the daemon reads them (``mlxwatch.evidence.kernel``): the capture's classification uses the
same evidence as the verdict.

Why: stacks and CPU alone can mislead. A server that sleeps between slow batch steps shows the
same frame in every snapshot at 0 % CPU, which reads as ``blocked``; if tokens reached any
client meanwhile, it works (slowly for the probe), and the bundle must say so. Only token-sized
writes count (``KEEPALIVE_BYTES``): keepalive comments are progress, not delivery. The
capture's own probe connection is the daemon's own and is left out, like every connection of
this process.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from mlxwatch.evidence import Window
from mlxwatch.evidence.kernel import KernelSource
from mlxwatch.host.sockets import KernelCounters

READ_EVERY = 0.5  # seconds between readings: a connection opened and closed faster is not seen


@dataclass(frozen=True)
class WindowDelivery:
    """The kernel's account of the window: token writes to clients (``delivered``), keepalive
    writes with no token (``progress``), or why it could not be read (``unavailable``)."""

    delivered: tuple[str, ...] = ()
    progress: tuple[str, ...] = ()
    connections: int = 0  # client connections seen on the server's port (the capture's own left out)
    unavailable: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


async def watch_delivery(port: int, pid: int | None, seconds: float) -> WindowDelivery:
    """Read the counters of ``port``'s client connections every ``READ_EVERY`` s for
    ``seconds``; what flowed between the first reading and the last."""
    counters = KernelCounters()
    source = KernelSource(counters, port, quiet_window=lambda: seconds, server_pid=lambda: pid)
    try:
        start = time.monotonic()
        end = start + seconds
        while True:
            reading = await asyncio.to_thread(source.sample)
            if reading.error:
                return WindowDelivery(unavailable=reading.error)
            left = end - time.monotonic()
            if left <= 0:
                break
            await asyncio.sleep(min(READ_EVERY, left))
        seen = source.answer(Window(start, time.monotonic()))
        return WindowDelivery(seen.delivered, seen.progress, seen.detail.get("kernel", {}).get("connections", 0))
    finally:
        await asyncio.to_thread(counters.close)
