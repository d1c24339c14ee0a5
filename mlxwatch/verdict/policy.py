"""When is a server hung? The per-instance detection policy, as a small pure state machine.

    starting --first good probe--> healthy      (failures while a server process exists and
                                                  is younger than startup_timeout: no verdict)
    healthy --probe fails--> suspect --`failures` in a row, no delivery, no progress--> hung
       ^                        |  |\\--prompt progress, no delivery (busy): grace, up to grace_ceiling
       |                        |  \\--delivered since the last probe, late (slow): never a verdict
       |                        v
       +----probe succeeds------+
    hung -> capturing -> restarting -> recovering -> healthy
                              \\--budget spent--> gave_up --cool-down or resume--> suspect

Delivery is the only proof either way: a verdict needs ``failures`` failed probes in a row with
no token delivered at all in between (a late token on a failed probe's own stream, or tokens
to other clients counted by the launch shim). A server that delivers, but slower than the
deadlines, is ``slow``: degraded, reported, never restarted. Only the decisions live here; the
watcher does the I/O. ``now`` is passed in (a monotonic reading: no
wall-clock step shortens or stretches grace; see ``mlxwatch.clock``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

STARTING, HEALTHY, SUSPECT, SLOW, HUNG, CAPTURING, RESTARTING, RECOVERING, GAVE_UP = (
    "starting", "healthy", "suspect", "slow", "hung", "capturing", "restarting", "recovering", "gave_up",
)
STATES = (STARTING, HEALTHY, SUSPECT, SLOW, HUNG, CAPTURING, RESTARTING, RECOVERING, GAVE_UP)
PROBING_SOON = (SUSPECT, SLOW)  # a failed probe is confirmed (or cleared) at suspect_interval


@dataclass
class Detection:
    failures_needed: int
    grace_ceiling: float
    state: str = STARTING
    failures: int = 0
    first_failure_at: float | None = None
    graced: list[str] = field(default_factory=list)  # why the verdict was held back, if it was
    delivered: list[str] = field(default_factory=list)  # the last delivery that made it slow, if one did

    def success(self) -> None:
        self.state, self.failures, self.first_failure_at, self.graced, self.delivered = HEALTHY, 0, None, [], []

    def failure(self, now: float, progress: list[str], delivered: list[str] = ()) -> bool:
        """Record a failed probe; True when it makes a verdict.

        ``delivered``: tokens delivered since the previous probe (late on its own stream, or to
        other clients). They prove the server works: the state is ``slow`` and the window of
        failures starts over at this probe, whose own reply may still arrive late.
        ``progress``: work that advanced with nothing delivered (busy), held up to
        ``grace_ceiling``."""
        if delivered:
            self.state, self.delivered, self.graced = SLOW, list(delivered), []
            self.failures, self.first_failure_at = min(1, self.failures_needed - 1), now
            return False
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
