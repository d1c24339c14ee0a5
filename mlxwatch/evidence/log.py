"""The server's log as evidence: prompt processing that advanced, followed by offset and inode
(old lines are never read twice, however large the log grows).

- ``Prompt processing progress: X/Y`` for a prompt other than a probe's own, with X higher than
  the last X seen for that prompt (``serverlog.markers.prompt_advances``): a long prefill
  advanced, and the probe may be queued behind it: **progress**;
- the failed probe's own keepalives advancing: its own prompt was being processed: **progress**.

What buys nothing: CPU (a livelock burns CPU and delivers nothing), and ``POST ... 200`` access
lines, which mlx-lm writes when it *admits* a request, not when it answers. Tokens streamed to
clients leave no line here: the kernel source sees those.

The log is read every ``POLL`` s while the instance is suspect or a probe waits, every
``POLL_HEALTHY`` s otherwise (what is new since the last read: one stat, usually nothing); each
advance is dated by the read that found it, so an answer's window is as sharp as the reads.

For the cadence (``mlxwatch.evidence.cadence``) the answer's ``detail["log"]`` says which prompts
are being read (``open``: Y -> (X, when), X < Y), the prompts that finished reading lately
(``completed``: (when, Y), oldest first), and the reading speed seen between two chunks of one
prompt (``token_seconds``: seconds per prompt token, each sample given once).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from mlxwatch.evidence import Evidence, Seeing, Window
from mlxwatch.probes import CheckReport
from mlxwatch.serverlog.follow import LogFollower
from mlxwatch.serverlog.markers import SERVER_START, logged_advances

POLL = 1.0  # seconds between reads while a probe waits
POLL_HEALTHY = 2.0  # ... otherwise: a chunk's time is measured from these reads
KEPT = 1000
OPEN_KEPT = 100  # prompts being read, at most (a prompt abandoned mid-read is never finished)
# tokens two lines of one prompt must be apart to time its reading: less is mostly a step's fixed
# cost (measured: 0.32 logs 3006/3007 then 3007/3007 6 ms later, 6 ms "a token")
MIN_SAMPLE_TOKENS = 256
STEP_SPREAD = 1.0  # seconds: lines of one batch step are logged this close together (measured: within 3 ms)


@dataclass
class ProgressTracker:
    """The log followed, and the progress rule applied to what is new."""

    log: Path | None
    writer_pid: Callable[[], int | None] | None = None  # the server's PID, if known: is it still on a rotated log?
    follower: LogFollower | None = field(init=False, default=None)
    last_x: dict[int, int] = field(default_factory=dict)  # prompt total Y -> highest X seen
    probe_totals: set[int] = field(default_factory=set)
    server_started: bool = False  # the last read saw a server start: the prompts being read before are gone

    def __post_init__(self) -> None:
        self.follower = LogFollower(self.log, writer_pid=self.writer_pid) if self.log else None

    def prime(self) -> str | None:
        """Start from the log's current end (blocking I/O: call it from a thread)."""
        self.last_x.clear()
        return self.follower.prime() if self.follower else None

    def read(self) -> tuple[list[tuple[int, int, float | None]], list[str]]:
        """The prompt advances written since the last read (X, Y, when logged if the line
        says), and notes (blocking I/O)."""
        if self.follower is None:
            return [], []
        notes = []
        chunk = self.follower.read_new()
        if chunk.error:
            notes.append(f"log not followed: {chunk.error}")
        if chunk.event:  # lines come in order across files: what was seen per prompt still holds
            notes.append(f"log {chunk.event}: {chunk.detail}")
        if chunk.skipped_bytes:
            notes.append(f"log grew by {chunk.skipped_bytes} bytes more than one read takes; read its newest part")
        out, self.last_x = logged_advances(chunk.lines, self.last_x, self.probe_totals)
        self.server_started = any(SERVER_START in line for line in chunk.lines)
        if len(self.last_x) > 1000:  # bounded memory over weeks of distinct prompts
            self.last_x = dict(list(self.last_x.items())[-100:])
        return out, notes


def own_prompt_progress(report: CheckReport | None) -> str | None:
    """The failed probe's own prompt was being processed (its keepalives advanced)."""
    if report is None:
        return None
    keepalives = report.generation.keepalives
    done = [k.processed for k in keepalives]
    if len(set(done)) > 1 and done[-1] < keepalives[-1].total:
        return f"the probe's own prompt was being processed ({done[-1]}/{keepalives[-1].total})"
    return None


class _Open(NamedTuple):
    """A prompt being read: its last line's X, when it was read, when it was logged (if the
    line says), and ``LogSource.read_total`` then."""

    x: int
    at: float
    logged: float | None
    total: int


@dataclass
class LogSource:
    tracker: ProgressTracker
    clock: Callable[[], float]
    name: str = "log"
    advances: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=KEPT))
    read_at: float | None = None
    pending_notes: list[str] = field(default_factory=list)  # from priming: said with the next answer
    reading: dict[int, _Open] = field(default_factory=dict)  # prompt Y -> its last line, while X < Y
    read_total: int = 0  # prompt tokens the log showed read, all prompts together
    completed: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=OPEN_KEPT))  # (when, Y)
    token_seconds: list[float] = field(default_factory=list)  # speed samples not yet given

    def _pace(self, at: float, advanced: list[tuple[int, int, float | None]]) -> None:
        """Prompts being read and finished, and the time per token between two chunks of one:
        by the lines' own stamps where both have one, else by when they were read. The tokens
        are those every prompt read meanwhile: mlx-lm reads a chunk of each prompt waiting in one
        batch step (measured: three agents' prompts, a line of each every 87 s at 12 ms a token:
        timed by one prompt's tokens alone, the pace was three times too slow)."""
        for x, y, logged in advanced:
            before = self.reading.pop(y, None)
            self.read_total += x - (before.x if before is not None else 0)
            # not a new request of its size, and far enough apart to time
            read = self.read_total - before.total if before is not None else 0
            if before is not None and x > before.x and read >= MIN_SAMPLE_TOKENS:
                if logged is not None and before.logged is not None:
                    if logged > before.logged:
                        self.token_seconds.append((logged - before.logged) / read)
                elif at > before.at:
                    self.token_seconds.append((at - before.at) / read)
            if x < y:
                self.reading[y] = _Open(x, at, logged, self.read_total)
            else:
                self.completed.append((at, y))
        while len(self.reading) > OPEN_KEPT:
            self.reading.pop(next(iter(self.reading)))

    def _read_together(self) -> list[int]:
        """The open prompts (their Ys) the latest batch step read: their lines were logged
        within ``STEP_SPREAD`` of the newest (or, unstamped, read in the same poll). The next
        step reads a chunk of each of them, so their next sign is due after all those tokens;
        a prompt left mid-read (its client gone) is not among them."""
        if not self.reading:
            return []
        stamps = {y: o.logged for y, o in self.reading.items() if o.logged is not None}
        if stamps:
            newest = max(stamps.values())
            return sorted(y for y, stamp in stamps.items() if newest - stamp <= STEP_SPREAD)
        newest_at = max(o.at for o in self.reading.values())
        return sorted(y for y, o in self.reading.items() if o.at == newest_at)

    def follow(self, log: Path) -> bool:
        """Follow ``log`` from its end from now on (a launchd job's log, named later); False
        when it is followed already. Blocking I/O: call it from a thread."""
        if log == self.tracker.log:
            return False
        tracker = ProgressTracker(log, writer_pid=self.tracker.writer_pid)
        tracker.prime()
        self.tracker = tracker
        return True

    async def prime(self) -> None:
        self.read_at = self.clock()
        # no log followed: nothing to read, no thread (each probe primes: 10 a second at 300 instances)
        note = await asyncio.to_thread(self.tracker.prime) if self.tracker.follower is not None else self.tracker.prime()
        self.advances.clear()
        if note:
            self.pending_notes.append(note)

    async def look(self, window: Window) -> Evidence:
        notes, self.pending_notes = self.pending_notes, []
        if window.probe is not None:
            for k in window.probe.generation.keepalives:
                self.tracker.probe_totals.add(k.total)
        if self.tracker.follower is not None:
            every = POLL if window.suspect or window.probe is not None else POLL_HEALTHY
            if window.probe is not None or self.read_at is None or window.end - self.read_at >= every:
                advanced, read_notes = await asyncio.to_thread(self.tracker.read)
                self.read_at = window.end
                notes += read_notes
                self.advances.extend((window.end, x, y) for x, y, _ in advanced)
                if self.tracker.server_started:  # a new process: no prompt is read across it
                    self.reading.clear()
                self._pace(window.end, advanced)
        inside = [(x, y) for at, x, y in self.advances if window.start < at <= window.end]
        progress = []
        if inside:
            x, y = inside[-1]
            progress.append(f"log: prompt processing advanced ({len(inside)} step(s), now {x}/{y})")
        own = own_prompt_progress(window.probe)
        if own:
            progress.append(own)
        last = self.advances[-1][0] if self.advances else None
        samples, self.token_seconds = self.token_seconds, []
        detail = {"log": {"followed": self.tracker.follower is not None,
                          "open": {y: (o.x, o.at) for y, o in self.reading.items()},
                          "together": self._read_together(),
                          "completed": list(self.completed), "token_seconds": samples}}
        return Evidence(progress=tuple(progress), notes=tuple(notes), last_flow=last, detail=detail)


def build(seeing: Seeing) -> LogSource:
    """The instance's log (``instances[].log``; a launchd job's may be followed later)."""
    return LogSource(ProgressTracker(seeing.inst().log, writer_pid=seeing.server_pid), seeing.clock)
