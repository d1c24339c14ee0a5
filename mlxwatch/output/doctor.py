"""``mlxwatch doctor``: one line per finding, grouped by instance, then the tally::

    render_findings(await diagnose(...), console, config_path, state_dir)
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from mlxwatch.doctor import FAIL, OK, SKIP, WARN, Finding

STYLES = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def render_findings(findings: list[Finding], console: Console, config_path: Path, state_dir: Path) -> None:
    """One line per check: status, check, what was found, and the fix when there is one."""
    console.print(f"mlxwatch doctor: config {config_path}, state {state_dir}", markup=False, highlight=False)
    current: str | None = None
    for finding in findings:
        if finding.instance != current:
            current = finding.instance
            console.print(f"instance {current}:", markup=False, highlight=False, style="bold")
        fix = f"; fix: {finding.fix}" if finding.fix and finding.status in (WARN, FAIL) else ""
        line = f"  {finding.status:<4}  {finding.check:<10} {finding.message}{fix}"
        console.print(line, markup=False, highlight=False, style=STYLES.get(finding.status), soft_wrap=True)
    failures = sum(1 for f in findings if f.status == FAIL)
    warnings = sum(1 for f in findings if f.status == WARN)
    if failures:
        console.print(f"{failures} problem(s) to fix" + (f", {warnings} warning(s)" if warnings else ""),
                      markup=False, style="bold red")
    else:
        console.print("everything mlxwatch needs is in place" + (f" ({warnings} warning(s))" if warnings else ""),
                      markup=False, style="bold green")
