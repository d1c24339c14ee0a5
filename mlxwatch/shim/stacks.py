"""Capture's use of the launch shim: faulthandler stacks as a stack source, and the heartbeat
over the capture window as evidence.

Stacks (``capture.stacks``: ``auto`` | ``pyspy`` | ``shim`` | ``sample``): ``shim`` asks the
server's shim for an all-thread dump at each snapshot time (the same schedule as py-spy's: 0,
spacing, 2×spacing…) and writes ``stacks/shim-N.txt`` (faulthandler's text, with the thread
names the heartbeat gives) and ``stacks/shim-N.json`` (py-spy's JSON shape). No root, and it
works while a native call holds the GIL. ``auto`` uses the shim when the process has one that
answers and py-spy otherwise; ``pyspy`` never asks the shim; ``sample`` takes no Python stacks
(macOS ``sample`` runs as always and is then the only stack source).

The heartbeat is read when the window opens and when it closes (``shim/heartbeat-start.json``,
``shim/heartbeat-end.json``); ``ShimWindow.findings`` turns the difference into the evidence
lines the classifier uses, each starting with ``shim:`` so a bundle says which evidence came
from inside the server.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from mlxwatch.shim import heartbeat
from mlxwatch.shim.heartbeat import Change, Heartbeat, ShimError
from mlxwatch.stacks import Frame, ThreadStack

STACK_MODES = ("auto", "pyspy", "shim", "sample")
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


def _thread_dicts(threads: list[ThreadStack]) -> list[dict[str, Any]]:
    return [{"thread_name": t.name, "os_thread_id": t.os_thread_id, "active": t.active, "owns_gil": None,
             "frames": [{"name": f.name, "filename": f.filename, "line": f.line} for f in t.frames]}
            for t in threads]


async def take_stacks(cap: Any, rec: Any, *, required: bool) -> bool:
    """The stacks step from the shim. True when it produced snapshots. With ``required``
    (``capture.stacks: shim``) a missing shim is the step's failure; in ``auto`` it is silence
    and the caller goes on with py-spy."""
    req = cap.req
    create_time = cap.process.get("create_time")
    hb, problem = await asyncio.to_thread(heartbeat.find, req.pid, create_time)
    if hb is None or hb.stack_signal is None:
        if required:
            why = problem if hb is None else "the shim in this process has no stack signal (see the server log)"
            rec.outcome, rec.error = "failed", f"shim stacks: {why}"
            cap.stacks_error = rec.error
        return False
    errors: list[str] = []
    started = time.monotonic()
    for i in range(1, req.snapshots + 1):
        wait = started + (i - 1) * req.spacing - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        fresh, _ = await asyncio.to_thread(heartbeat.find, req.pid, create_time)
        hb = fresh or hb  # newer thread names, if it still publishes
        at = cap.now()
        try:
            text = await asyncio.to_thread(heartbeat.request_stacks, hb, create_time)
        except (ShimError, OSError) as exc:
            errors.append(f"snapshot {i}: {exc}")
            if "no stack dump" in str(exc) or "gone" in str(exc):
                break  # a stopped or vanished process will not answer the next signal either
            continue
        threads = parse_dump(text, hb.thread_names())
        cap.snapshots.append((at, threads))
        header = (f"# shim (faulthandler) dump {i} at +{at:.2f}s ({datetime.now(timezone.utc).isoformat()}); "
                  "thread names from the heartbeat:\n")
        header += "".join(f"#   {t.name}\n" for t in threads)
        await cap.write(f"stacks/shim-{i}.txt", header + text)
        await cap.write_json(f"stacks/shim-{i}.json", _thread_dicts(threads))
    if errors:
        cap.stacks_error = "shim stacks: " + "; ".join(errors)
        rec.error = cap.stacks_error
        rec.outcome = "failed" if not cap.snapshots else "ok"
        if not cap.snapshots and not required:
            rec.outcome = "not run"  # auto: py-spy is tried next and decides the outcome
    return bool(cap.snapshots)


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


@dataclass
class ShimWindow:
    start: Heartbeat | None = None
    end: Heartbeat | None = None
    problem: str | None = None

    def to_dict(self) -> dict[str, Any]:
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


async def watch_window(cap: Any, rec: Any) -> None:
    """The heartbeat step: read at the window's start and end (beside stacks, CPU and probe)."""
    req = cap.req
    cap.shim_window = window = ShimWindow()
    if req.pid is None or "process" in cap.process.get("errors", {}):
        rec.outcome, rec.error = "skipped", "no process to inspect"
        return
    create_time = cap.process.get("create_time")
    opened = time.monotonic()
    window.start, window.problem = await asyncio.to_thread(heartbeat.find, req.pid, create_time)
    if window.start is None:
        rec.outcome, rec.error = "skipped", f"no launch shim in this process (`mlxwatch launch`): {window.problem}"
        return
    await cap.write_json("shim/heartbeat-start.json", window.start.data)
    await asyncio.sleep(max(0.0, opened + cap.window_seconds - time.monotonic()))
    window.end, problem = await asyncio.to_thread(heartbeat.find, req.pid, create_time)
    if window.end is not None:
        await cap.write_json("shim/heartbeat-end.json", window.end.data)
    else:
        window.problem = problem
        rec.error = f"heartbeat gone by the window's end: {problem}"
