"""macOS-only evidence: ``sample``, ``spindump`` and crash reports.

These run only on macOS; on Linux the steps are recorded as "not available on this OS". The
command construction and the crash-report matching are plain functions, tested on recorded
output. ``sample`` suspends the target while sampling and works on one's own processes without
root; ``spindump`` needs root and samples the whole system; an ``Insufficient Memory`` Metal
error can abort the whole process, and then the crash report is the evidence.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

SAMPLE_SECONDS = 5
CRASH_DIRS = ("~/Library/Logs/DiagnosticReports", "/Library/Logs/DiagnosticReports")


def is_macos(platform: str = sys.platform) -> bool:
    return platform.startswith("darwin")


def sample_command(pid: int, out_file: Path, seconds: int = SAMPLE_SECONDS) -> list[str]:
    return ["sample", str(pid), str(seconds), "-f", str(out_file)]


def spindump_command(pid: int, out_file: Path, seconds: int = SAMPLE_SECONDS, sudo: bool = False) -> list[str]:
    argv = ["sudo", "-n"] if sudo else []
    return argv + ["spindump", str(pid), str(seconds), "10", "-o", str(out_file)]


def tool_available(name: str) -> bool:
    return shutil.which(name) is not None


def crash_report_matches(text: str, pid: int | None, names: tuple[str, ...] = ("python", "mlx")) -> bool:
    """Does a crash report belong to our server? ``.ips`` files start with a JSON header line,
    then a JSON body with ``"pid"`` and ``"procName"``; older ``.crash`` files are plain text
    with ``Process: Python [1234]``."""
    head, _, body = text.partition("\n")
    for chunk in (body, head):
        try:
            data = json.loads(chunk)
        except ValueError:
            continue
        if isinstance(data, dict) and "pid" in data:
            if pid is not None:
                return data.get("pid") == pid
            return any(n in str(data.get("procName", "")).lower() for n in names)
    for line in text.splitlines()[:40]:
        if line.startswith("Process:"):
            if pid is not None:
                return f"[{pid}]" in line
            return any(n in line.lower() for n in names)
    return False


def recent_crash_reports(pid: int | None, since: float, dirs: tuple[str, ...] = CRASH_DIRS, limit: int = 5) -> list[Path]:
    """Crash reports written after ``since`` (epoch seconds) that name our process, newest first."""
    found = []
    for d in dirs:
        folder = Path(d).expanduser()
        if not folder.is_dir():
            continue
        for path in folder.glob("*"):
            if path.suffix not in (".ips", ".crash"):
                continue
            try:
                if path.stat().st_mtime < since:
                    continue
                text = path.read_text(errors="replace")[:200_000]
            except OSError:
                continue
            if crash_report_matches(text, pid):
                found.append(path)
    found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return found[:limit]


def since_default(hours: float = 24) -> float:
    return time.time() - hours * 3600
