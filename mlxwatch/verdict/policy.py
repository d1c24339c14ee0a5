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
no token delivered at all in between, by any evidence source (``mlxwatch.evidence``: a late
token on a failed probe's own stream, bytes of tokens the kernel saw sent to any client, tokens
the launch shim or the front door counted). A server that delivers, but slower than the
deadlines, is ``slow``: degraded, reported, never restarted. Progress without delivery (a prompt
being read, keepalives) holds the verdict up to ``grace_ceiling``; a stall a source saw makes the
next failure decisive. Only the decisions live here; the watcher asks the sources. ``now`` is passed in (a monotonic reading: no
wall-clock step shortens or stretches grace; see ``mlxwatch.clock``).

``Detection`` owns every state change: the watcher asks (``failure``, ``success``,
``capturing``, ``restarting``, ``recovered`` ...) and never writes ``state``. A transition the
table below does not allow is a bug in the caller: it is refused (the state stays), told once
per (from, to) pair to ``on_refused`` (the watcher logs it), and never raises, so a watcher
with a bug goes on watching::

    d = Detection(failures_needed=2, grace_ceiling=900, on_refused=log.error)
    d.recovering()          # from starting: refused, state stays "starting", one line logged
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

STARTING, HEALTHY, SUSPECT, SLOW, HUNG, CAPTURING, RESTARTING, RECOVERING, GAVE_UP = (
    "starting", "healthy", "suspect", "slow", "hung", "capturing", "restarting", "recovering", "gave_up",
)
STATES = (STARTING, HEALTHY, SUSPECT, SLOW, HUNG, CAPTURING, RESTARTING, RECOVERING, GAVE_UP)
PROBING_SOON = (SUSPECT, SLOW)  # a failed probe is confirmed (or cleared) at suspect_interval


# Which states each transition may start from. Anything else is refused (a caller's bug).
QUIET = (STARTING, HEALTHY, SUSPECT, SLOW)  # no incident open
INCIDENT = (HUNG, CAPTURING, RESTARTING, RECOVERING)
ALLOWED_FROM: dict[str, tuple[str, ...]] = {
    "failure": QUIET,  # a failed probe outside an incident
    "success": (*QUIET, GAVE_UP),  # a good probe outside an incident (gave_up: restored by a new daemon)
    "suspect": (HEALTHY,),  # the launch shim saw a stall: probe now
    "stall_seen": QUIET,  # the launch shim saw a stall: the next failure is decisive
    "starting": QUIET,  # a server process of this instance is loading
    "capturing": (HUNG,),
    "awaiting_recovery": (CAPTURING,),  # restart: none
    "restarting": (CAPTURING, RESTARTING, RECOVERING),  # the backoff, then the restart
    "recovering": (CAPTURING, RESTARTING, RECOVERING),  # after our restart, or someone else's (look-again)
    "recovered": (*INCIDENT, GAVE_UP),  # answered again, or another server process took over
    "gave_up": (STARTING, CAPTURING, RESTARTING, RECOVERING),  # starting: restored from the state file
    "resumed": (GAVE_UP,),
    "watching_again": (HEALTHY, SUSPECT, SLOW, *INCIDENT),  # the watcher restarted after a crash
}


@dataclass
class Detection:
    failures_needed: int
    grace_ceiling: float
    on_refused: Callable[[str], None] | None = None  # told once per refused (from, to) pair
    failures: int = 0
    first_failure_at: float | None = None
    graced: list[str] = field(default_factory=list)  # why the verdict was held back, if it was
    delivered: list[str] = field(default_factory=list)  # the last delivery that made it slow, if one did
    refused: set[tuple[str, str]] = field(default_factory=set)  # (from, transition) pairs refused so far
    _state: str = STARTING

    @property
    def state(self) -> str:
        """The current state: changed only by this class's transitions."""
        return self._state

    def _may(self, transition: str) -> bool:
        """May ``transition`` start from the current state? If not, refuse it (told once)."""
        if self._state in ALLOWED_FROM[transition]:
            return True
        key = (self._state, transition)
        if key not in self.refused:
            self.refused.add(key)
            if self.on_refused is not None:
                self.on_refused(f"policy refused '{transition}' from '{self._state}' (a bug: the state stays "
                                f"'{self._state}')")
        return False

    def _reset(self, state: str) -> None:
        self._state, self.failures, self.first_failure_at, self.graced, self.delivered = state, 0, None, [], []

    # --- probes outside an incident

    def success(self) -> str:
        """A good probe: healthy, the failure count starts over."""
        if self._may("success"):
            self._reset(HEALTHY)
        return self._state

    def failure(self, now: float, progress: list[str], delivered: Sequence[str] = ()) -> bool:
        """Record a failed probe; True when it makes a verdict (the state is then ``hung``).

        ``delivered``: tokens delivered since the previous probe (late on its own stream, or to
        other clients). They prove the server works: the state is ``slow`` and the window of
        failures starts over at this probe, whose own reply may still arrive late.
        ``progress``: work that advanced with nothing delivered (busy), held up to
        ``grace_ceiling``."""
        if not self._may("failure"):
            return False
        if delivered:
            self._state, self.delivered, self.graced = SLOW, list(delivered), []
            self.failures, self.first_failure_at = min(1, self.failures_needed - 1), now
            return False
        self.failures += 1
        if self.first_failure_at is None:
            self.first_failure_at = now
        in_grace = now - self.first_failure_at < self.grace_ceiling
        if progress and in_grace:
            self.graced = progress
            self.failures = min(self.failures, self.failures_needed - 1)  # progress holds the verdict
            self._state = SUSPECT
            return False
        if self.failures >= self.failures_needed:
            self._state = HUNG
            return True
        self._state = SUSPECT
        return False

    def would_judge(self, now: float, progress: Sequence[str]) -> bool:
        """Would a failed probe with nothing delivered make a verdict now? Changes nothing: the
        watcher asks before a verdict so that it can first wait for failed probes' streams that
        may still deliver (a token within ``probe.timeout`` of sending is a delivery)."""
        if self._state not in ALLOWED_FROM["failure"] or self.failures + 1 < self.failures_needed:
            return False
        first = self.first_failure_at if self.first_failure_at is not None else now
        return not (progress and now - first < self.grace_ceiling)

    def suspect(self) -> str:
        """Suspect without a failed probe (the launch shim saw a stall): probed again at once."""
        if self._may("suspect"):
            self._state = SUSPECT
        return self._state

    def stall_seen(self) -> None:
        """The launch shim shows a stall: this failure is the heartbeat's second, so the next
        failed probe is decisive."""
        if self._may("stall_seen"):
            self.failures = max(self.failures, self.failures_needed - 1)

    def starting(self) -> str:
        """A server process of this instance is loading: failures are no verdict meanwhile."""
        if self._may("starting"):
            self._state = STARTING
        return self._state

    # --- an incident: hung -> capturing -> restarting -> recovering -> healthy (or gave_up)

    def capturing(self) -> str:
        if self._may("capturing"):
            self._state = CAPTURING
        return self._state

    def awaiting_recovery(self) -> str:
        """Nothing may be restarted (restart: none): hung until it answers by itself."""
        if self._may("awaiting_recovery"):
            self._state = HUNG
        return self._state

    def restarting(self) -> str:
        """Backing off before a restart, or running one."""
        if self._may("restarting"):
            self._state = RESTARTING
        return self._state

    def recovering(self) -> str:
        if self._may("recovering"):
            self._state = RECOVERING
        return self._state

    def recovered(self, answered: bool = True) -> str:
        """The incident ends: healthy when it answers; ``starting`` when another server process
        took over and does not answer yet (it gets its startup allowance)."""
        if self._may("recovered"):
            self._reset(HEALTHY if answered else STARTING)
        return self._state

    def gave_up(self) -> str:
        """The restart budget is spent (or was, by an earlier daemon run): no more restarts."""
        if self._may("gave_up"):
            self._state = GAVE_UP
        return self._state

    def resumed(self) -> str:
        """Restarts allowed again (cool-down or `mlxwatch resume`): healthy until a probe fails."""
        if self._may("resumed"):
            self._reset(HEALTHY)
        return self._state

    def watching_again(self) -> str:
        """The watcher restarted after a crash: it knows nothing, as at start."""
        if self._may("watching_again"):
            self._reset(STARTING)
        return self._state
