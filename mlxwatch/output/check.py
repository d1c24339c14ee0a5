"""``mlxwatch check``: the verdict first, then the numbers a person would ask for::

    render_check(report, console, waited=(12.0, 4))
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from mlxwatch.durations import format_duration
from mlxwatch.output.text import Row, print_rows, say, secs
from mlxwatch.probes import CheckReport


def render_check(report: CheckReport, console: Console, waited: tuple[float, int] | None = None) -> None:
    """A short summary: verdict first, then the numbers a person would ask for.

    ``waited``: (seconds, probes) when ``check --wait`` probed more than once."""
    gen = report.generation
    if report.healthy:
        headline = Text.assemble(("healthy", "bold green"), f" {report.url}: {gen.tokens} tokens, "
                                 f"first after {secs(gen.ttft)}")
    else:
        headline = Text.assemble(("unhealthy", "bold red"), f" {report.url}: {report.reason}")
    say(console, headline)
    rows: list[Row] = []
    if waited is not None:
        seconds, probes = waited
        rows.append(("waited", f"{format_duration(seconds)}, {probes} probe{'s' if probes != 1 else ''}"))
    rows.append(("generation", f"HTTP {gen.status if gen.status is not None else '-'}, "
                 f"{gen.tokens} tokens, finish {gen.finish_reason or '-'}"))
    rows.append(("timings", f"headers {secs(gen.connect)}, first token {secs(gen.ttft)}, "
                 f"max gap {secs(gen.max_gap)}, total {secs(gen.total)}"))
    if gen.keepalives:
        last = gen.keepalives[-1]
        rows.append(("prompt", f"{len(gen.keepalives)} keepalives, last {last.processed}/{last.total}"))
    rows.append(("/health", report.health.summary))
    rows.append(("/v1/models", report.models.summary))
    print_rows(console, rows, indent=2, label_width=10, gap=4)


def render_waiting(console: Console, url: str, waited: float, wait: float, reason: str) -> None:
    """``check --wait``: one line each time the reason a probe failed changes (on stderr)."""
    console.print(f"waiting for {url} ({format_duration(waited)} of {format_duration(wait)}): {reason}", markup=False)
