"""The capture's step runner: each step is a function that returns its typed result; the runner
applies the capture's ceiling, times the step and records its outcome, and a step that raises or
runs out of time never costs the others (blackbox_exporter's prober + handler).

A step says how it went in its result (``StepResult.outcome``: ok, failed or skipped, with an
``error`` that says why, or for ``ok`` what went wrong on the way). A step that raises is
``failed``; one still running when the ceiling comes is cancelled and ``stopped at ceiling``.
Either way the runner hands back the step's ``unfinished`` result (what it had gathered, if the
step kept anything as it went) so classification reads what there is. ``records`` is what
``manifest.json`` lists under ``steps``, in the order the steps started.

Usage::

    runner = StepRunner(deadline=time.monotonic() + 58, ceiling=60)
    versions = await runner.run("versions", lambda: read_versions(pid), unfinished=VersionsResult)
    manifest["steps"] = [r.to_dict() for r in runner.records()]
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

StepCallback = Callable[[str, str], None]  # (step name, "start" | outcome)

STOPPED = "stopped at ceiling"


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """How a step went, as the step itself says; each step kind adds what it found."""

    outcome: str = "ok"  # ok | failed | skipped
    error: str | None = None  # why it failed or was skipped; with ok, what went wrong on the way


@dataclass(frozen=True)
class StepRecord:
    """One step as manifest.json lists it: when it started (seconds into the capture), how long
    it took, its outcome (ok | failed | skipped | stopped at ceiling) and why."""

    name: str
    start: float
    duration: float
    outcome: str
    error: str | None

    def to_dict(self) -> dict:
        return {"name": self.name, "start": round(self.start, 3), "duration": round(self.duration, 3),
                "outcome": self.outcome, "error": self.error}


R = TypeVar("R", bound=StepResult)


class StepRunner:
    """Runs steps until ``deadline`` (monotonic seconds) and keeps their records."""

    def __init__(self, *, deadline: float, ceiling: float, on_step: StepCallback | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.deadline = deadline
        self.ceiling = ceiling  # for the message: the whole capture's limit, of which deadline is a part
        self.on_step = on_step or (lambda name, state: None)
        self._begun: list[tuple[str, float]] = []
        self._records: dict[str, StepRecord] = {}

    def now(self) -> float:
        """Seconds since the runner (the capture) started."""
        return self.clock() - self.started

    async def run(self, name: str, work: Callable[[], Awaitable[R]], unfinished: Callable[[], R]) -> R:
        """Run one step to its result, or to ``unfinished()`` if it raised or met the deadline.
        Raises only CancelledError, when the capture itself is cancelled (the step is ended first)."""
        start = self.now()
        self._begun.append((name, start))
        self.on_step(name, "start")
        task = asyncio.ensure_future(work())
        outcome: str = "cancelled"
        error: str | None = "the capture was cancelled"
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, self.deadline - self.clock()))
            if not done:
                await _end(task)
                outcome, error = STOPPED, f"the {self.ceiling:g}s capture ceiling was reached"
                return unfinished()
            if task.cancelled():  # ended by something other than the runner: as good as the ceiling
                outcome, error = STOPPED, f"the {self.ceiling:g}s capture ceiling was reached"
                return unfinished()
            exc = task.exception()
            if exc is not None:  # a broken step must never cost the others
                outcome, error = "failed", f"{type(exc).__name__}: {exc}"
                return unfinished()
            result = task.result()
            outcome, error = result.outcome, result.error
            return result
        except asyncio.CancelledError:
            await _end(task)
            raise
        finally:
            self._records[name] = StepRecord(name, start, self.now() - start, outcome, error)
            self.on_step(name, outcome)

    def records(self) -> list[StepRecord]:
        """The finished steps' records, in the order the steps started."""
        return [self._records[name] for name, _ in self._begun if name in self._records]


async def _end(task: asyncio.Future) -> None:
    """Cancel a step and wait until it has stopped (its cleanup ran)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
