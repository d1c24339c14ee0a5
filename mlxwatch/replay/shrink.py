"""``mlxwatch replay BUNDLE --shrink``: the fewest requests (and messages) that still hang the server.

Delta debugging (Zeller and Hildebrandt's ddmin): split the sequence in n parts; a part that
still hangs the server, or the sequence without one part, is the new sequence; else split
finer. Each trial starts a fresh server from the recorded command line (the prompt cache is
part of a trigger, so a server that served the last trial would lie) and replays the candidate
with the recorded timing, judged by the daemon's rules (``session``). Before the search, one
trial replays everything: the hang must come back at all. Requests sent after delivery stopped
are then dropped in one trial, if the hang still comes back without them (delivery may stop
before the trigger arrives, a quiet stretch between answers, so this is tried, not assumed). Then, request by request, the
``messages`` of a chat body are shrunk the same way (the body re-encoded as JSON; every other
field kept). Trials are bounded in count and in time; the best sequence found so far stands
when either runs out::

    found = await shrink(plan, opts, Budget(trials=64, seconds=1800), on_trial=print_line)
    found.requests, found.trials, found.seconds
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import Awaitable, Callable, Sequence, TypeVar

from mlxwatch.capture.requests import StoredRequest
from mlxwatch.errors import ReplayError
from mlxwatch.replay.run import Plan, run_replay
from mlxwatch.replay.options import Budget, ReplayOptions

T = TypeVar("T")


@dataclass(frozen=True)
class Trial:
    number: int
    kept: tuple[int, ...]  # recorded seqs replayed
    hung: bool
    seconds: float
    note: str = ""  # what was shrunk: "requests" or "messages of #N"
    after_seq: int | None = None


@dataclass
class Shrunk:
    requests: tuple[StoredRequest, ...]
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0
    exhausted: str | None = None  # the bound that ended the search early, if one did
    reproduced: bool = True  # the whole sequence hung the server in the first trial


class _OutOfBudget(Exception):
    pass


async def ddmin(items: Sequence[T], hangs: Callable[[list[T]], Awaitable[bool]],
                on_smaller: Callable[[list[T]], None] | None = None) -> list[T]:
    """Zeller's ddmin: a 1-minimal subsequence of ``items`` (which hang) that still hangs;
    ``on_smaller`` is told each smaller one found (the best so far, should the search be cut)."""
    current = list(range(len(items)))
    n = 2
    tried: dict[tuple[int, ...], bool] = {}

    async def test(candidate: list[int]) -> bool:
        key = tuple(candidate)
        if key not in tried:
            tried[key] = await hangs([items[i] for i in candidate])
        return tried[key]

    while len(current) >= 2:
        size = len(current) / n
        chunks = [c for c in (current[round(i * size):round((i + 1) * size)] for i in range(n)) if c]
        found: list[int] | None = None
        for chunk in chunks:
            if await test(chunk):
                found, n = chunk, 2
                break
        if found is None and n > 2:
            for i in range(len(chunks)):
                rest = [x for j, c in enumerate(chunks) if j != i for x in c]
                if await test(rest):
                    found, n = rest, max(n - 1, 2)
                    break
        if found is not None:
            current = found
            if on_smaller is not None:
                on_smaller([items[i] for i in current])
            continue
        if n >= len(current):
            break
        n = min(2 * n, len(current))
    return [items[i] for i in current]


async def shrink(plan: Plan, opts: ReplayOptions, budget: Budget, *, startup_timeout: float,
                 on_trial: Callable[[Trial, int], None] | None = None) -> Shrunk:
    """The smallest sequence of ``plan``'s requests found to hang a fresh server (see the
    module docstring); ``on_trial(trial, kept_count)`` after each trial."""
    started = time.monotonic()
    trials: list[Trial] = []

    async def attempt(candidate: Sequence[StoredRequest], note: str) -> bool:
        if len(trials) >= budget.trials:
            raise _OutOfBudget(f"{budget.trials} trials")
        if time.monotonic() - started >= budget.seconds:
            raise _OutOfBudget(f"{budget.seconds:g}s")
        t0 = time.monotonic()
        report = await run_replay(plan, replace(opts, repeat=1), plan.bundle, startup_timeout=startup_timeout,
                                  capture=False, requests=tuple(candidate), served=False)
        trial = Trial(len(trials) + 1, tuple(r.seq for r in candidate), report.outcome.hung,
                      round(time.monotonic() - t0, 1), note, report.outcome.after_seq)
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial, len(candidate))
        return report.outcome.hung

    requests = list(plan.requests)
    found = Shrunk(tuple(requests), trials)
    try:
        if not await attempt(requests, "all requests"):
            found.reproduced = False
            return found
        last = trials[-1].after_seq
        prefix = [r for r in requests if last is not None and r.seq <= last]
        if prefix and len(prefix) < len(requests) and await attempt(prefix, f"up to #{last}"):
            requests = prefix  # those sent after delivery stopped were no part of it
            found.requests = tuple(requests)
        def smaller(candidate: list[StoredRequest]) -> None:
            found.requests = tuple(candidate)

        requests = await ddmin(requests, lambda c: attempt(c, "requests"), smaller)
        found.requests = tuple(requests)
        for i, req in enumerate(requests):
            parts = _messages(req)
            if parts is None or len(parts) < 2:
                continue

            async def hangs_with(kept: list[int], i: int = i, req: StoredRequest = req) -> bool:
                candidate = list(found.requests)
                candidate[i] = _with_messages(req, kept)
                return await attempt(candidate, f"messages of #{req.seq}")

            def fewer(kept: list[int], i: int = i, req: StoredRequest = req) -> None:
                shrunk = list(found.requests)
                shrunk[i] = _with_messages(req, kept)
                found.requests = tuple(shrunk)

            await ddmin(list(range(len(parts))), hangs_with, fewer)
    except _OutOfBudget as exc:
        found.exhausted = str(exc)
    except ReplayError:
        if not trials:
            raise
        found.exhausted = "a server that would not start"
    found.seconds = round(time.monotonic() - started, 1)
    return found


def _messages(req: StoredRequest) -> list | None:
    try:
        data = json.loads(req.body)
    except (ValueError, RecursionError):
        return None
    messages = data.get("messages") if isinstance(data, dict) else None
    return messages if isinstance(messages, list) else None


def _with_messages(req: StoredRequest, kept: list[int]) -> StoredRequest:
    """``req`` with only the messages at ``kept`` (the body re-encoded as JSON, its other fields as they were)."""
    data = json.loads(req.body)
    data["messages"] = [m for j, m in enumerate(data["messages"]) if j in set(kept)]
    return replace(req, body=json.dumps(data, ensure_ascii=False).encode())
