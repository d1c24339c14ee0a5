"""One server's memory over time: "out of memory in about N minutes", before it happens.

Each probe cycle the watcher hands in a reading (``host.memuse``: what the server holds and the
room left under the bound that would kill it). The trend is a least-squares line through the
readings of the last ``memory.window``; the minutes left are the room left over the line's
slope, when it grows. A line needs ``MIN_READINGS`` readings over ``MIN_SPAN`` seconds: two
readings are noise. A warning is said once an episode (until the trend leaves the warning);
the opt-in early restart is asked for once the minutes left fall within ``restart_within``::

    watch = MemoryWatch(config.memory)
    look = watch.add(now, reading)          # MemoryLook(minutes_left=12.5, warn=True, ...)
    watch.forget()                          # a new server process: its trend starts over
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mlxwatch.config import MemoryConfig
from mlxwatch.host.memuse import MemoryReading

MIN_READINGS = 6
MIN_SPAN = 5.0  # seconds
MiB = 1024 * 1024


@dataclass(frozen=True)
class MemoryLook:
    """What one reading tells: the reading, the trend, and what to do about it."""

    reading: MemoryReading
    rate: float | None = None  # bytes/s the server grows by (None: no trend yet)
    minutes_left: float | None = None  # out of memory in about this long (None: not growing, or no trend)
    warn: bool = False  # the first look of a warning episode: say it
    restart: bool = False  # within restart_within, and restart_early is on

    def to_dict(self) -> dict:
        return {**self.reading.to_dict(), "rate": None if self.rate is None else round(self.rate, 1),
                "minutes_left": None if self.minutes_left is None else round(self.minutes_left, 2)}

    def text(self) -> str:
        return describe(self.to_dict())


def describe(memory: dict) -> str:
    """One line from a look's dict (as the state file holds it)::

        memory: 150 MiB of 180 MiB (cgroup /lab), +2.0 MiB/s: out of memory in about 1 minute
    """
    out = f"memory: {memory['used'] / MiB:.0f} MiB"
    if memory.get("limit"):
        out += f" of {memory['limit'] / MiB:.0f} MiB"
    if memory.get("bound"):
        out += f" ({memory['bound']})"
    if memory.get("pressure") not in (None, "normal"):
        out += f", system memory pressure {memory['pressure']}"
    rate = memory.get("rate")
    if isinstance(rate, (int, float)) and rate > 0:
        out += f", +{rate / MiB:.1f} MiB/s"
    left = memory.get("minutes_left")
    if isinstance(left, (int, float)):
        out += ": out of memory in " + (f"about {left:.0f} minutes" if left >= 1.5 else
                                         "about 1 minute" if left >= 0.5 else "less than a minute")
    return out


def slope(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of ``(t, y)`` points; None for fewer than two distinct times."""
    n = len(points)
    if n < 2:
        return None
    mt = sum(t for t, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var <= 0:
        return None
    return sum((t - mt) * (y - my) for t, y in points) / var


@dataclass
class MemoryWatch:
    config: MemoryConfig
    readings: deque[tuple[float, MemoryReading]] = field(default_factory=deque)
    warned: bool = False  # within a warning episode
    restart_asked: bool = False

    def forget(self) -> None:
        self.readings.clear()
        self.warned = self.restart_asked = False

    def add(self, now: float, reading: MemoryReading) -> MemoryLook:
        """Take a reading (``now``: monotonic seconds) and judge the trend."""
        self.readings.append((now, reading))
        while self.readings and now - self.readings[0][0] > self.config.window:
            self.readings.popleft()
        points = [(t, float(r.used)) for t, r in self.readings]
        rate = None
        if len(points) >= MIN_READINGS and points[-1][0] - points[0][0] >= MIN_SPAN:
            rate = slope(points)
        minutes = None
        if rate is not None and rate > 0 and reading.room is not None:
            minutes = reading.room / rate / 60.0
        within = minutes is not None and minutes * 60.0 <= self.config.warn_within
        warn = within and not self.warned
        self.warned = within
        restart = (self.config.restart_early and minutes is not None and minutes * 60.0 <= self.config.restart_within
                   and not self.restart_asked)
        return MemoryLook(reading, rate, minutes, warn, restart)

    def asked_restart(self) -> None:
        """The early restart is under way: asked once per server process."""
        self.restart_asked = True
