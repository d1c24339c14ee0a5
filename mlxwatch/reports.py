"""Rendering results for people (rich). The JSON forms live on the results themselves."""

from __future__ import annotations

from rich.console import Console
from rich.live import Live
from rich.table import Table

from mlxwatch.durations import format_duration
from mlxwatch.probes import CheckReport


def _secs(value: float | None) -> str:
    return "-" if value is None else format_duration(value)


def render_check(report: CheckReport, console: Console) -> None:
    """A short summary: verdict first, then the numbers a person would ask for."""
    gen = report.generation
    if report.healthy:
        console.print(f"[bold green]healthy[/] {report.url}: {gen.tokens} tokens, first after {_secs(gen.ttft)}")
    else:
        console.print(f"[bold red]unhealthy[/] {report.url}: {report.reason}")
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True, overflow="ellipsis")
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
    """A live table with one row per capture step: running, then its outcome."""

    STYLES = {"ok": "green", "failed": "red", "skipped": "yellow", "start": "cyan"}

    def __init__(self, console: Console) -> None:
        self.console = console
        self.states: dict[str, str] = {}
        self.live = Live(self._table(), console=console, transient=True, auto_refresh=False)

    def _table(self) -> Table:
        table = Table(show_header=False, box=None, padding=(0, 1))
        for name, state in self.states.items():
            label = "running" if state == "start" else state
            table.add_row(name, f"[{self.STYLES.get(state, 'red')}]{label}[/]")
        return table

    def update(self, name: str, state: str) -> None:
        self.states[name] = state
        self.live.update(self._table(), refresh=True)

    def __enter__(self) -> "CaptureProgress":
        self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.live.__exit__(*exc)
        self.console.print(self._table())  # the final states stay on screen
