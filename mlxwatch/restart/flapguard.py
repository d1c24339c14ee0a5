"""No flapping: exponential backoff between restarts and a restart budget per window.

Like systemd's StartLimitBurst or monit's "N restarts within M cycles": at most ``budget``
restarts in ``window`` seconds, each after ``backoff * 2**(n-1)`` seconds (capped) since the
previous one; past the budget the instance is given up until ``cooldown`` passes or a person
resumes it. Pure: callers pass ``now``, a monotonic reading (``mlxwatch.clock``), so a wall
clock step bends no backoff, window or cooldown, and tests need no sleep.

Each restart and the gave-up time are kept as a ``Stamp`` (monotonic and wall readings): the
wall times go to records (the state file, status, metrics); ``saved`` adds the monotonic ones
and the boot identity, and ``restore`` reads them back by ``Clock.restore``'s rule, so the
budget and the cooldown survive a daemon restart and a clock step alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, TypeGuard

from mlxwatch.clock import Clock, Stamp


@dataclass
class FlapGuard:
    budget: int
    window: float
    backoff: float
    max_backoff: float
    cooldown: float
    restarts: list[Stamp] = field(default_factory=list)
    gave_up_at: Stamp | None = None

    def _recent(self, now: float) -> list[Stamp]:
        return [t for t in self.restarts if now - t.mono < self.window]

    def exhausted(self, now: float) -> bool:
        return len(self._recent(now)) >= self.budget

    def wait_before_restart(self, now: float) -> float:
        """Seconds to wait before the next restart may run (0 when none is due)."""
        recent = self._recent(now)
        if not recent:
            return 0.0
        delay = min(self.max_backoff, self.backoff * 2.0 ** (len(recent) - 1))
        return max(0.0, recent[-1].mono + delay - now)

    def record_restart(self, at: Stamp) -> None:
        self.restarts = self._recent(at.mono) + [at]

    def give_up(self, at: Stamp) -> None:
        self.gave_up_at = at

    def cooled_down(self, now: float) -> bool:
        return self.gave_up_at is not None and now - self.gave_up_at.mono >= self.cooldown

    def resume(self) -> None:
        """A person (``mlxwatch resume``) or the cool-down clears the slate."""
        self.restarts = []
        self.gave_up_at = None

    def restarts_in_window(self, now: float) -> int:
        return len(self._recent(now))

    def saved(self, clock: Clock) -> dict[str, Any]:
        """The state file's fields: ``restarts`` and ``gave_up_at`` as wall times (records, read
        by status and the metrics), ``monotonic`` the same moments on this boot's clock."""
        return {
            "restarts": [t.wall for t in self.restarts],
            "gave_up_at": self.gave_up_at.wall if self.gave_up_at else None,
            "monotonic": {"boot": clock.boot, "restarts": [t.mono for t in self.restarts],
                          "gave_up_at": self.gave_up_at.mono if self.gave_up_at else None},
        }

    def restore(self, saved: Mapping[str, Any], clock: Clock) -> list[str]:
        """Take back what ``saved`` wrote (or a record rebuilt from the journal: wall times only).

        On the boot that saved them the monotonic readings are exact; otherwise each wall time
        counts from now minus its age, the age clamped at zero (``Clock.restore``): a clock
        stepped back, or a bad file, can hold a restart in the window for at most ``window`` and
        the instance given up for at most ``cooldown``. Returns what is worth a warning."""
        walls = _numbers(saved.get("restarts"))
        saved_mono = saved.get("monotonic")
        mono: Mapping[str, Any] = saved_mono if isinstance(saved_mono, Mapping) else {}
        boot = mono.get("boot") if isinstance(mono.get("boot"), str) else None
        monos = _numbers(mono.get("restarts"))
        if len(monos) != len(walls):
            monos, boot = [], None  # not one list for the other: trust neither pairing
        notes = []
        now_wall = clock.wall()
        if boot != clock.boot and any(w > now_wall for w in walls + [saved.get("gave_up_at") or 0.0] if _number(w)):
            notes.append("times later than now in the state file (the clock stepped back?) count as now")
        self.restarts = sorted((Stamp(clock.restore(w, monos[i] if monos else None, boot), w)
                                for i, w in enumerate(walls)), key=lambda t: t.mono)
        gave_up = saved.get("gave_up_at")
        if _number(gave_up):
            gave_up_mono = mono.get("gave_up_at") if _number(mono.get("gave_up_at")) else None
            self.gave_up_at = Stamp(clock.restore(float(gave_up), gave_up_mono, boot), float(gave_up))
        else:
            self.gave_up_at = None
        return notes


def restarts_in_window(saved: Mapping[str, Any], window: float, clock: Clock) -> int:
    """How many of a saved record's restarts (``FlapGuard.saved``, as in the state file) are in
    the window now, counted as the guard counts them (``restore``, then the window on the
    monotonic clock): ``status`` and the metrics read the state file with this, so after a
    wall-clock step they show the count the guard acts on, not one by wall-clock ages."""
    guard = FlapGuard(budget=0, window=window, backoff=0.0, max_backoff=0.0, cooldown=0.0)  # only the window counts here
    guard.restore(saved, clock)
    return guard.restarts_in_window(clock.monotonic())


def _numbers(value: Any) -> list[float]:
    """The numbers of a saved list (a hand-edited file may hold anything there)."""
    return [float(t) for t in value if _number(t)] if isinstance(value, (list, tuple)) else []


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
