"""``mlxwatch status``: the collected status (``daemon.status.collect_status``) for a person.

Fits the terminal, and 80 columns when piped: a long line is reflowed onto indented lines
(``output.text.reflow``), never cut, so no count is lost; only a table cell (a long instance
name) ends in an ellipsis::

    render_status(collect_status(config, state_dir), console)
    lines = status_lines(status, width=80)      # one Text per line, for a live display
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from mlxwatch.daemon.memwatch import describe as describe_memory
from mlxwatch.durations import format_duration
from mlxwatch.front.delivery import OUTCOMES
from mlxwatch.output.text import NARROW, cut, fit, reflow

HUNG_STATES = ("hung", "capturing", "restarting", "recovering", "gave_up")
STATE_STYLES = {"healthy": "green", "starting": "cyan", "suspect": "yellow", "slow": "yellow", "never probed": "yellow"}


def state_label(instance: dict[str, Any]) -> str:
    """The state as a person reads it: a hung server whose capture found no process is down
    (crashed), not "hung"; a known kind is named next to the state."""
    state = instance["state"]
    kind = (instance.get("open_incident") or {}).get("kind")
    cause = (instance.get("open_incident") or {}).get("cause")
    kind = f"{kind}: {cause}" if kind and cause else kind
    if state == "hung" and kind and kind.startswith("crashed"):
        return f"down ({kind})"
    if state in HUNG_STATES and kind and kind.startswith("port_taken"):  # another program answers: not a crash, not a hang
        return "down (port taken)"
    if state in HUNG_STATES and kind:
        return f"{state} ({kind})"
    return state


def shim_line(summary: dict[str, Any]) -> str:
    """One line from the launch shim's ``Heartbeat.summary()``: tokens/s and time since the last token."""
    if summary.get("thread") == "died":
        return f"shim: generation thread died ({summary.get('exception') or 'no exception recorded'})"
    if summary.get("stale"):
        return f"shim: no heartbeat for {summary.get('age')}s (GIL held, or process stopped)"
    if summary.get("seam") != "ok":
        return f"shim: heartbeat unavailable ({summary.get('seam')}); stacks on demand only"
    rate = summary.get("tokens_per_s")
    since = summary.get("since_last_token")
    parts = [f"{rate:.1f} tok/s" if isinstance(rate, (int, float)) else "tok/s unknown",
             f"last token {since:.0f}s ago" if isinstance(since, (int, float)) else "no token yet",
             f"{summary.get('in_flight', 0)} in flight"]
    if summary.get("stalled_for"):
        parts.append(f"no progress for {summary['stalled_for']:.0f}s")
    return "shim: " + ", ".join(parts)


def kernel_line(kernel: dict[str, Any]) -> str:
    """One line from the status's ``kernel``: what kernel sight saw the server send its clients."""
    parts = [f"{kernel.get('streams') or 0} client stream(s)", f"{kernel.get('waiting') or 0} request(s) waiting"]
    if kernel.get("slow_readers"):
        parts.append(f"{kernel['slow_readers']} client(s) reading slowly")
    flow = kernel.get("last_flow_at")
    parts.append(f"last byte to a client {_ago(flow)}" if flow else "no byte to a client seen yet")
    return "kernel sight: " + ", ".join(parts)


def front_line(front: dict[str, Any]) -> str:
    """One line from the status's ``front``: where the door listens, its gate, its requests."""
    if front.get("error"):
        return f"front door: not serving: {front['error']}"
    gate = front.get("gate") or "open"
    parts = ["open" if gate == "open" else f"{gate}: new requests wait or get 503",
             f"{front.get('in_flight', 0)} in flight"]
    if front.get("last_token_at"):
        parts.append(f"last token {_ago(front['last_token_at'])}")
    outcomes = front.get("outcomes") or {}
    order = {k: n for n, k in enumerate(OUTCOMES)}  # the door's order (the state file sorts keys)
    done = [f"{n} {k.replace('_', ' ')}" for k, n in sorted(outcomes.items(), key=lambda kv: order.get(kv[0], 99)) if n]
    parts.append(", ".join(done) if done else "no request yet")
    return f"front door {front.get('listen') or ''}: " + ", ".join(parts)


def group_lines(group: dict[str, Any]) -> list[Text]:
    """An ``mlx.launch`` group (``collect_status``'s ``group``): one line for the group, one per
    rank (number, host, PID, state), one per host that could not be asked."""
    launcher = f", launcher PID {group['launcher_pid']}" if group.get("launcher_pid") else ""
    backend = f" ({group['backend']})" if group.get("backend") else ""
    lines = [Text(f"  mlx.launch group of {group['size']} ranks{backend}{launcher}")]
    for r in group["ranks"]:
        pid = f"PID {r['pid']}" if r.get("pid") else "no PID"
        lines.append(Text(f"    rank {r['rank']}  {r['host']}  {pid}  {r['state']}",
                          style="" if r["state"] == "running" else "red"))
    if group.get("orphaned"):  # "launcher PID N is gone; 2 ranks orphaned"
        lines.append(Text(f"    {group['orphaned']}", style="red"))
    for error in group.get("errors") or []:
        lines.append(Text(f"    not asked: {error}", style="yellow"))
    return lines


def status_lines(status: dict[str, Any], width: int = 80) -> list[Text]:
    """The human status, one ``Text`` per line, each at most ``width`` characters (a word
    longer than that, such as a path, stays whole)."""
    lines: list[Text] = []
    d = status["daemon"]
    where = f"state in {status['state_dir']}"
    if d["running"] and d.get("stalled"):
        lines.append(Text(f"daemon running (PID {d['pid']}) but stalled: no heartbeat for "
                          f"{_ago(d.get('last_tick'))}; {where}", style="red"))
    elif d["running"]:
        errors = f", {d['watcher_errors']} watcher error(s)" if d.get("watcher_errors") else ""
        lines.append(Text(f"daemon running (PID {d['pid']}{errors}), {where}"))
    elif d.get("updated_at"):
        lines.append(Text(f"daemon not running (last update {_ago(_number(d['updated_at']))}): "
                          "start it with `mlxwatch run`", style="yellow"))
        lines.append(Text(f"  {where}"))
    else:
        lines.append(Text("daemon not running (none has left a record): start it with `mlxwatch run`",
                          style="yellow"))
        lines.append(Text(f"  {where}"))
    instances = status["instances"]
    if not instances:
        if status.get("config"):
            lines.append(Text(f"no instances in {status['config']}: add one (see `mlxwatch config example`)"))
        else:
            lines.append(Text("no config, so nothing is watched: write one with `mlxwatch config init` "
                              "(finds running mlx-lm servers) or see `mlxwatch config example`"))
        if status.get("state_problem"):  # said with no instance too (it was left out)
            lines.append(Text(f"state file {status['state_problem']}; the daemon rebuilds it from the journal",
                              style="yellow"))
        return _reflowed(lines, width)
    header = ("INSTANCE", "STATE", "LAST PROBE", "TTFT", "RESTARTS")
    rows = []
    for i in instances:
        p = i["last_probe"]
        probe = "-" if not p else ("ok" if p["ok"] else "failed") + (f" {_ago(p['at'])}" if p["at"] else "")
        ttft = format_duration(p["ttft"]) if p and p["ttft"] is not None else "-"
        restarts = str(i["restarts_in_window"]) + (f" of {i['budget']}" if i.get("budget") else "")
        rows.append((i["name"], state_label(i), probe, ttft, restarts))
    # caps that sum, with the gaps, to 80: a row is never reflowed (only a cell is cut)
    widths = [min(max(len(r[c]) for r in [header, *rows]), cap) for c, cap in enumerate((20, 22, 16, 6, 8))]
    lines.append(_Row(_row(header, widths), style="bold"))
    for i, row in zip(instances, rows, strict=True):
        lines.append(_Row(_row(row, widths), style=STATE_STYLES.get(i["state"], "red")))
        p = i["last_probe"]
        if p and not p["ok"] and p.get("reason"):
            lines.append(Text(f"  last probe: {p['reason']}"))
        if i.get("memory"):
            lines.append(Text(f"  {describe_memory(i['memory'])}",
                              style="red" if i["memory"].get("minutes_left") is not None else ""))
        if i.get("kernel_sight") not in (None, "ok"):
            lines.append(Text(f"  no kernel sight ({i['kernel_sight']}): the probe alone judges"))
        elif i.get("kernel"):
            lines.append(Text(f"  {kernel_line(i['kernel'])}"))
        if i.get("pace"):
            lines.append(Text(f"  {pace_line(i['pace'])}", style="red" if i["pace"].get("overdue") else ""))
        if i.get("group"):
            lines += group_lines(i["group"])
        if i.get("shim"):
            lines.append(Text(f"  {shim_line(i['shim'])}"))
        if i.get("front"):
            lines.append(Text(f"  {front_line(i['front'])}", style="red" if i["front"].get("error") else ""))
        o, inc = i["open_incident"], i["last_incident"]
        if o:
            if d["running"]:
                lines.append(Text(f"  {i['name']}: incident {o['id']} in progress: {o['stopped_at_event']}", style="red"))
            else:
                lines.append(Text(f"  {i['name']}: incident {o['id']} open: daemon stopped at {o['stopped_at_event']} "
                                  "(the daemon will close it when it starts)", style="red"))
            if o.get("cause_summary"):
                lines.append(Text(f"  why it died: {o['cause_summary']}", style="red"))
        elif inc:
            how = inc.get("event")
            took = inc.get("seconds_to_recovery")
            took_text = f" after {format_duration(took)}" if isinstance(took, (int, float)) else ""
            lines.append(Text(f"  last incident {_ago(_number(inc.get('detected_at')))}: {inc.get('kind') or 'kind unknown'}"
                              f"{' (' + str(inc['cause']) + ')' if inc.get('cause') else ''}, {how}{took_text}"))
        if i["state"] == "gave_up":
            lines.append(Text(f"  gave up restarting: `mlxwatch resume {i['name']}` allows restarts again", style="red"))
        if not i.get("configured", True):
            lines.append(Text("  (in the state file, not in the config)"))
    if status.get("state_problem"):
        lines.append(Text(f"state file {status['state_problem']}; the daemon rebuilds it from the journal", style="yellow"))
    return _reflowed(lines, width)


class _Row(Text):
    """A table row: fitted to the width as a whole (rows are 80 columns at most), never reflowed."""


def _reflowed(lines: list[Text], width: int) -> list[Text]:
    """Each line in lines of at most ``width``: a long one reflowed (never cut: a reason cut
    short, or a count, is lost to its reader); a table row fitted."""
    out: list[Text] = []
    for line in lines:
        if isinstance(line, _Row):
            out.append(fit(line, width))
        else:
            out.extend(Text(piece, style=line.style) for piece in reflow(line.plain, width))
    return out


def render_status(status: dict[str, Any], console: Console, fit: bool | None = None) -> None:
    """Print the status; on a terminal (or with ``fit``) each line fits the console's width,
    piped each fits 80 columns: long lines are reflowed, never cut."""
    fit = console.is_terminal if fit is None else fit
    for line in status_lines(status, console.width if fit else NARROW):
        console.print(line, soft_wrap=True)


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(cut(c, w).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _ago(ts: float | None) -> str:
    if not ts:
        return ""
    return f"{format_duration(max(0.0, time.time() - ts))} ago"


class StatusWatch:
    """``status --watch``: on a terminal one screen redrawn in place under an ``every …, at …``
    line; piped, each update whole under a ``--- date time`` line (a log keeps them all)."""

    def __init__(self, console: Console, interval: float) -> None:
        self.console, self.interval, self.shown = console, interval, 0
        self.live: Live | None = None

    def __enter__(self) -> "StatusWatch":
        if self.console.is_terminal:
            self.live = Live(console=self.console, auto_refresh=False, transient=False)
            self.live.start()
        return self

    def show(self, status: dict[str, Any]) -> None:
        self.shown += 1
        if self.live is not None:
            stamp = time.strftime("%H:%M:%S")
            head = Text(f"every {format_duration(self.interval)}, at {stamp} (Ctrl-C stops)")
            self.live.update(Group(head, *status_lines(status, self.console.width)), refresh=True)
            return
        if self.shown > 1:
            self.console.print()
        self.console.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}", markup=False, highlight=False)
        render_status(status, self.console)
        self.console.file.flush()

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()


def pace_line(pace: dict) -> str:
    """What the server owes and by when: "waiting for: reading a 3,618-token prompt (~25 s a
    chunk, learned from its chunks); next sign due by 23:04:10"."""
    if pace.get("overdue"):
        return f"overdue: {pace['overdue']}"
    due = pace.get("due")
    when = f"; next sign due by {time.strftime('%H:%M:%S', time.localtime(due))}" if due else ""
    return f"waiting for: {pace.get('owes')} ({pace.get('basis')}){when}"
