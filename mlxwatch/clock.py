"""Two clocks, each for its own job: durations on the monotonic clock, records on the wall clock.

    clock = Clock()                  # tests: Clock(monotonic=..., wall=..., boot=...)
    at = clock.now()                 # a Stamp: both readings, taken together
    ...
    if clock.monotonic() - at.mono >= cooldown: ...   # a duration: no clock step bends it
    journal.record(..., at=at.wall)                   # a record: the wall time, read once

The wall clock steps (an NTP resync on a laptop, a VM without a timezone, a person); measured
on it, a step back of 1 h after a restart made the next backoff 3612 s, and a step forward
during grace cut a 44 s grace to 17 s. The monotonic clock never steps, but it starts again at
each boot and does not count time asleep (``time.monotonic`` on macOS and Linux): every
duration the daemon measures is time awake.

Times kept across daemon runs (restart times, the gave-up time) are saved with both readings
and the boot they were read on (``boot_id``). ``Clock.restore`` turns a saved time into a
monotonic reading: on the same boot the saved monotonic reading is exact, whatever the wall
clock did meanwhile; after a reboot (or without one saved) the wall reading is used with its
age clamped at zero, so a time from the future counts as "just now": it can hold a backoff,
a window or a cooldown for at most that duration, never for the length of the step.
"""

from __future__ import annotations

import ctypes
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

LINUX_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """Which boot of this machine we run in: equal readings mean one monotonic clock.

    Linux's random ``boot_id``; macOS's ``kern.bootsessionuuid``; elsewhere the boot time
    (whole seconds), which a wall-clock step may shift: then ``restore`` falls back to the wall
    readings, clamped, as after a reboot (safe, only less exact)."""
    try:
        return "linux:" + LINUX_BOOT_ID.read_text().strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        session = _darwin_boot_session()
        if session:
            return "darwin:" + session
    try:
        return f"boot-time:{int(psutil.boot_time())}"
    except (OSError, RuntimeError, psutil.Error):
        return "unknown"  # never equal to a saved boot: the wall readings are used, clamped


def _darwin_boot_session() -> str | None:
    try:
        libc = ctypes.CDLL(None)
        buf, size = ctypes.create_string_buffer(64), ctypes.c_size_t(64)
        if libc.sysctlbyname(b"kern.bootsessionuuid", buf, ctypes.byref(size), None, ctypes.c_size_t(0)) == 0:
            return buf.value.decode("ascii", "replace") or None
    except (OSError, AttributeError, ValueError):
        pass
    return None


@dataclass(frozen=True)
class Stamp:
    """One moment as both clocks read it: ``mono`` for durations, ``wall`` (epoch) for records."""

    mono: float
    wall: float


@dataclass
class Clock:
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    boot: str = field(default_factory=boot_id)

    def now(self) -> Stamp:
        return Stamp(self.monotonic(), self.wall())

    def wall_of(self, mono: float) -> float:
        """The wall time of an earlier monotonic reading, for a record written now."""
        return self.wall() - max(0.0, self.monotonic() - mono)

    def mono_of(self, wall: float) -> float:
        """The monotonic reading of a wall time known only as such (a journal record of another
        daemon run): its age clamped at zero, so a time from the future is "just now"."""
        return self.monotonic() - max(0.0, self.wall() - wall)

    def restore(self, wall: float, mono: float | None, boot: str | None) -> float:
        """A saved time as a monotonic reading of this clock (the rule in the module docstring):
        the saved ``mono`` when it was read on this boot (never later than now), else the wall
        time's age, clamped at zero."""
        if mono is not None and boot is not None and boot == self.boot:
            return min(mono, self.monotonic())
        return self.mono_of(wall)
