"""Line and table helpers every renderer shares.

On a terminal every line fits the console's width: long values wrap (a reason or a path is
never cut, only folded); piped (``| grep``, a log file) every line stays whole::

    say(console, "one logical line")
    print_rows(console, [("label", "value")], indent=2, label_width=10, gap=4)
"""

from __future__ import annotations

import re
import textwrap

from rich.console import Console
from rich.table import Table
from rich.text import Text

from mlxwatch.durations import format_duration

PIPED_WIDTH = 10**6  # no line is cut or wrapped when the reader is not a terminal
NARROW = 80  # what `reflow` keeps piped lines to: a log, a mail, an issue are read at 80 columns

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


_CLAUSE = re.compile(r".+?(?:[,;:] |$)")  # each clause keeps its separator


def reflow(text: str, width: int, hang: str | None = None) -> list[str]:
    """One logical line as lines of at most ``width`` characters, broken after a ``,``, ``;``
    or ``:`` where it can (a count stays beside what it counts; a line not yet 60% full goes
    on word by word rather than end short), else between words; every line
    after the first starts with ``hang`` (default: the first line's indent and two spaces). A
    word too long to follow ``hang`` (a path, a URL) is never broken or cut: it stands flush
    left on a line of its own, and overflows whole only if longer than a line."""
    if len(text) <= width:
        return [text]
    indent = text[: len(text) - len(text.lstrip(" "))]
    hang = indent + "  " if hang is None else hang
    out: list[str] = []
    current = indent

    def fits(line: str) -> bool:
        return len(line.rstrip()) <= width

    for clause in _CLAUSE.findall(text[len(indent):]):
        if fits(current + clause):
            current += clause
            continue
        full = len(current.rstrip()) > 0.6 * width  # a short line goes on to its words instead
        if current.strip() and ((full and fits(hang + clause)) or not fits(current + clause.split(" ", 1)[0])):
            out.append(current.rstrip())  # the clause starts a line of its own
            current = hang
            if fits(current + clause):
                current += clause
                continue
        # longer than a line: broken between its words, going on from where the line is
        pieces = textwrap.wrap(clause, width, initial_indent=current, subsequent_indent=hang,
                               break_long_words=False, break_on_hyphens=False) or [current]
        out.extend(pieces[:-1])
        current = pieces[-1] + (" " if clause.endswith(" ") else "")
    out.append(current.rstrip())
    return [piece for line in out for piece in _flush_left(line, width, hang)]


def _flush_left(line: str, width: int, hang: str) -> list[str]:
    """A line over ``width`` because of a word too long to follow ``hang`` (a path): that word
    on a line of its own, flush left, where it fits in 80 columns or overflows least (a 72-column
    path under doctor's 19-column hang made lines of 91 to 111 columns); the rest reflowed after it."""
    if len(line) <= width:
        return [line]
    long = next((m for m in re.finditer(r"\S+", line) if len(hang) + len(m.group()) > width), None)
    if long is None:
        return [line]
    before, after = line[: long.start()].rstrip(), line[long.end():].strip()
    return ([before] if before.strip() else []) + [long.group()] + (reflow(hang + after, width, hang) if after else [])


def reflow_width(console: Console) -> int:
    """The width ``reflow`` keeps to: the terminal's, or 80 columns when piped."""
    return console.width if console.is_terminal else NARROW


def lines_of(console: Console, text: str, hang: str | None = None, style: str | None = None) -> None:
    """One logical line printed reflowed (``reflow``) to the terminal, or to 80 columns piped."""
    for line in reflow(text, reflow_width(console), hang):
        console.print(line, markup=False, highlight=False, style=style, soft_wrap=True)
