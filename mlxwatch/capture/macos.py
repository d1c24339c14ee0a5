"""macOS-only evidence: ``sample``, ``spindump`` and crash reports.

These run only on macOS; on Linux the steps are recorded as "not available on this OS". The
command lines follow each tool's documented synopsis; the parsers are plain functions tested on
real output quoted in public sources (``tests/data``, each file names its source).

- ``sample pid [duration [samplingInterval]] [-wait] [-mayDie] [-fullPaths] [-e] [-file filename]``
  (sample(1); ``-file``, not ``-f``). It suspends the target at each sample point (every 1 ms by
  default; mlxwatch asks for 10 ms, 500 samples in 5 s, to disturb a serving process less), works
  on one's own processes without root, and ``-mayDie`` grabs symbols at once so a target that
  dies mid-sample still gets a symbolicated report. Its call graph shows every thread's native
  frames: the C callers of the Python frames and MLX's and Metal's own threads, which py-spy
  cannot show on macOS (no ``--native`` there) and often cannot read at all on Apple silicon
  (py-spy #242, #754: "Operation timed out (os error 60)"). ``parse_sample`` reads it.
- ``spindump [pid | partial-name [duration [interval]]] [<options>]`` (spindump(8)); its
  usage text documents ``-onlyTarget`` (sample only the target process: no other user's process
  in the bundle), ``-stdout`` / ``-noFile`` (report to stdout, no file) and ``-noBinary``. It needs
  root; under ``sudo -n`` a ``-o FILE`` would be written by root and could not be made private
  or even read back by the unprivileged daemon, so the report comes on stdout and mlxwatch
  writes the file itself. It is run by absolute path so a sudoers rule can name it exactly.
- Crash reports: ``~/Library/Logs/DiagnosticReports`` and ``/Library/Logs/DiagnosticReports``.
  An ``.ips`` file is two JSON objects: a one-line header (``bug_type`` "309" is a crash) and
  the body (``pid``, ``procName``, ``exception``); a legacy or translated ``.crash`` is text with
  ``Process: Python [1234]``. ReportCrash writes the report a moment after the process died,
  so a search for a dead process's report is retried for a few seconds.

A Metal command-buffer error (``Insufficient Memory``, GPU timeout) aborts the whole process
from Metal's completion queue on mlx < 0.32 (mlx #3224, #3390: ``check_error`` throws on
``com.Metal.CompletionQueueDispatch``); then the crash report is the evidence. mlx 0.32.0
(PR #3523) records the error on its events instead and raises it on the thread that waits,
the server's generation thread.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

SAMPLE = "sample"  # /usr/bin, on every PATH launchd gives
SPINDUMP = "/usr/sbin/spindump"  # absolute: what a sudoers rule names
SAMPLE_SECONDS = 5
SAMPLE_INTERVAL_MS = 10
SPINDUMP_INTERVAL_MS = 10
CRASH_DIRS = ("~/Library/Logs/DiagnosticReports", "/Library/Logs/DiagnosticReports")
CRASH_BUG_TYPE = "309"
CRASH_SETTLE = 3.0  # seconds to wait for ReportCrash when the process is gone


def is_macos(platform: str = sys.platform) -> bool:
    return platform.startswith("darwin")


def sample_command(pid: int, out_file: Path, seconds: int = SAMPLE_SECONDS,
                   interval_ms: int = SAMPLE_INTERVAL_MS) -> list[str]:
    return [SAMPLE, str(pid), str(seconds), str(interval_ms), "-mayDie", "-file", str(out_file)]


def spindump_command(pid: int, seconds: int = SAMPLE_SECONDS, interval_ms: int = SPINDUMP_INTERVAL_MS,
                     sudo: bool = False) -> list[str]:
    """The report goes to stdout (the caller writes it into the bundle): no root-owned file."""
    argv = ["sudo", "-n"] if sudo else []
    return argv + [SPINDUMP, str(pid), str(seconds), str(interval_ms), "-onlyTarget", "-stdout", "-noFile",
                   "-noBinary"]


def tool_available(name: str) -> bool:
    return shutil.which(name) is not None or (os.path.isabs(name) and os.access(name, os.X_OK))


# --- sample's report


@dataclass
class SampleThread:
    """One thread of a ``sample`` call graph: its heading and its heaviest path, outermost first."""

    heading: str  # "Thread_96035   DispatchQueue_1: com.apple.main-thread  (serial)"
    samples: int
    path: list[str] = field(default_factory=list)  # frames as "function  (in library)", outermost first

    @property
    def leaf(self) -> str:
        return self.path[-1] if self.path else "?"


@dataclass
class SampleReport:
    process: str | None = None  # "python3.13 [96033]"
    header: dict[str, str] = field(default_factory=dict)
    threads: list[SampleThread] = field(default_factory=list)

    def findings(self) -> list[str]:
        """Lines a person looks for: MLX/Metal threads and where each thread spends its samples."""
        out = []
        for t in self.threads:
            where = " > ".join(_short(f) for f in t.path[-4:]) or "?"
            mark = " [MLX/Metal]" if any(_is_mlx_metal(f) for f in t.path) or _is_mlx_metal(t.heading) else ""
            out.append(f"{t.heading.split()[0].rstrip(':')}{mark}: {t.samples} samples, heaviest path ends {where}")
        return out


_FRAME = re.compile(r"^(?P<indent>[\s+!:|]*?)(?P<count>\d+)\s+(?P<what>\S.*?)\s*$")
_THREAD = re.compile(r"^\s*(?P<count>\d+)\s+(?P<heading>Thread_\S+.*?)\s*$")  # no + ! : | before it


def parse_sample(text: str) -> SampleReport:
    """Read a ``sample`` report: the header fields and, per thread of the call graph, the path
    that took the most samples (at each depth the first child with the highest count; ``sample``
    lists children heaviest first). The graph's depth is its indentation (the ``+ ! : |`` that
    draw it count as indentation). Lines it does not recognise are skipped; a fragment without
    a ``Call graph:`` line is read as graph from its first line."""
    report = SampleReport()
    lines = text.splitlines()
    start = next((i + 1 for i, line in enumerate(lines) if line.startswith("Call graph:")), None)
    for line in lines[:start]:
        m = re.match(r"^([A-Z][A-Za-z /()]+?):\s+(.*)$", line)
        if m:
            report.header.setdefault(m.group(1).strip(), m.group(2).strip())
    report.process = report.header.get("Process")
    current: SampleThread | None = None
    on_path: list[tuple[int, int]] = []  # (depth, count) of the frames on the current heaviest path
    skip_below: int | None = None  # inside a lighter sibling's subtree: its depth
    for line in lines[start or 0:]:
        if not line.strip():
            continue
        if start is not None and not line.startswith(" "):  # the next section ("Total number in stack")
            break
        t = _THREAD.match(line)
        if t:
            current = SampleThread(t.group("heading"), int(t.group("count")))
            report.threads.append(current)
            on_path, skip_below = [], None
            continue
        m = _FRAME.match(line)
        if current is None or m is None:
            continue
        depth, count = len(m.group("indent")), int(m.group("count"))
        if skip_below is not None:
            if depth > skip_below:
                continue
            skip_below = None
        if on_path and depth <= on_path[-1][0]:  # a sibling of a frame on the path
            same = [c for d, c in on_path if d == depth]
            if same and count <= same[0]:
                skip_below = depth
                continue
            keep = len([d for d, _ in on_path if d < depth])
            on_path, current.path = on_path[:keep], current.path[:keep]
        on_path.append((depth, count))
        current.path.append(_frame_text(m.group("what")))
    return report


def _frame_text(what: str) -> str:
    """``f  (in lib.dylib) + 8  [0x18cd8e3cc]`` -> ``f  (in lib.dylib)``: offsets and addresses dropped."""
    what = re.sub(r"\s+\[0x[0-9a-f]+(?:,0x[0-9a-f]+)*\]\s*$", "", what)
    what = re.sub(r"\s+\+\s+\d+\s*$", "", what)
    return what.strip()


def _short(frame: str) -> str:
    return frame.split("  (in ")[0].strip()


_MLX_METAL = ("mlx::", "libmlx", "com.Metal", "Metal", "MTL", "IOGPU", "AGX")


def _is_mlx_metal(text: str) -> bool:
    return any(marker in text for marker in _MLX_METAL)


# --- crash reports


@dataclass(frozen=True)
class CrashReport:
    pid: int | None
    process: str | None
    bug_type: str | None  # .ips only; "309" = crash
    exception: str | None  # "EXC_CRASH (SIGABRT)"
    crashed_queue: str | None = None  # "com.Metal.CompletionQueueDispatch" when the text names it


# "Thread 35 Crashed::  Dispatch queue: Q" (older text reports), "Triggered by Thread: 28, Dispatch Queue: Q" (newer)
_CRASHED_QUEUE = re.compile(r"Crashed::?\s+Dispatch queue:\s+(\S+)|Triggered by Thread:.*Dispatch Queue:\s+(\S+)")


def parse_crash_report(text: str) -> CrashReport | None:
    """An ``.ips`` (header line + JSON body) or a text crash report; None when it is neither."""
    head, _, body = text.partition("\n")
    try:
        header = json.loads(head)
    except ValueError:
        header = None
    if isinstance(header, dict) and "bug_type" in header:
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        if isinstance(data, dict):
            exc = data.get("exception")
            exc = exc if isinstance(exc, dict) else {}
            pid = data.get("pid")
            exception = f"{exc.get('type')} ({exc.get('signal')})" if exc.get("type") else None
            return CrashReport(pid if isinstance(pid, int) else None, _str(data.get("procName")),
                               _str(header.get("bug_type")), exception)
        return CrashReport(None, _str(header.get("name") or header.get("app_name")), _str(header.get("bug_type")), None)
    pid = process = exception = queue = None
    for line in text.splitlines()[:400]:
        if process is None and (m := re.match(r"^Process:\s+(.+?)\s+\[(\d+)\]", line)):
            process, pid = m.group(1), int(m.group(2))
        elif exception is None and (m := re.match(r"^Exception Type:\s+(.+?)\s*$", line)):
            exception = m.group(1)
        elif queue is None and (m := _CRASHED_QUEUE.search(line)):
            queue = m.group(1) or m.group(2)
    if process is None:
        return None
    return CrashReport(pid, process, None, exception, queue)


def _str(value: object) -> str | None:
    return str(value) if value is not None else None


def crash_report_matches(text: str, pid: int | None, names: tuple[str, ...] = ("python", "mlx")) -> bool:
    """Is this a crash report (an ``.ips`` of another bug_type is not) of our server: its PID,
    or without a PID a process named like a Python or MLX server?"""
    report = parse_crash_report(text)
    if report is None or (report.bug_type is not None and report.bug_type != CRASH_BUG_TYPE):
        return False
    if pid is not None:
        return report.pid == pid
    return any(n in (report.process or "").lower() for n in names)


def recent_crash_reports(pid: int | None, since: float, dirs: tuple[str, ...] = CRASH_DIRS, limit: int = 5,
                         settle: float = CRASH_SETTLE, alive: bool | None = None) -> list[Path]:
    """Crash reports written after ``since`` (epoch seconds) that name our process, newest first.

    When the process is gone (``alive`` False, or found so) and no report names it yet, the
    search is repeated for up to ``settle`` seconds: ReportCrash writes after the death."""
    if alive is None:
        alive = pid is None or psutil.pid_exists(pid)
    deadline = time.monotonic() + (0.0 if alive else settle)
    while True:
        found = _scan_reports(pid, since, dirs)
        if found or time.monotonic() >= deadline:
            return found[:limit]
        time.sleep(0.5)


def _scan_reports(pid: int | None, since: float, dirs: tuple[str, ...]) -> list[Path]:
    found = []
    for d in dirs:
        folder = Path(d).expanduser()
        if not folder.is_dir():
            continue
        for path in folder.glob("*"):
            if path.suffix not in (".ips", ".crash"):
                continue
            try:
                mtime = path.stat().st_mtime
                if mtime < since:
                    continue
                with open(path, errors="replace") as fh:
                    text = fh.read(200_000)
            except OSError:
                continue
            if crash_report_matches(text, pid):
                found.append((mtime, path))
    found.sort(reverse=True)
    return [p for _, p in found]


def since_default(hours: float = 24) -> float:
    return time.time() - hours * 3600
