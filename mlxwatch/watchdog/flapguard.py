"""No flapping: exponential backoff between restarts and a restart budget per window.

Like systemd's StartLimitBurst or monit's "N restarts within M cycles": at most ``budget``
restarts in ``window`` seconds, each after ``backoff * 2**(n-1)`` seconds (capped) since the
previous one; past the budget the instance is given up until ``cooldown`` passes or a person
resumes it. Pure: callers pass ``now`` (epoch seconds), so tests need no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FlapGuard:
    budget: int
    window: float
    backoff: float
    max_backoff: float
    cooldown: float
    restarts: list[float] = field(default_factory=list)
    gave_up_at: float | None = None

    def _recent(self, now: float) -> list[float]:
        return [t for t in self.restarts if now - t < self.window]

    def exhausted(self, now: float) -> bool:
        return len(self._recent(now)) >= self.budget

    def wait_before_restart(self, now: float) -> float:
        """Seconds to wait before the next restart may run (0 when none is due)."""
        recent = self._recent(now)
        if not recent:
            return 0.0
        delay = min(self.max_backoff, self.backoff * 2 ** (len(recent) - 1))
        return max(0.0, recent[-1] + delay - now)

    def record_restart(self, now: float) -> None:
        self.restarts = self._recent(now) + [now]

    def give_up(self, now: float) -> None:
        self.gave_up_at = now

    def cooled_down(self, now: float) -> bool:
        return self.gave_up_at is not None and now - self.gave_up_at >= self.cooldown

    def resume(self) -> None:
        """A person (``mlxwatch resume``) or the cool-down clears the slate."""
        self.restarts = []
        self.gave_up_at = None

    def forget_future(self, now: float, slack: float = 60.0) -> bool:
        """Times later than ``now`` (the clock stepped back, or a bad state file) would hold the
        budget spent, or the instance given up, for as long as the step: restart times from the
        future are dropped and a future gave-up time becomes ``now``. True if anything changed."""
        restarts = [t for t in self.restarts if t <= now + slack]
        changed = len(restarts) != len(self.restarts)
        self.restarts = restarts
        if self.gave_up_at is not None and self.gave_up_at > now + slack:
            self.gave_up_at, changed = now, True
        return changed

    def restarts_in_window(self, now: float) -> int:
        return len(self._recent(now))
