"""macOS: what the OS recorded when a server died of memory (read by ``capture.death``).

- **Jetsam** (the memory pressure killer) writes ``JetsamEvent-<time>.ips`` to
  ``/Library/Logs/DiagnosticReports``: a header line with ``"bug_type": "298"``, then a body
  naming ``largestProcess``, ``memoryStatus`` (``pageSize``, ``memoryPages``) and, per process,
  ``{"pid", "name", "rpages", "reason", ...}`` (``reason``: ``per-process-limit``,
  ``vm-compressor-space-shortage``, ...). Read with regular expressions, not as JSON: reports
  quoted in public are often cut, and a field is still a field.
- **A Metal out-of-memory** that ended the process leaves no report of its own, only a
  unified-log line (``Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)``,
  seen under ``IOGPUMetalError``). One narrow ``log show`` query asks for it: that PID's lines
  naming a Metal memory error, from ``LOG_BEFORE`` s before the death to ``LOG_AFTER`` after,
  bounded by ``LOG_TIMEOUT``. log(1): ``log show [--predicate filter] [--style
  default|compact|json|syslog] [--start date/time] [--end date/time] ...``.
- **A kernel panic** reboots the Mac; the next boot writes a ``.panic`` report whose text has
  ``panic(cpu N caller 0x...): "why" @file:line``.

Not run on a Mac here (docs/verified.md); the parsers are tested on reports quoted in public
issues (``tests/data``, each file names its source).
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPORT_DIRS = ("/Library/Logs/DiagnosticReports", "~/Library/Logs/DiagnosticReports")
JETSAM_BUG_TYPE = "298"
DEFAULT_PAGE = 16384  # Apple silicon's page size, when a report does not say
LOG = "/usr/bin/log"
LOG_BEFORE = 120.0  # seconds of the unified log read before the death was seen
LOG_AFTER = 5.0
LOG_TIMEOUT = 20.0
METAL_OOM = ("Insufficient Memory", "kIOGPUCommandBufferCallbackErrorOutOfMemory", "metal::malloc")
MiB = 1024 * 1024


@dataclass(frozen=True)
class JetsamKill:
    pid: int
    name: str | None
    reason: str | None
    rpages: int | None
    page_size: int
    largest: str | None  # the report's largestProcess

    @property
    def resident(self) -> int | None:
        return self.rpages * self.page_size if self.rpages is not None else None

    def summary(self) -> str:
        out = f"killed by jetsam ({self.reason or 'reason not given'})"
        if self.resident is not None:
            out += f" at {self.resident / MiB:.0f} MiB resident"
        if self.largest:
            out += f"; the largest process was {self.largest}"
        return out


def _field(text: str, name: str) -> str | None:
    m = re.search(rf'"{name}"\s*:\s*("([^"]*)"|(-?\d+))', text)
    return None if m is None else (m.group(2) if m.group(2) is not None else m.group(3))


def is_jetsam_report(text: str) -> bool:
    return _field(text[:4096], "bug_type") == JETSAM_BUG_TYPE or "JetsamEvent" in text[:4096]


def parse_jetsam(text: str, pid: int) -> JetsamKill | None:
    """The process ``pid`` as a JetsamEvent report lists it, or None when it does not."""
    for entry in re.findall(r"\{[^{}]*\}", text):  # the per-process entries are flat objects
        if _field(entry, "pid") != str(pid):
            continue
        rpages = _field(entry, "rpages")
        page = _field(text, "pageSize")
        return JetsamKill(pid, _field(entry, "name"), _field(entry, "reason"),
                          int(rpages) if rpages is not None else None,
                          int(page) if page is not None else DEFAULT_PAGE, _field(text, "largestProcess"))
    return None


def jetsam_header(text: str) -> dict[str, str | None]:
    """What a report says about the whole machine: bug type, largest process, page size."""
    return {"bug_type": _field(text, "bug_type"), "largest": _field(text, "largestProcess"),
            "page_size": _field(text, "pageSize"), "timestamp": _field(text, "timestamp")}


_PANIC = re.compile(r'panic\(cpu \d+ caller 0x[0-9a-f]+\): \\?"(.*?)\\?" ?@([\w./+-]+:\d+)')


def parse_panic(text: str) -> str | None:
    """``"why" @file:line`` of a panic report (its text, or the JSON ``panicString``), or None."""
    m = _PANIC.search(text)
    return f'"{m.group(1)}" @{m.group(2)}' if m else None


def log_show_command(pid: int, died_at: float, before: float = LOG_BEFORE, after: float = LOG_AFTER) -> list[str]:
    """One narrow, time-bounded query: that process's Metal memory errors around its death."""
    fmt = "%Y-%m-%d %H:%M:%S"
    start = datetime.fromtimestamp(died_at - before).strftime(fmt)
    end = datetime.fromtimestamp(died_at + after).strftime(fmt)
    clauses = " OR ".join(f'eventMessage CONTAINS "{m}"' for m in METAL_OOM)
    return [LOG, "show", "--style", "compact", "--start", start, "--end", end,
            "--predicate", f"processID == {pid} AND ({clauses})"]


def metal_oom_lines(text: str) -> list[str]:
    """The lines of ``log show``'s answer (or a server log) that name a Metal memory error."""
    return [line.strip() for line in text.splitlines() if any(m in line for m in METAL_OOM)]


def run_log_show(pid: int, died_at: float) -> tuple[list[str], str | None]:
    """(the Metal out-of-memory lines, or why the query could not run). Blocking, bounded."""
    try:
        done = subprocess.run(log_show_command(pid, died_at), capture_output=True, text=True, timeout=LOG_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as exc:
        return [], f"log show: {exc}"
    if done.returncode != 0:
        return [], f"log show: exit {done.returncode}: {done.stderr.strip()[:200]}"
    return metal_oom_lines(done.stdout), None


def recent_reports(since: float, suffixes: tuple[str, ...], dirs: tuple[str, ...] | None = None,
                   prefix: str = "") -> list[Path]:
    """Reports written after ``since`` (epoch seconds), newest first (``REPORT_DIRS`` by default)."""
    found = []
    for d in REPORT_DIRS if dirs is None else dirs:
        folder = Path(d).expanduser()
        if not folder.is_dir():
            continue
        for path in folder.iterdir():
            if path.suffix not in suffixes or not path.name.startswith(prefix):
                continue
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if mtime >= since:
                found.append((mtime, path))
    found.sort(reverse=True)
    return [p for _, p in found]


def read_text(path: Path, limit: int = 4 * MiB) -> str:
    try:
        with open(path, errors="replace") as fh:
            return fh.read(limit)
    except OSError:
        return ""


def now() -> float:
    return time.time()
