"""A distributed server's ranks as evidence (an ``mlx.launch`` group, ``mlxwatch.host.group``).

Every rank takes part in every pass of mlx-lm's generation loop (the next request is shared by
``all_sum`` at least every 0.1 s, idle too), so a rank that is gone, stopped, or whose generation
thread died leaves the others waiting in that collective for ever: the group delivers nothing,
while rank 0 still answers ``/health`` and ``/v1/models``. That is a **stall** on its own
evidence: a probe waiting for its first token stops waiting at once, and its failure is
decisive; a rank that merely cannot be asked (its host does not answer over ssh) is no evidence
of anything, and is said so (a note).

The group is found once per proven server process (``find_group``: nothing for a single server)
and its ranks' states read again at each look that is due: every ``POLL_SUSPECT`` s while a probe
waits or the instance is suspect, every ``POLL_HEALTHY`` s otherwise (a remote rank is asked over
ssh). The group as last read is in the answer's ``detail`` (the state file, ``status``, metrics).
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Callable

from mlxwatch.evidence import Evidence, Seeing, Stall, Window
from mlxwatch.host.group import GONE, STOPPED, ZOMBIE, Group, Rank, find_group, refresh
from mlxwatch.host.process import ProcessIdentity

POLL_SUSPECT = 2.0
POLL_HEALTHY = 10.0
_WHY = {STOPPED: "is stopped (SIGSTOP or a debugger): it runs nothing",
        GONE: "is gone: its process exited or was replaced",
        ZOMBIE: "has exited (not yet reaped by mlx.launch)"}


@dataclass(frozen=True)
class GroupJudgement:
    hung: bool
    culprit_rank: int | None = None
    reason: str = ""  # one line: the rank and what it is; or why nothing is decided
    unknown: tuple[int, ...] = ()  # ranks whose state could not be read (their host did not answer)


def judge_group(ranks: Iterable[Rank], dead_generation: Collection[int] = ()) -> GroupJudgement:
    """Hung when a rank is stopped, gone or a zombie, or its generation thread is known dead
    (``dead_generation``: rank numbers) while it still runs; the lowest such rank is the culprit."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    unknown = tuple(r.rank for r in ranks if r.state not in (*_WHY, "running"))
    for r in ranks:
        if r.state in _WHY:
            return GroupJudgement(True, r.rank, f"{r.where} {_WHY[r.state]}; the other ranks wait for it "
                                                "in the collective", unknown)
        if r.rank in dead_generation:
            return GroupJudgement(True, r.rank, f"{r.where}: its generation thread died; the other ranks "
                                                "wait for it in the collective", unknown)
    if unknown:
        return GroupJudgement(False, None, "rank(s) " + ", ".join(map(str, unknown))
                              + " could not be asked (their host did not answer): no evidence either way", unknown)
    return GroupJudgement(False)


@dataclass
class GroupSource:
    identity: Callable[[], ProcessIdentity | None]  # the proven server: rank 0, if it is a group's
    name: str = "group"
    group: Group | None = None
    found_for: tuple[int, float] | None = None  # the server process the group was looked up for
    read_at: float | None = None

    async def prime(self) -> None:
        return None

    async def look(self, window: Window) -> Evidence:
        ident = self.identity()
        if ident is None:
            return Evidence()
        key = (ident.pid, ident.create_time)
        if key != self.found_for:
            self.found_for, self.read_at = key, window.end
            self.group = await asyncio.to_thread(find_group, ident.pid)
        elif self.group is not None and (self.read_at is None or window.end - self.read_at >= (
                POLL_SUSPECT if window.suspect or window.probe is not None else POLL_HEALTHY)):
            self.read_at = window.end
            self.group = await asyncio.to_thread(refresh, self.group)
        if self.group is None:
            return Evidence()
        judged = judge_group(self.group.ranks)
        detail = {"group": self.group.to_dict()}
        if not judged.hung:
            return Evidence(notes=(f"group: {judged.reason}",) if judged.reason else (), detail=detail)
        culprit = self.group.rank(judged.culprit_rank) if judged.culprit_rank is not None else None
        reason = f"group: {judged.reason}"
        episode = ("group", judged.culprit_rank, culprit.pid if culprit else None, culprit.state if culprit else None)
        # cut_after 0: no rank waits its turn here; the group cannot deliver until the culprit
        # runs again, so a probe waiting for its first token stops waiting at the next look.
        stall = Stall(reason, episode, source=self.name, cut_after=0.0, event="group_stall",
                      journal={"reason": reason, "culprit_rank": judged.culprit_rank, "group": self.group.to_dict()})
        return Evidence(stall=stall, seen=(reason,), detail=detail)


def build(seeing: Seeing) -> GroupSource:
    """The mlx.launch group whose rank 0 the proven server is, if any."""
    return GroupSource(identity=seeing.identity)
