"""When is a server hung? The per-instance detection policy, as a small pure state machine.

    starting --first good probe--> healthy      (failures while a server process exists and
                                                  is younger than startup_timeout: no verdict)
    healthy --probe fails--> suspect --`failures` in a row, no progress--> hung
       ^                        |  \\--visible progress: grace, up to grace_ceiling
       |                        v
       +----probe succeeds------+
    hung -> capturing -> restarting -> recovering -> healthy
                              \\--budget spent--> gave_up --cool-down or resume--> suspect

Only the decisions live here; the watcher does the I/O. ``now`` is passed in (a monotonic reading: no
wall-clock step shortens or stretches grace; see ``mlxwatch.clock``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

STARTING, HEALTHY, SUSPECT, HUNG, CAPTURING, RESTARTING, RECOVERING, GAVE_UP = (
    "starting", "healthy", "suspect", "hung", "capturing", "restarting", "recovering", "gave_up",
)
STATES = (STARTING, HEALTHY, SUSPECT, HUNG, CAPTURING, RESTARTING, RECOVERING, GAVE_UP)


@dataclass
class Detection:
    failures_needed: int
    grace_ceiling: float
    state: str = STARTING
    failures: int = 0
    first_failure_at: float | None = None
    graced: list[str] = field(default_factory=list)  # why the verdict was held back, if it was

    def success(self) -> None:
        self.state, self.failures, self.first_failure_at, self.graced = HEALTHY, 0, None, []

    def failure(self, now: float, progress: list[str]) -> bool:
        """Record a failed probe; True when it makes a verdict."""
        self.failures += 1
        if self.first_failure_at is None:
            self.first_failure_at = now
        in_grace = now - self.first_failure_at < self.grace_ceiling
        if progress and in_grace:
            self.graced = progress
            self.failures = min(self.failures, self.failures_needed - 1)  # progress holds the verdict
            self.state = SUSPECT
            return False
        if self.failures >= self.failures_needed:
            self.state = HUNG
            return True
        self.state = SUSPECT
        return False
