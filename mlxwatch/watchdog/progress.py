"""Is the server doing legitimate work while our probe waits? Only visible progress counts.

Signals, read between two failed probes:

- the log's ``Prompt processing progress: X/Y`` lines for prompts other than the probe's own
  (a long prefill: the probe may be queued behind it);
- the probe's own keepalives stopping short of ``Y/Y`` (its prompt is still being processed);
- other clients' ``POST /v1/chat/completions ... 200`` lines (more than our own probes made).

CPU is never a signal: a livelock burns CPU and delivers nothing. mlx-lm logs the POST line
when a request is admitted, not when it finishes, so a livelock that keeps admitting requests
can look busy: that is why the grace these signals buy has a ceiling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlxwatch.probes import CheckReport
from mlxwatch.serverlog import completions_ok, progress_lines, read_recent, since_last_start


@dataclass
class ProgressTracker:
    log: Path | None
    _progress_seen: int = 0
    _posts_seen: int = 0
    _primed: bool = False
    probe_totals: set[int] = field(default_factory=set)

    def _read(self) -> tuple[list[tuple[int, int]], int]:
        text = since_last_start(read_recent(self.log)) if self.log else ""
        return progress_lines(text), completions_ok(text)

    def prime(self) -> None:
        """Remember where the log is now; later calls report only what came after."""
        progress, posts = self._read()
        self._progress_seen, self._posts_seen, self._primed = len(progress), posts, True

    def observe(self, reports: list[CheckReport]) -> list[str]:
        """Progress since the last call, given the probes sent meanwhile. Empty = no progress."""
        signals = []
        for report in reports:
            for k in report.generation.keepalives:
                self.probe_totals.add(k.total)
        last = reports[-1].generation.keepalives[-1:] if reports else []
        if last and last[0].processed < last[0].total:
            signals.append(f"the probe's own prompt was still being processed ({last[0].processed}/{last[0].total})")
        progress, posts = self._read()
        if not self._primed or len(progress) < self._progress_seen or posts < self._posts_seen:
            self._progress_seen, self._posts_seen = 0, 0  # first look, or the log restarted
        new_progress = [p for p in progress[self._progress_seen:] if p[1] not in self.probe_totals]
        ours = sum(1 for r in reports if r.generation.status == 200)
        others = posts - self._posts_seen - ours
        self._progress_seen, self._posts_seen, self._primed = len(progress), posts, True
        if new_progress:
            x, y = new_progress[-1]
            signals.append(f"log: prompt processing advanced ({len(new_progress)} progress line(s), now {x}/{y})")
        if others > 0:
            signals.append(f"log: {others} other request(s) answered (POST ... 200)")
        return signals
