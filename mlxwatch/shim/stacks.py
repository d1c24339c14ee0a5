"""The launch shim as a source of evidence for capture: all-thread dumps on demand, parsed into
``mlxwatch.stacks.ThreadStack``, and the heartbeat read across a window. Plain arguments in,
values out; the capture steps that use these live in ``mlxwatch.capture``.

Stacks: ``find_dumper`` says whether a process has a shim that can dump its stacks,
``request_dump`` asks it for one (faulthandler's text, from the shim's dump thread or, while a
native call holds the GIL, from faulthandler itself; the thread names from the heartbeat) and
``pyspy_json`` writes the threads in py-spy's JSON shape. No root.

Heartbeat: ``heartbeat_window`` reads it when a window opens and when it closes;
``ShimWindow.findings`` turns the difference into the evidence lines the classifier uses, each
starting with ``shim:`` so a bundle says which evidence came from inside the server.

Usage::

    hb, why_not = find_dumper(pid, create_time)
    dump = request_dump(ProcessIdentity.of(pid), hb)   # blocking: call it from a worker thread
    window = await heartbeat_window(pid, create_time, seconds=4.5)
    window.findings(probe_tokens=0).blocked
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from mlxwatch.host.process import ProcessIdentity
from mlxwatch.shim import heartbeat
from mlxwatch.shim.heartbeat import Change, Heartbeat
from mlxwatch.stacks import Frame, ThreadStack

PROMPT_ALLOWANCE = 512  # prompt tokens a probe's own prompt could account for (its prompt is ~30)

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)\b")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.+?)\s*$')


def parse_dump(text: str, names: dict[int, tuple[str, int | None]] | None = None) -> list[ThreadStack]:
    """faulthandler's all-thread dump as py-spy-shaped threads (frames innermost first, as both
    print them). ``names`` maps thread idents to (name, native id) from the heartbeat."""
    names = names or {}
    threads: list[ThreadStack] = []
    current: ThreadStack | None = None
    for line in text.splitlines():
        m = _THREAD.match(line)
        if m:
            ident = int(m.group(2), 16)
            name, native = names.get(ident, (f"thread {m.group(2)}", None))
            current = ThreadStack(name=name, os_thread_id=native, active=m.group(1) == "Current thread",
                                  owns_gil=False)
            threads.append(current)
            continue
        f = _FRAME.match(line)
        if f and current is not None:
            current.frames.append(Frame(f.group(3), f.group(1), int(f.group(2))))
    return threads


def pyspy_json(threads: list[ThreadStack]) -> list[dict[str, object]]:
    """Threads in py-spy's JSON shape (``stacks/shim-N.json``): one reader for both sources."""
    return [{"thread_name": t.name, "os_thread_id": t.os_thread_id, "active": t.active, "owns_gil": None,
             "frames": [{"name": f.name, "filename": f.filename, "line": f.line} for f in t.frames]}
            for t in threads]


def find_dumper(pid: int, create_time: float | None) -> tuple[Heartbeat | None, str | None]:
    """The heartbeat of the process's shim if it can dump stacks, else (None, why not).
    Blocking (reads files): call it from a worker thread."""
    hb, problem = heartbeat.find(pid, create_time)
    if hb is None:
        return None, problem
    if not hb.dumps_offered:
        return None, "the shim in this process offers no stack dumps (see the server log)"
    return hb, None


@dataclass(frozen=True)
class ShimDump:
    """One all-thread dump: the text as the shim wrote it (faulthandler's format), its threads
    named, and who took it (``thread`` or ``signal``: ``heartbeat.StackDump``)."""

    text: str
    threads: list[ThreadStack]
    by: str


def request_dump(identity: ProcessIdentity, known: Heartbeat) -> ShimDump:
    """Ask the shim for an all-thread dump now, naming threads from its newest heartbeat (or
    ``known``, if it no longer publishes). Blocking; raises ShimError or OSError."""
    fresh, _ = heartbeat.find(identity.pid, identity.create_time)
    hb = fresh or known
    dump = heartbeat.request_stacks(hb, identity)
    return ShimDump(dump.text, parse_dump(dump.text, hb.thread_names()), dump.by)


def dumps_are_over(exc: Exception) -> bool:
    """After this failure, would the next dump request fail the same way? (A stopped process
    does not answer the signal; a vanished one is gone.)"""
    return "no stack dump" in str(exc) or "gone" in str(exc)


@dataclass
class ShimFindings:
    """Evidence lines from the heartbeat, sorted by what they point to."""

    present: bool = False
    dead: list[str] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)
    livelock: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ShimWindow:
    """The heartbeat when a window opened and when it closed; ``problem``: why one is missing."""

    start: Heartbeat | None = None
    end: Heartbeat | None = None
    problem: str | None = None

    def to_dict(self) -> dict[str, object]:
        change = self.change()
        return {"found": self.end is not None or self.start is not None, "problem": self.problem,
                "start": self.start.summary() if self.start else None,
                "end": self.end.summary() if self.end else None,
                "change": vars(change) if change else None}

    def change(self) -> Change | None:
        if self.start is None or self.end is None:
            return None
        return Change.between(self.start, self.end)

    def findings(self, probe_tokens: int = 0) -> ShimFindings:
        hb = self.end or self.start
        out = ShimFindings(present=hb is not None)
        if hb is None:
            return out
        if hb.thread_died:
            exc = hb.thread_exception
            what = f"{exc.get('type')}: {exc.get('message')}" if exc else "no exception recorded (see the log)"
            out.dead.append(f"shim: the generation thread ended: {what} (traceback in shim/heartbeat-end.json)")
        if hb.stale:
            out.stale.append(f"shim: no heartbeat for {hb.age:.0f}s: no Python thread ran in the process "
                             "(a native call holds the GIL) or it is stopped")
        if not hb.seam_ok:
            out.notes.append(f"shim: heartbeat unavailable ({hb.seam_state}: {hb.seam_detail or 'no detail'}); "
                             "stacks on demand only")
            return out
        change = self.change()
        if change is None:
            return out
        others = change.tokens - max(0, probe_tokens)
        if others > 0:
            out.busy.append(f"shim: {others} token(s) delivered to other clients during the window "
                            f"({others / change.seconds:.1f}/s)" if change.seconds > 0 else
                            f"shim: {others} token(s) delivered to other clients during the window")
        if change.prompt_tokens > PROMPT_ALLOWANCE:
            out.busy.append(f"shim: {change.prompt_tokens} prompt token(s) processed during the window")
        in_flight = max(self.end.in_flight if self.end else 0, self.start.in_flight if self.start else 0)
        if out.busy or hb.stale:
            return out
        if change.steps > 0 and change.tokens == 0 and in_flight:
            out.livelock.append(f"shim: the batch loop took {change.steps} step(s) in {change.seconds:.1f}s and "
                                f"emitted no token ({in_flight} request(s) in flight, none delivered for "
                                f"{hb.stalled_for:.0f}s)")
        elif change.steps == 0 and in_flight:
            inside = hb.in_step_for
            where = (f"inside one BatchGenerator.next call for {inside:.0f}s" if inside is not None
                     else f"not stepping for {change.seconds:.1f}s")
            out.blocked.append(f"shim: the batch loop is {where} with {in_flight} request(s) in flight "
                               f"(no token for {hb.stalled_for:.0f}s)")
        return out


async def heartbeat_window(pid: int, create_time: float | None, seconds: float,
                           on_start: Callable[[Heartbeat], Awaitable[None]] | None = None) -> ShimWindow:
    """Read the heartbeat now and ``seconds`` after now. No shim now: a window with no start and
    the reason, returned at once. ``on_start`` receives the first reading as soon as it is read
    (capture writes it to the bundle then, so a capture cut short still holds it)."""
    opened = time.monotonic()
    start, problem = await asyncio.to_thread(heartbeat.find, pid, create_time)
    if start is None:
        return ShimWindow(problem=problem)
    if on_start is not None:
        await on_start(start)
    await asyncio.sleep(max(0.0, opened + seconds - time.monotonic()))
    end, problem = await asyncio.to_thread(heartbeat.find, pid, create_time)
    return ShimWindow(start, end, problem if end is None else None)
