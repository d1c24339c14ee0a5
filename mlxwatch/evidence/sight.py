"""All of one instance's sources, asked as one (``Sight.look``): the watcher's only view of
what a server delivers. A stall one source reports is void once another saw anything flow after
its quiet began (the log saw a prompt advance while the streams paused for it); each stall
episode wakes the watcher once (``first_time``).

Then the cadence (``mlxwatch.evidence.cadence``) judges the answers against this server's own
pace: a silence within it is no stall (a big model reading a long prompt writes nothing for a
chunk's time), a sign that is owed but not yet due is progress, a non-streamed answer that may
still be in the making is hidden work, and a token owed after a prompt finished reading that did
not come is a stall, whatever progress other prompts show.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Hashable, Sequence

from mlxwatch.evidence import Evidence, Source, Stall, Window, combine
from mlxwatch.evidence.cadence import Cadence, Pace


@dataclass
class Sight:
    sources: Sequence[Source]
    cadence: Cadence | None = None  # the server's learned pace (None: probe.quiet_window alone)
    triggered: set[Hashable] = field(default_factory=set)  # stall episodes that had their early probe
    pace: Pace | None = None  # the last judgement, for the state file and status

    async def look(self, window: Window) -> Evidence:
        answers = await asyncio.gather(*(s.look(window) for s in self.sources))
        evidence = combine(answers)
        stall = evidence.stall
        if stall is not None and stall.since is not None and evidence.last_flow is not None \
                and evidence.last_flow > stall.since:
            others = [a for a in answers if a.stall is None or a.stall.key != stall.key]
            still = next((a.stall for a in others if a.stall is not None), None)
            evidence = replace(evidence, stall=still)
        if self.cadence is not None:
            evidence = self._paced(evidence, window.end)
        return evidence

    def _paced(self, evidence: Evidence, now: float) -> Evidence:
        """The answers held against the server's pace (see the module's docstring)."""
        assert self.cadence is not None
        pace = self.pace = self.cadence.judge(now, evidence.last_flow, evidence.detail)
        stall, progress, hidden = evidence.stall, evidence.progress, evidence.hidden_work or pace.hidden
        if stall is not None and stall.source == "kernel" and stall.since is not None and pace.allows(now, stall.since):
            stall = None  # a silence within this server's pace
        if pace.due is not None and now < pace.due:
            progress = (*progress, f"pace: {pace.owes} ({pace.basis}); next sign due in {pace.due - now:.0f}s")
        if pace.overdue:
            progress = ()  # the token owed did not come: other prompts' reading holds no verdict
            if stall is None:
                done = [at for at, _ in (evidence.detail.get("log") or {}).get("completed") or ()]
                stall = Stall(f"pace: {pace.overdue}", key=("pace", max(done, default=None)), source="cadence",
                              event="kernel_stall",
                              journal={"reason": pace.overdue, "streams": (evidence.detail.get("kernel") or {})
                                       .get("streams", 0), "waiting": 0})
        return replace(evidence, stall=stall, progress=progress, hidden_work=hidden, pace=pace)

    async def prime(self) -> None:
        """A judgement starts: what the sources have not read yet is history."""
        await asyncio.gather(*(s.prime() for s in self.sources))

    def first_time(self, stall: Stall | None) -> bool:
        """True once per stall episode: whether this stall should wake the watcher."""
        if stall is None or stall.key in self.triggered:
            return False
        self.triggered.add(stall.key)
        if len(self.triggered) > 100:
            self.triggered = {stall.key}
        return True
