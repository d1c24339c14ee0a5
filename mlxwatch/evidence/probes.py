"""The failed probes' own streams as evidence. A probe that missed its first-token deadline is
not closed: mlx-lm notices a closed stream only when it next writes (a ``BrokenPipeError`` in
its log, the token lost), so an abandoned probe would stay in its batch. Its stream is read on
(``report.lingering``) until the server ends it or ``probe.timeout`` after sending, and longer
while the server shows progress or delivery (``hold``, up to ``probe.grace_ceiling``): a token
on it, however late, is a **delivery**: the server is ``slow``, never hung.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from mlxwatch.evidence import Evidence, Seeing, Window
from mlxwatch.probes import CheckReport


def late_delivery(previous: CheckReport | None) -> str | None:
    """What a failed probe's stream delivered after its deadline; None if nothing. A late
    token is a delivery like any other."""
    if previous is None or previous.healthy or previous.generation.late_tokens <= 0:
        return None
    g = previous.generation
    first = next((e["t"] for e in g.transcript if e.get("kind") == "late_token"), None)
    when = f", the first {first:.1f}s after it was sent" if first is not None else ""
    return f"the previous probe's reply arrived late: {g.late_tokens} token(s){when} ({g.reason})"


@dataclass
class ProbeStreams:
    """The failed probes whose streams are still read."""

    name: str = "probes"
    waiting: list[CheckReport] = field(default_factory=list)  # no late token counted yet
    draining: list[CheckReport] = field(default_factory=list)  # counted: read on to their bound
    found: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=100))

    def add(self, report: CheckReport) -> None:
        if not report.healthy and report.lingering is not None:
            self.waiting.append(report)

    def tasks(self) -> set[asyncio.Task[None]]:
        """The readers of the streams that have delivered nothing yet and still run."""
        return {r.lingering for r in self.waiting if r.lingering is not None and not r.lingering.done()}

    def hold(self, until: float) -> None:
        """Read every open stream at least until ``until`` (loop time): the server shows
        progress or delivery, so closing one would cost its reply (and a broken pipe)."""
        for r in (*self.waiting, *self.draining):
            r.generation.read_on(until)

    def count(self, now: float) -> list[str]:
        """Late deliveries not counted yet (each probe once); streams that ended with
        nothing are let go."""
        lines, still = [], []
        for r in self.waiting:
            line = late_delivery(r)
            if line:
                lines.append(line)
                self.found.append((now, line))
                if r.lingering is not None and not r.lingering.done():
                    self.draining.append(r)
            elif r.lingering is not None and not r.lingering.done():
                still.append(r)
        self.waiting = still
        self.draining = [r for r in self.draining if r.lingering is not None and not r.lingering.done()]
        return lines

    async def prime(self) -> None:
        return None

    async def look(self, window: Window) -> Evidence:
        self.count(window.end)
        delivered = tuple(line for at, line in self.found if window.start < at <= window.end)
        return Evidence(delivered=delivered, last_flow=self.found[-1][0] if self.found else None)

    async def end(self) -> None:
        """Stop reading every stream (their counts stay in their results)."""
        tasks = [r.lingering for r in (*self.waiting, *self.draining) if r.lingering is not None]
        self.waiting, self.draining = [], []
        for task in tasks:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def build(seeing: Seeing) -> ProbeStreams:
    """The failed probes' streams, read on (the watcher hands them over)."""
    return ProbeStreams()
