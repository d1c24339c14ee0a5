"""``mlxwatch status``: the collected status (``daemon.status.collect_status``) for a person.

Fits 80 columns on a terminal; long texts end in an ellipsis, never cut mid-word unmarked.
Piped output keeps whole lines::

    render_status(collect_status(config, state_dir), console)
    lines = status_lines(status, width=80)      # one Text per line, for a live display
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from mlxwatch.durations import format_duration
from mlxwatch.front.delivery import OUTCOMES
from mlxwatch.output.text import PIPED_WIDTH, cut, fit

HUNG_STATES = ("hung", "capturing", "restarting", "recovering", "gave_up")
STATE_STYLES = {"healthy": "green", "starting": "cyan", "suspect": "yellow", "slow": "yellow", "never probed": "yellow"}


def state_label(instance: dict[str, Any]) -> str:
    """The state as a person reads it: a hung server whose capture found no process is down
    (crashed), not "hung"; a known kind is named next to the state."""
    state = instance["state"]
    kind = (instance.get("open_incident") or {}).get("kind")
    if state == "hung" and kind == "crashed":
        return "down (crashed)"
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
    for error in group.get("errors") or []:
        lines.append(Text(f"    not asked: {error}", style="yellow"))
    return lines


def status_lines(status: dict[str, Any], width: int = 80) -> list[Text]:
    """The human status, one ``Text`` per line, each at most ``width`` characters."""
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
        lines.append(Text(f"daemon not running (last update {_ago(_number(d['updated_at']))}); {where}; "
                          "start it with `mlxwatch run`", style="yellow"))
    else:
        lines.append(Text(f"daemon not running (none has left a record in {status['state_dir']}); "
                          "start it with `mlxwatch run`", style="yellow"))
    instances = status["instances"]
    if not instances:
        if status.get("config"):
            lines.append(Text(f"no instances in {status['config']}: add one (see `mlxwatch config example`)"))
        else:
            lines.append(Text("no config, so nothing is watched: write one with `mlxwatch config init` "
                              "(finds running mlx-lm servers) or see `mlxwatch config example`"))
        return [fit(line, width) for line in lines]
    header = ("INSTANCE", "STATE", "LAST PROBE", "TTFT", "RESTARTS")
    rows = []
    for i in instances:
        p = i["last_probe"]
        probe = "-" if not p else ("ok" if p["ok"] else "failed") + (f" {_ago(p['at'])}" if p["at"] else "")
        ttft = format_duration(p["ttft"]) if p and p["ttft"] is not None else "-"
        restarts = str(i["restarts_in_window"]) + (f" of {i['budget']}" if i.get("budget") else "")
        rows.append((i["name"], state_label(i), probe, ttft, restarts))
    widths = [min(max(len(r[c]) for r in [header, *rows]), cap) for c, cap in enumerate((20, 24, 16, 8, 8))]
    lines.append(Text(_row(header, widths), style="bold"))
    for i, row in zip(instances, rows, strict=True):
        lines.append(Text(_row(row, widths), style=STATE_STYLES.get(i["state"], "red")))
        p = i["last_probe"]
        if p and not p["ok"] and p.get("reason"):
            lines.append(Text(f"  last probe: {p['reason']}"))
        if i.get("kernel_sight") not in (None, "ok"):
            lines.append(Text(f"  no kernel sight ({i['kernel_sight']}): the probe alone judges"))
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
        elif inc:
            how = inc.get("event")
            took = inc.get("seconds_to_recovery")
            took_text = f" after {format_duration(took)}" if isinstance(took, (int, float)) else ""
            lines.append(Text(f"  last incident {_ago(_number(inc.get('detected_at')))}: {inc.get('kind') or 'kind unknown'}, "
                              f"{how}{took_text}"))
        if i["state"] == "gave_up":
            lines.append(Text(f"  gave up restarting: `mlxwatch resume {i['name']}` allows restarts again", style="red"))
        if not i.get("configured", True):
            lines.append(Text("  (in the state file, not in the config)"))
    if status.get("state_problem"):
        lines.append(Text(f"state file {status['state_problem']}; the daemon rebuilds it from the journal", style="yellow"))
    return [fit(line, width) for line in lines]


def render_status(status: dict[str, Any], console: Console, fit: bool | None = None) -> None:
    """Print the status; on a terminal (or with ``fit``) each line fits the console's width.
    Piped output keeps whole lines: a reason cut to 80 columns is lost to a log reader."""
    fit = console.is_terminal if fit is None else fit
    for line in status_lines(status, console.width if fit else PIPED_WIDTH):
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
