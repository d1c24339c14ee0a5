"""Line and table helpers every renderer shares.

On a terminal every line fits the console's width: long values wrap (a reason or a path is
never cut, only folded); piped (``| grep``, a log file) every line stays whole::

    say(console, "one logical line")
    print_rows(console, [("label", "value")], indent=2, label_width=10, gap=4)
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mlxwatch.durations import format_duration

PIPED_WIDTH = 10**6  # no line is cut or wrapped when the reader is not a terminal

Row = tuple[str, "str | Text"]


def secs(value: float | None) -> str:
    return "-" if value is None else format_duration(value)


def say(console: Console, text: str | Text) -> None:
    """One logical line: wrapped at a terminal's width, whole when piped. A ``str`` is plain text."""
    line = Text(text) if isinstance(text, str) else text
    console.print(line, soft_wrap=not console.is_terminal)


def plain(console: Console, text: str, style: str | None = None) -> None:
    """One line printed as it is: no markup, no highlighting (the CLI's console keeps it whole)."""
    console.print(text, markup=False, highlight=False, style=style)


def _grid(rows: list[Row], indent: int, label_width: int, gap: int) -> Table:
    """Labels in a fixed column; on a terminal a long value wraps (folds) inside its own column."""
    grid = Table.grid()
    grid.add_column(no_wrap=True, width=indent + label_width + gap)
    grid.add_column(overflow="fold")
    for label, value in rows:
        grid.add_row(" " * indent + label, value)
    return grid


def print_rows(console: Console, rows: list[Row], indent: int, label_width: int, gap: int) -> None:
    """``label  value`` lines: a wrapping grid on a terminal, whole lines when piped (rich never
    renders wider than its console, so piped lines are put together here)."""
    if console.is_terminal:
        console.print(_grid(rows, indent, label_width, gap), soft_wrap=False)
        return
    for label, value in rows:
        say(console, Text.assemble(" " * indent + label.ljust(label_width) + " " * gap, value))


def bullets(console: Console, mark: str, lines: list[str]) -> None:
    """``  - line`` items; on a terminal a long one wraps under its own text, not under the mark."""
    print_rows(console, [(mark, line) for line in lines], indent=2, label_width=1, gap=1)


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters; a cut one ends in an ellipsis."""
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def fit(line: Text, width: int) -> Text:
    """A styled line in at most ``width`` characters; a cut one ends in an ellipsis."""
    if len(line.plain) <= width:
        return line
    out = line[: max(0, width - 1)]
    out.append("…")
    return out
