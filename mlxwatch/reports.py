"""Rendering results for people (rich). The JSON forms live on the results themselves."""

from __future__ import annotations

from datetime import datetime

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mlxwatch.durations import format_duration
from mlxwatch.probes import CheckReport


def _secs(value: float | None) -> str:
    return "-" if value is None else format_duration(value)


def render_check(report: CheckReport, console: Console, waited: tuple[float, int] | None = None) -> None:
    """A short summary: verdict first, then the numbers a person would ask for.

    ``waited``: (seconds, probes) when ``check --wait`` probed more than once."""
    gen = report.generation
    if report.healthy:
        console.print(f"[bold green]healthy[/] {report.url}: {gen.tokens} tokens, first after {_secs(gen.ttft)}")
    else:
        console.print(f"[bold red]unhealthy[/] {report.url}: {report.reason}", highlight=False)
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(no_wrap=True, min_width=10)  # the labels never shrink; the values end in "…"
    table.add_column(no_wrap=True, overflow="ellipsis")
    if waited is not None:
        seconds, probes = waited
        table.add_row("waited", f"{format_duration(seconds)}, {probes} probe{'s' if probes != 1 else ''}")
    table.add_row("generation", f"HTTP {gen.status if gen.status is not None else '-'}, "
                  f"{gen.tokens} tokens, finish {gen.finish_reason or '-'}")
    table.add_row("timings", f"headers {_secs(gen.connect)}, first token {_secs(gen.ttft)}, "
                  f"max gap {_secs(gen.max_gap)}, total {_secs(gen.total)}")
    if gen.keepalives:
        last = gen.keepalives[-1]
        table.add_row("prompt", f"{len(gen.keepalives)} keepalives, last {last.processed}/{last.total}")
    table.add_row("/health", report.health.summary)
    table.add_row("/v1/models", report.models.summary)
    console.print(table)


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

    def _table(self) -> Table:
        table = Table(show_header=False, box=None, padding=(0, 1))
        table.add_column(no_wrap=True, min_width=max((len(n) for n in self.states), default=1))
        table.add_column(no_wrap=True, overflow="ellipsis")
        for name, state in self.states.items():
            text, style = self.labels.get(name) or ("running" if state == "start" else state,
                                                    self.STYLES.get(state, "red"))
            table.add_row(name, Text(text, style=style))
        return table

    def update(self, name: str, state: str) -> None:
        self.states[name] = state
        self.live.update(self._table(), refresh=True)

    def finish(self, steps: list[dict]) -> None:
        for step in steps:
            name, outcome, error = step.get("name"), step.get("outcome") or "?", step.get("error")
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
        if exc[0] is None:
            self.console.print(self._table())  # the final states stay on screen


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

    Names are relative to ``root`` (printed first); ``bundle show NAME`` takes them as they are."""
    if not entries:
        console.print(f"no bundles in {root}", markup=False, highlight=False)
        return
    console.print(f"{len(entries)} bundle{'s' if len(entries) != 1 else ''} in {root}, newest first:",
                  markup=False, highlight=False)
    rows = []
    for e in entries:
        when = datetime.fromtimestamp(e["ts"]).strftime("%Y-%m-%d %H:%M")
        kind = e.get("kind") or ("(incomplete)" if e.get("state") == "incomplete" else
                                 "(unreadable)" if e.get("state") == "unreadable" else "-")
        rows.append((when, e.get("instance") or "-", kind, e.get("confidence") or "-", _size(e.get("size")), e["name"]))
    widths = [max(len(r[i]) for r in rows + [HEADER]) for i in range(5)]
    for row in [HEADER, *rows]:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1]), row[2].ljust(widths[2]),
                 row[3].ljust(widths[3]), row[4].rjust(widths[4]), row[5]]
        console.print("  ".join(cells), markup=False, highlight=False, style="bold" if row is HEADER else None)


HEADER = ("time", "instance", "kind", "conf.", "size", "bundle")
