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

**The live group, never a dead one.** Whenever rank 0 is no longer the process found (a relaunch
by someone else, a new launcher), the group is found again from whoever serves the instance's
address now (``locate``, the watcher's lookup): measured on main, a group relaunched by its
supervisor was kept as "both ranks gone" for minutes (``mlxwatch_rank_up`` 0 while it served),
and its dead rank 0 was a stall that cut every probe after 1 s, so a slow but working new group
drew a verdict and a restart. A rank 0 that is gone is no stall of the group: the server itself
is gone, the probes say so. A launcher that is gone while its ranks run is said once a look
("launcher PID N is gone; 2 ranks orphaned"): it is no stall by itself either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlxwatch.evidence import Evidence, Stall, Window
from mlxwatch.host.group import GONE, STOPPED, ZOMBIE, Group, Rank, find_group, read_exits, refresh
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


def judge_group(ranks: Iterable[Rank], dead_generation: Collection[int] = (),
                exited: Sequence[int] = ()) -> GroupJudgement:
    """Hung when a rank is stopped, gone or a zombie, or its generation thread is known dead
    (``dead_generation``: rank numbers) while it still runs. The culprit: the first rank the
    launcher's log says exited on its own (``exited``, ``host.group.launcher_exits``) among those
    not running, else the lowest such rank (measured on main: rank 1 exited and the launcher
    ended rank 0, and the lowest, rank 0, was named)."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    unknown = tuple(r.rank for r in ranks if r.state not in (*_WHY, "running"))
    by_number = {r.rank: r for r in ranks}
    first = next((by_number[n] for n in exited if n in by_number and by_number[n].state in (GONE, ZOMBIE)), None)
    if first is not None:
        return GroupJudgement(True, first.rank, f"{first.where} exited (the launcher's log says so first); the "
                                                "other ranks wait for it in the collective or went with it", unknown)
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


def _size(path: Path | None) -> int:
    """A log's size now: where this group's lines start (0: no log, or unreadable)."""
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def _key(ident: ProcessIdentity) -> tuple[int, float]:
    return ident.pid, ident.create_time


def rank0_gone(group: Group) -> bool:
    """Rank 0 (the server at the instance's address) is no longer the process found."""
    rank0 = group.rank(0)
    return rank0 is None or (rank0.local and rank0.state in (GONE, ZOMBIE))


@dataclass
class GroupSource:
    identity: Callable[[], ProcessIdentity | None]  # the proven server: rank 0, if it is a group's
    locate: Callable[[], ProcessIdentity | None] = lambda: None  # who serves the address now (blocking)
    followed: Callable[[ProcessIdentity], None] = lambda ident: None  # told the rank 0 it follows now
    log: Callable[[], Path | None] = lambda: None  # the launcher's output (the instance's log), if known
    log_from: int = 0  # its size when the group was found: exits logged since are this group's
    name: str = "group"
    group: Group | None = None
    found_for: tuple[int, float] | None = None  # the server process the group was looked up for
    proven_for: tuple[int, float] | None = None  # the watcher's proven server when last looked
    lost: bool = False  # the group's rank 0 went: found again from the address at each due look
    read_at: float | None = None

    async def prime(self) -> None:
        return None

    async def look(self, window: Window) -> Evidence:
        ident = self.identity()
        if ident is not None and _key(ident) != self.proven_for:  # the watcher proved another server
            self.proven_for = _key(ident)
            if _key(ident) != self.found_for:
                self.found_for, self.read_at, self.lost = _key(ident), window.end, False
                self.log_from = await asyncio.to_thread(_size, self.log())
                self.group = await asyncio.to_thread(find_group, ident.pid, known=self.group)
        elif (self.group is not None or self.lost) and (self.read_at is None or window.end - self.read_at >= (
                POLL_SUSPECT if window.suspect or window.probe is not None else POLL_HEALTHY)):
            self.read_at = window.end
            if self.group is not None:
                self.group = await asyncio.to_thread(refresh, self.group)
            if self.lost or (self.group is not None and rank0_gone(self.group)):
                await self._follow()
        if self.group is None:
            return Evidence()
        exits = await asyncio.to_thread(read_exits, self.log(), self.log_from) if self.group.missing() else []
        judged = judge_group(self.group.ranks, exited=exits)
        detail = {"group": self.group.to_dict()}
        orphans = self.group.orphan_note()
        if not judged.hung:
            notes = tuple(f"group: {n}" for n in (orphans, judged.reason) if n)
            return Evidence(notes=notes, detail=detail)
        culprit = self.group.rank(judged.culprit_rank) if judged.culprit_rank is not None else None
        reason = f"group: {judged.reason}"
        episode = ("group", judged.culprit_rank, culprit.pid if culprit else None, culprit.state if culprit else None)
        # cut_after 0: no rank waits its turn here; the group cannot deliver until the culprit
        # runs again, so a probe waiting for its first token stops waiting at the next look.
        stall = Stall(reason, episode, source=self.name, cut_after=0.0, event="group_stall",
                      journal={"reason": reason, "culprit_rank": judged.culprit_rank, "group": self.group.to_dict()})
        return Evidence(stall=stall, seen=(reason,), detail=detail)

    async def _follow(self) -> None:
        """Rank 0 went: find the group again from whoever serves the address now. None there
        (yet): no group is kept (a dead one is never evidence), and the next due look asks again."""
        ident = await asyncio.to_thread(self.locate)
        if ident is None:
            self.group, self.lost = None, True
            return
        self.found_for, self.lost = _key(ident), False
        self.log_from = await asyncio.to_thread(_size, self.log())
        self.group = await asyncio.to_thread(find_group, ident.pid, known=self.group)
        self.followed(ident)
