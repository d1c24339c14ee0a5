"""``mlxwatch capture``: a live row per step while it runs, then what the capture found::

    with CaptureProgress(console) as progress:
        bundle = asyncio.run(capture_bundle(request, on_step=progress.update))
        progress.finish(bundle.manifest.get("steps") or [])
    render_capture(bundle.classification, bundle.path, archive, console)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mlxwatch.capture.classify import Classification
from mlxwatch.capture.target import CaptureTarget
from mlxwatch.output.text import Row, bullets, print_rows, say


def render_capture(classification: Classification, path: Path, archive: Path | None, console: Console) -> None:
    """What a capture found: the kind first, its evidence, then where the bundle is."""
    c = classification
    say(console, Text.assemble((c.kind, "bold"), f" ({c.confidence} confidence)"))
    bullets(console, "-", list(c.evidence))
    bullets(console, "?", list(c.competing))
    say(console, str(path))
    if archive is not None:
        say(console, f"archive: {archive}")


class CaptureProgress:
    """A live table with one row per capture step: running, then its outcome.

    ``finish(steps)`` replaces the bare outcomes with what each step found (the manifest's
    steps): a probe that ran but got no token is "no token: <reason>", not "ok"."""

    STYLES = {"ok": "green", "failed": "red", "skipped": "yellow", "start": "cyan"}

    def __init__(self, console: Console) -> None:
        self.console = console
        self.states: dict[str, str] = {}
        self.labels: dict[str, tuple[str, str]] = {}  # final (text, style) per step, from finish()
        self.live = Live(self._table(), console=console, transient=True, auto_refresh=False)

    def _rows(self) -> list[Row]:
        rows: list[Row] = []
        for name, state in self.states.items():
            text, style = self.labels.get(name) or ("running" if state == "start" else state,
                                                    self.STYLES.get(state, "red"))
            rows.append((name, Text(text, style=style)))
        return rows

    def _name_width(self) -> int:
        return max((len(n) for n in self.states), default=1)

    def _table(self) -> Table:
        """While it runs: one line per step (a long outcome ends in "…" until the final rows)."""
        table = Table(show_header=False, box=None, padding=(0, 1))
        table.add_column(no_wrap=True, min_width=self._name_width())
        table.add_column(no_wrap=True, overflow="ellipsis")
        for name, text in self._rows():
            table.add_row(name, text)
        return table

    def update(self, name: str, state: str) -> None:
        self.states[name] = state
        self.live.update(self._table(), refresh=True)

    def finish(self, steps: list[dict]) -> None:
        for step in steps:
            name, outcome, error = step.get("name"), step.get("outcome") or "?", step.get("error")
            error = " ".join(error.split()) if isinstance(error, str) else error  # an HTML body: one row
            if name is None:
                continue
            self.states.setdefault(name, outcome)
            if name == "probe" and outcome == "ok" and error:
                self.labels[name] = (f"no token: {error.removeprefix('probe: ')}", "yellow")
            elif name == "probe" and outcome == "ok":
                self.labels[name] = ("tokens delivered", "green")
            elif outcome != "ok" and error:
                self.labels[name] = (f"{outcome}: {error}", self.STYLES.get(outcome, "red"))
            elif outcome == "ok" and error:  # done, with something worth knowing (a failed snapshot)
                self.labels[name] = (f"ok, but: {error}", "yellow")

    def __enter__(self) -> "CaptureProgress":
        self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.live.__exit__(*exc)
        if exc[0] is None:  # the final states stay on screen (whole lines when piped)
            print_rows(self.console, self._rows(), indent=1, label_width=self._name_width(), gap=2)


def render_target_notes(err: Console, target: CaptureTarget, config_path: Path | None) -> None:
    """How the capture's target was learnt, one ``mlxwatch: capture`` line each (on stderr)."""
    if target.matched:
        err.print(f"mlxwatch: capture: PID {target.pid} is {target.matched} of {config_path}: its settings used",
                  markup=False)
    if target.problem:
        err.print(f"mlxwatch: capture --force: {target.problem}; capturing it anyway", markup=False)
    if target.listens_at:
        err.print(f"mlxwatch: capture: probing {target.url}, where PID {target.pid} listens", markup=False)


def render_stacks_hint(err: Console, hint: str) -> None:
    """py-spy was refused the server: what to do (on stderr, after the result)."""
    err.print(f"mlxwatch: capture: no Python stacks: {hint}", markup=False)
