"""``mlxwatch doctor``: one line per finding, grouped by instance, then the tally::

    render_findings(await diagnose(...), console, config_path, state_dir)
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from mlxwatch.doctor import FAIL, OK, SKIP, WARN, Finding
from mlxwatch.output.text import lines_of

STYLES = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


HANG = " " * 19  # under the finding's text: "  FAIL  server     "


def render_findings(findings: list[Finding], console: Console, config_path: Path, state_dir: Path) -> None:
    """One finding per check: status, check, what was found, and the fix when there is one on
    a line of its own; each reflowed under the finding's text to the terminal, or to 80
    columns when piped (a server line was 138 columns)."""
    lines_of(console, f"mlxwatch doctor: config {config_path}, state {state_dir}")
    current: str | None = None
    for finding in findings:
        if finding.instance != current:
            current = finding.instance
            lines_of(console, f"instance {current}:", style="bold")
        style = STYLES.get(finding.status)
        lines_of(console, f"  {finding.status:<4}  {finding.check:<10} {finding.message}", HANG, style)
        if finding.fix and finding.status in (WARN, FAIL):
            lines_of(console, f"{HANG}fix: {finding.fix}", HANG + "  ", style)
    failures = sum(1 for f in findings if f.status == FAIL)
    warnings = sum(1 for f in findings if f.status == WARN)
    if failures:
        console.print(f"{failures} problem(s) to fix" + (f", {warnings} warning(s)" if warnings else ""),
                      markup=False, style="bold red")
    else:
        console.print("everything mlxwatch needs is in place" + (f" ({warnings} warning(s))" if warnings else ""),
                      markup=False, style="bold green")
