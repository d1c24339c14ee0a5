"""``mlxwatch demo``: its progress as it goes (``DemoView``, the ``demo.DemoProgress`` the
demo reports to, the daemon's log lines included) and the incident report at the end::

    result = run_demo(DemoView(console), keep=False)
    render_demo_report(result, console)
"""

from __future__ import annotations

import logging
import time

from rich.console import Console

from mlxwatch.demo import DemoResult
from mlxwatch.output.text import lines_of

LEVEL_STYLES = {"WARNING": "yellow", "ERROR": "red", "CRITICAL": "bold red"}


class _LogLines(logging.Handler):
    """The daemon's log lines as ``HH:MM:SS LEVEL message``, reflowed (``lines_of``): a path is
    never broken. rich's log handler folded a long word at its column's edge, so a bundle's path
    was split in the middle of its name (found by a new user)."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname:<7} " \
                   f"{record.getMessage()}"
            lines_of(self.console, text, "  ", LEVEL_STYLES.get(record.levelname))
        except Exception:  # a log line must never stop the demo
            self.handleError(record)


class DemoView:
    """What the demo says while it runs, each step one line on ``console``."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def log_handler(self) -> logging.Handler:
        """The daemon's own log lines, shown between the demo's."""
        return _LogLines(self.console)

    def starting(self, mlx_lm_version: str) -> None:
        self.console.rule("mlxwatch demo")
        self.console.print(f"Making a tiny random model and starting a real mlx_lm.server "
                           f"(mlx-lm {mlx_lm_version}) on 127.0.0.1 ...")

    def server_started(self, pid: int, url: str, log: object) -> None:
        self.console.print(f"Server PID {pid} at {url}, log {log}")

    def never_healthy(self) -> None:
        self.console.print("[red]the server never looked healthy; see its log[/]")

    def fault_on(self) -> None:
        self.console.print("[green]Healthy:[/] probes get tokens. Now switching on a livelock: the batch loop "
                           "keeps stepping and burning CPU, but no token reaches any client; /v1/models stays 200.")

    def recovered(self, seconds: float) -> None:
        self.console.print(f"[green]Recovered[/] {seconds:.1f}s after the livelock was switched on.")

    def not_recovered(self) -> None:
        self.console.print("[red]no recovery within the demo's time limit[/]")


def render_demo_report(result: DemoResult, console: Console) -> None:
    """What happened, and what is left on disk (``result.kept``: the server dir, with ``--keep``)."""
    state_dir, kept = result.state_dir, result.kept
    if not result.records:
        console.print(f"Kept {state_dir} (journal and state); the server was stopped"
                      + (f", its log and the model are kept in {kept}." if kept else " and the model removed."),
                      markup=False, highlight=False)
        return
    last = result.records[-1]
    console.rule("incident")
    first = last.get("first_failure_at") or 0
    for r in result.records:
        at = f"+{r['ts'] - first:5.1f}s" if first else ""
        console.print(f"{at:>8}  {r['event']}", markup=False)
    console.print(f"classification: [bold]{last.get('kind')}[/] ({last.get('confidence')} confidence)")
    console.print(f"bundle:         {last.get('bundle')}", markup=False, highlight=False)
    if result.summary_head is not None:
        console.print(result.summary_head, markup=False)
    if last.get("seconds_to_recovery") is not None:
        console.print(f"recovered {last['seconds_to_recovery']:.1f}s after the first failed probe")
    console.print(f"journal:        {result.journal}", markup=False, highlight=False)
    if kept:
        console.print(f"Kept {state_dir} (bundle and journal) for you to read; the server was stopped, its log "
                      f"and the model are kept in {kept}.", markup=False, highlight=False)
    else:
        console.print(f"Kept {state_dir} (bundle and journal) for you to read; the server was stopped and the "
                      "model removed.", markup=False, highlight=False)
