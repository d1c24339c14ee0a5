"""Drive an evidence source the way the watcher does, one window after another, from sync tests."""

from __future__ import annotations

import asyncio

from mlxwatch.evidence import Evidence, Window
from mlxwatch.evidence.log import LogSource, ProgressTracker
from mlxwatch.probes import CheckReport


class LogLooks:
    """A log source asked once per failed probe, each window following the last."""

    def __init__(self, tracker: ProgressTracker) -> None:
        self.t = 0.0
        self.source = LogSource(tracker, clock=lambda: self.t)

    @property
    def tracker(self) -> ProgressTracker:
        return self.source.tracker

    def prime(self) -> str | None:
        return self.source.tracker.prime()

    def observe(self, report: CheckReport | None) -> Evidence:
        self.t += 1.0
        return asyncio.run(self.source.look(Window(self.t - 1.0, self.t, probe=report, suspect=True)))
