"""When is a group hung, from its ranks' own state: the judgement the daemon adds to the probe
through rank 0 for a distributed server (an ``mlx.launch`` group, ``host.group``).

Every rank takes part in every pass of mlx-lm's generation loop (the next request is shared by
``all_sum`` at least every 0.1 s, idle too), so a rank that is gone, stopped, or whose generation
thread died leaves the others waiting in that collective for ever: the group delivers nothing,
while rank 0 still answers ``/health`` and ``/v1/models``. That is a stall on its own evidence,
which makes the next failed probe decisive; a rank that merely cannot be asked (its host does
not answer over ssh) is not evidence of anything, and is said so::

    judged = judge_group(group.ranks, dead_generation={1})
    judged.hung, judged.culprit_rank, judged.reason

Pure: no I/O; the caller refreshes the group (``host.group.refresh``).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from mlxwatch.host.group import GONE, STOPPED, ZOMBIE, Rank

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
