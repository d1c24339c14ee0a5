"""All of one instance's sources, asked as one (``Sight.look``): the watcher's only view of
what a server delivers. A stall one source reports is void once another saw anything flow after
its quiet began (the log saw a prompt advance while the streams paused for it); each stall
episode wakes the watcher once (``first_time``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Hashable, Sequence

from mlxwatch.evidence import Evidence, Source, Stall, Window, combine


@dataclass
class Sight:
    sources: Sequence[Source]
    triggered: set[Hashable] = field(default_factory=set)  # stall episodes that had their early probe

    async def look(self, window: Window) -> Evidence:
        answers = await asyncio.gather(*(s.look(window) for s in self.sources))
        evidence = combine(answers)
        stall = evidence.stall
        if stall is not None and stall.since is not None and evidence.last_flow is not None \
                and evidence.last_flow > stall.since:
            others = [a for a in answers if a.stall is None or a.stall.key != stall.key]
            still = next((a.stall for a in others if a.stall is not None), None)
            evidence = replace(evidence, stall=still)
        return evidence

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
