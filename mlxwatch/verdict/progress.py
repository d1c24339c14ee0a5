"""Is the server doing legitimate work while our probe waits? Only work that advanced counts.

Delivery first: tokens of the previous failed probe that arrived after its deadline, on the
stream the watcher keeps reading (``GenerationProbeResult.late_tokens``), prove the server
works; it is slow, not hung (``Progress.delivered``).

Then work with nothing delivered yet (busy), read between two failed probes, from the log
followed by offset and inode (old lines are never read twice, however large the log grows):

- ``Prompt processing progress: X/Y`` for a prompt other than the probe's own, with X higher
  than the last X seen for that prompt: a long prefill advanced, and the probe may be queued
  behind it;
- the probe's own keepalives advancing (its own prompt was being processed).

What buys nothing: CPU (a livelock burns CPU and delivers nothing), and ``POST ... 200`` access
lines, which mlx-lm writes when it *admits* a request, not when it answers: a client retrying
against a livelocked server would otherwise look like traffic being served. Tokens streamed to
other clients leave no line in the log and no count an unprivileged outsider can read: Linux's
``/proc/PID/io`` counts write(2) but not the send(2) that Python's HTTP server uses (measured),
per-socket byte counts need netlink sock_diag, and macOS shows none without root. They stay
invisible here until the launch shim's heartbeat reports deliveries from inside.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mlxwatch.probes import CheckReport
from mlxwatch.serverlog.follow import LogFollower
from mlxwatch.serverlog.markers import PROGRESS, SERVER_START


@dataclass(frozen=True)
class Progress:
    """What one observation found: the reasons to hold a verdict (empty: none), and notes."""

    signals: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # log rotated, unreadable, ... (said once, not evidence)
    delivered: tuple[str, ...] = ()  # tokens delivered since the previous probe: slow, not hung


def late_delivery(previous: CheckReport | None) -> str | None:
    """What a failed probe's stream delivered after its deadline, once it is no longer read
    (the next probe ended it); None if nothing. A late token is a delivery like any other."""
    if previous is None or previous.healthy or previous.generation.late_tokens <= 0:
        return None
    g = previous.generation
    first = next((e["t"] for e in g.transcript if e.get("kind") == "late_token"), None)
    when = f", the first {first:.1f}s after it was sent" if first is not None else ""
    return f"the previous probe's reply arrived late: {g.late_tokens} token(s){when} ({g.reason})"


def prompt_advances(lines: Iterable[str], last_x: Mapping[int, int],
                    probe_totals: Collection[int]) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """The progress rule, written once (the watcher between probes, capture over its window):
    a ``Prompt processing progress: X/Y`` line advanced when its prompt is not a probe's own
    (``probe_totals``: the Ys their keepalives showed) and X grew past the last X logged for
    that Y (``last_x``; mlx-lm logs a prompt's last chunk twice). A server start line begins a
    new process, whose prompts start over. Returns the advances (X, Y) in order and the last X
    per Y after ``lines``; ``last_x`` itself is left as it was."""
    last = dict(last_x)
    out = []
    for line in lines:
        if SERVER_START in line:
            last.clear()
            continue
        m = PROGRESS.search(line)
        if not m:
            continue
        x, y = int(m.group(1)), int(m.group(2))
        if y in probe_totals:
            continue
        if x > last.get(y, 0):
            out.append((x, y))
        last[y] = x
    return out, last


@dataclass
class ProgressTracker:
    log: Path | None
    writer_pid: Callable[[], int | None] | None = None  # the server's PID, if known: is it still on a rotated log?
    follower: LogFollower | None = field(init=False, default=None)
    last_x: dict[int, int] = field(default_factory=dict)  # prompt total Y -> highest X seen
    probe_totals: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.follower = LogFollower(self.log, writer_pid=self.writer_pid) if self.log else None

    def prime(self) -> str | None:
        """Start from the log's current end (blocking I/O: call it from a thread)."""
        self.last_x.clear()
        return self.follower.prime() if self.follower else None

    def observe(self, report: CheckReport, previous: CheckReport | None = None) -> Progress:
        """Progress since the previous call, given the failed probe just made and the one
        before it, if that one failed too and its stream was read on (blocking I/O)."""
        signals, notes = [], []
        late = late_delivery(previous)
        keepalives = report.generation.keepalives
        for k in keepalives:
            self.probe_totals.add(k.total)
        done = [k.processed for k in keepalives]
        if len(set(done)) > 1 and done[-1] < keepalives[-1].total:
            signals.append(f"the probe's own prompt was being processed ({done[-1]}/{keepalives[-1].total})")
        if self.follower is not None:
            chunk = self.follower.read_new()
            if chunk.error:
                notes.append(f"log not followed: {chunk.error}")
            if chunk.event:  # lines come in order across files: what was seen per prompt still holds
                notes.append(f"log {chunk.event}: {chunk.detail}")
            if chunk.skipped_bytes:
                notes.append(f"log grew by {chunk.skipped_bytes} bytes more than one read takes; read its newest part")
            advanced = self._advanced(chunk.lines)
            if advanced:
                x, y = advanced[-1]
                signals.append(f"log: prompt processing advanced ({len(advanced)} step(s), now {x}/{y})")
        return Progress(tuple(signals), tuple(notes), (late,) if late else ())

    def _advanced(self, lines: list[str]) -> list[tuple[int, int]]:
        out, self.last_x = prompt_advances(lines, self.last_x, self.probe_totals)
        if len(self.last_x) > 1000:  # bounded memory over weeks of distinct prompts
            self.last_x = dict(list(self.last_x.items())[-100:])
        return out
