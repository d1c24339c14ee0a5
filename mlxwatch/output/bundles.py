"""``mlxwatch bundle list``: one line per bundle, newest first::

    render_bundle_list(str(root), bundle_entries(root), console)
"""

from __future__ import annotations

from datetime import datetime

from rich.console import Console
from rich.text import Text

from mlxwatch.output.text import PIPED_WIDTH, cut, say

HEADER = ("time", "instance", "kind", "conf.", "size", "bundle")


def size_text(n: float | None) -> str:
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
        rows.append((when, e.get("instance") or "-", kind, e.get("confidence") or "-", size_text(e.get("size")),
                     e["name"]))
    widths = [max(len(r[i]) for r in rows + [HEADER]) for i in range(5)]
    limit = console.width if console.is_terminal else PIPED_WIDTH
    one_line = sum(widths) + 2 * 5 + max(len(r[5]) for r in rows)
    name_below = one_line > limit
    if name_below:  # the instance column gives way first, down to its header's width
        widths[1] = max(len(HEADER[1]), widths[1] - max(0, sum(widths) + 2 * 4 - limit))
    for row in [HEADER, *rows]:
        cells = [cut(row[0], widths[0]).ljust(widths[0]), cut(row[1], widths[1]).ljust(widths[1]),
                 row[2].ljust(widths[2]), row[3].ljust(widths[3]), row[4].rjust(widths[4])]
        style = "bold" if row is HEADER else ""
        if name_below:
            say(console, Text("  ".join(cells).rstrip(), style=style))
            say(console, Text(f"  {row[5]}", style=style))
        else:
            say(console, Text("  ".join([*cells, row[5]]), style=style))



def render_skipped(err: Console, skipped: list[str]) -> None:
    """``bundle export``: files the manifest lists but the bundle lacks (on stderr)."""
    err.print(f"mlxwatch: bundle export: {len(skipped)} file(s) listed in the manifest are missing from "
              f"the bundle and were left out: {', '.join(skipped[:5])}", markup=False)


def render_redaction(err: Console, redacted: bool, request_bodies: bool = False) -> None:
    """``bundle export``: whether the archive may be shared (on stderr, after its path)."""
    if request_bodies:  # said first and plainly: the redaction below does not cover them
        err.print("mlxwatch: bundle export: the archive HOLDS USERS' WORDS: the recorded requests' bodies, "
                  "exact and not redacted (--with-request-bodies); share it only with whom may read them",
                  markup=False)
    err.print("mlxwatch: bundle export: " + (
        "redacted for sharing (secrets, environment values, prompts and message texts, home paths removed; "
        "--no-redact exports the bundle as captured)" if redacted else
        "NOT redacted (--no-redact): it holds what the capture read; keep it private"), markup=False)
