"""Rendering results for people (rich). The JSON forms live on the results themselves.

On a terminal every line fits the console's width: long values wrap (a reason or a path is
never cut, only folded); piped (``| grep``, a log file) every line stays whole, as ``status`` does.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mlxwatch.capture.classify import Classification
from mlxwatch.config import InstanceConfig
from mlxwatch.durations import format_duration, human_duration
from mlxwatch.host.process import ServerLookup
from mlxwatch.probes import CheckReport

PIPED_WIDTH = 10**6  # no line is cut or wrapped when the reader is not a terminal


def _secs(value: float | None) -> str:
    return "-" if value is None else format_duration(value)


def _width(console: Console) -> int | None:
    """The width to render at: the terminal's (None: the console's own), else unlimited."""
    return None if console.is_terminal else PIPED_WIDTH


def say(console: Console, text: str | Text) -> None:
    """One logical line: wrapped at a terminal's width, whole when piped. A ``str`` is plain text."""
    line = Text(text) if isinstance(text, str) else text
    console.print(line, soft_wrap=not console.is_terminal)


Row = tuple[str, "str | Text"]


def _grid(rows: list[Row], indent: int, label_width: int, gap: int) -> Table:
    """Labels in a fixed column; on a terminal a long value wraps (folds) inside its own column."""
    grid = Table.grid()
    grid.add_column(no_wrap=True, width=indent + label_width + gap)
    grid.add_column(overflow="fold")
    for label, value in rows:
        grid.add_row(" " * indent + label, value)
    return grid


def _print_rows(console: Console, rows: list[Row], indent: int, label_width: int, gap: int) -> None:
    """``label  value`` lines: a wrapping grid on a terminal, whole lines when piped (rich never
    renders wider than its console, so piped lines are put together here)."""
    if console.is_terminal:
        console.print(_grid(rows, indent, label_width, gap), soft_wrap=False)
        return
    for label, value in rows:
        say(console, Text.assemble(" " * indent + label.ljust(label_width) + " " * gap, value))


def _bullets(console: Console, mark: str, lines: list[str]) -> None:
    """``  - line`` items; on a terminal a long one wraps under its own text, not under the mark."""
    _print_rows(console, [(mark, line) for line in lines], indent=2, label_width=1, gap=1)


def render_check(report: CheckReport, console: Console, waited: tuple[float, int] | None = None) -> None:
    """A short summary: verdict first, then the numbers a person would ask for.

    ``waited``: (seconds, probes) when ``check --wait`` probed more than once."""
    gen = report.generation
    if report.healthy:
        headline = Text.assemble(("healthy", "bold green"), f" {report.url}: {gen.tokens} tokens, "
                                 f"first after {_secs(gen.ttft)}")
    else:
        headline = Text.assemble(("unhealthy", "bold red"), f" {report.url}: {report.reason}")
    say(console, headline)
    rows: list[Row] = []
    if waited is not None:
        seconds, probes = waited
        rows.append(("waited", f"{format_duration(seconds)}, {probes} probe{'s' if probes != 1 else ''}"))
    rows.append(("generation", f"HTTP {gen.status if gen.status is not None else '-'}, "
                 f"{gen.tokens} tokens, finish {gen.finish_reason or '-'}"))
    rows.append(("timings", f"headers {_secs(gen.connect)}, first token {_secs(gen.ttft)}, "
                 f"max gap {_secs(gen.max_gap)}, total {_secs(gen.total)}"))
    if gen.keepalives:
        last = gen.keepalives[-1]
        rows.append(("prompt", f"{len(gen.keepalives)} keepalives, last {last.processed}/{last.total}"))
    rows.append(("/health", report.health.summary))
    rows.append(("/v1/models", report.models.summary))
    _print_rows(console, rows, indent=2, label_width=10, gap=4)


def render_capture(classification: Classification, path: Path, archive: Path | None, console: Console) -> None:
    """What a capture found: the kind first, its evidence, then where the bundle is."""
    c = classification
    say(console, Text.assemble((c.kind, "bold"), f" ({c.confidence} confidence)"))
    _bullets(console, "-", list(c.evidence))
    _bullets(console, "?", list(c.competing))
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

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)
        if exc[0] is None:  # the final states stay on screen (whole lines when piped)
            _print_rows(self.console, self._rows(), indent=1, label_width=self._name_width(), gap=2)


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def render_bundle_list(root: str, entries: list[dict], console: Console) -> None:
    """One line per bundle, newest first: time, instance, kind, confidence, size, name.

    Names are relative to ``root`` (printed first); ``bundle show NAME`` takes them as they are,
    so a name is never cut: on a terminal too narrow for the row, it goes on a line of its own
    below the row, and a long instance name is cut instead (the bundle's name starts with it)."""
    if not entries:
        say(console, f"no bundles in {root}")
        return
    say(console, f"{len(entries)} bundle{'s' if len(entries) != 1 else ''} in {root}, newest first:")
    rows = []
    for e in entries:
        when = datetime.fromtimestamp(e["ts"]).strftime("%Y-%m-%d %H:%M")
        kind = e.get("kind") or ("(incomplete)" if e.get("state") == "incomplete" else
                                 "(unreadable)" if e.get("state") == "unreadable" else "-")
        rows.append((when, e.get("instance") or "-", kind, e.get("confidence") or "-", _size(e.get("size")), e["name"]))
    widths = [max(len(r[i]) for r in rows + [HEADER]) for i in range(5)]
    limit = console.width if console.is_terminal else PIPED_WIDTH
    one_line = sum(widths) + 2 * 5 + max(len(r[5]) for r in rows)
    name_below = one_line > limit
    if name_below:  # the instance column gives way first, down to its header's width
        widths[1] = max(len(HEADER[1]), widths[1] - max(0, sum(widths) + 2 * 4 - limit))
    for row in [HEADER, *rows]:
        cells = [_cut(row[0], widths[0]).ljust(widths[0]), _cut(row[1], widths[1]).ljust(widths[1]),
                 row[2].ljust(widths[2]), row[3].ljust(widths[3]), row[4].rjust(widths[4])]
        style = "bold" if row is HEADER else ""
        if name_below:
            say(console, Text("  ".join(cells).rstrip(), style=style))
            say(console, Text(f"  {row[5]}", style=style))
        else:
            say(console, Text("  ".join([*cells, row[5]]), style=style))


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


HEADER = ("time", "instance", "kind", "conf.", "size", "bundle")


FIRST_PROBE_SPREAD = 5.0  # the watcher starts each instance's first probe within min(interval, this)


def watch_plan(instances: list[InstanceConfig], lookup: Callable[[InstanceConfig], ServerLookup],
               now: float) -> list[str]:
    """What ``run`` says as it starts, per instance: what it watches, when the first probe
    comes and how long one may wait; and, for a server process younger than startup_timeout
    (a model still loading), the wall time before which no verdict is drawn. Without it a first
    run on a loading server said nothing for minutes."""
    lines = []
    for inst in instances:
        p = inst.probe
        log = f", log {inst.log}" if inst.log else ""
        lines.append(f"{inst.name}: watching {inst.url}{log}: first probe within "
                     f"{human_duration(min(p.interval, FIRST_PROBE_SPREAD))}, then every {human_duration(p.interval)} "
                     f"(first token within {human_duration(p.first_token_timeout)}); "
                     f"{p.failures} failed probes in a row make a verdict")
        found = lookup(inst)
        proc = found.identity or found.loading
        if proc is None:
            lines.append(f"{inst.name}: no server process found ({found.detail}): a failed probe counts at once")
            continue
        up = max(0.0, now - proc.create_time)
        if up < p.startup_timeout:
            until = datetime.fromtimestamp(proc.create_time + p.startup_timeout).strftime("%H:%M:%S")
            lines.append(f"{inst.name}: server PID {proc.pid} started {format_duration(up)} ago: no verdict before "
                         f"{until} (startup_timeout {human_duration(p.startup_timeout)}) unless it answers first")
    return lines
