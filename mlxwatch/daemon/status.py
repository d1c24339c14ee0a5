"""``mlxwatch status``: the daemon's state file and the journal, daemon running or not.

Whether a daemon runs is read from the state dir's lock (held while it runs, dropped by the
kernel however it dies), not guessed from a PID that may have been reused; a running daemon
whose heartbeat is old is reported as stalled. An open incident is "in progress" while a daemon
runs, and "left open" (closed at the next start) when none does.

The state file and the journal are read as untrusted input: a hand-edited or damaged
``state.json`` (``[]``, ``{"instances": 5}``, a probe that is a number) or a journal line with
odd fields is shown as far as it makes sense, never a traceback::

    status = collect_status(config, state_dir)
    render_status(status, console)          # fits 80 columns
    sys.exit(status_exit_code(status))      # 0 all healthy and a daemon runs, else 1
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from mlxwatch.config import Config
from mlxwatch.durations import format_duration
from mlxwatch.journal.incidents import CLOSING_EVENTS, Journal
from mlxwatch.journal.lock import lock_holder
from mlxwatch.journal.state import load_state

STALLED_AFTER = 120.0  # seconds without a daemon heartbeat (written every 30 s) before "stalled"


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None if value is None else str(value)


def collect_status(config: Config, state_dir: Path) -> dict[str, Any]:
    state, problem = load_state(state_dir)
    journal = Journal(state_dir)
    daemon = _dict(state.get("daemon"))
    holder = lock_holder(state_dir)
    running = holder is not None
    tick = _number(daemon.get("last_tick"))
    stalled = running and tick is not None and time.time() - tick > STALLED_AFTER
    latest, open_incidents = _incidents(journal)
    saved = _dict(state.get("instances"))
    configured = {i.name for i in config.instances}
    names = [i.name for i in config.instances] + [n for n in saved if isinstance(n, str) and n not in configured]
    instances = []
    for name in names:
        s = _dict(saved.get(name))
        inc = latest.get(name)
        opened = open_incidents.get(name)
        probe = _dict(s.get("last_probe"))
        instances.append({
            "name": name,
            "configured": name in configured,
            "state": _text(s.get("state")) or "never probed",
            "last_probe": {"at": _number(probe.get("at")), "ok": probe.get("ok") is True,
                           "reason": _text(probe.get("reason")), "ttft": _number(probe.get("ttft")),
                           "total": _number(probe.get("total")), "tokens": _number(probe.get("tokens"))}
            if probe else None,
            "failures": int(_number(s.get("failures")) or 0),
            "restarts_in_window": _restarts_in_window(s, config, name),
            "budget": next((i.restart.budget for i in config.instances if i.name == name), None),
            "last_incident": inc and {k: inc.get(k) for k in ("id", "event", "kind", "confidence", "detected_at",
                                                              "bundle", "recovered_at", "seconds_to_recovery")},
            "open_incident": opened and {"id": opened["id"], "stopped_at_event": _stopped_at(opened),
                                         "kind": opened.get("kind")},
            "shim": _shim_status(s),
        })
    return {"state_dir": str(state_dir), "state_problem": problem,
            "config": str(config.path) if config.path else None,
            "daemon": {**daemon, "running": running, "pid": holder if running and holder > 0 else daemon.get("pid"),
                       "stalled": stalled},
            "instances": instances}


def _shim_status(s: dict) -> dict | None:
    """The launch shim's heartbeat of the recorded server (started by `mlxwatch launch`), if any."""
    from mlxwatch.shim import heartbeat

    server = s.get("server") if isinstance(s.get("server"), dict) else {}
    pid, created = server.get("pid"), server.get("create_time")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    hb, _ = heartbeat.find(pid, float(created) if isinstance(created, (int, float)) else None)
    return hb.summary() if hb is not None else None


def _incidents(journal: Journal) -> tuple[dict[str, dict], dict[str, dict]]:
    """Each instance's latest incident record, and its open incident (last record not closing).
    Records whose ``id`` or ``instance`` is not a string are not incident records."""
    last_by_id: dict[str, dict] = {}
    latest: dict[str, dict] = {}
    for rec in journal.records():
        if isinstance(rec.get("id"), str) and isinstance(rec.get("instance"), str):
            last_by_id[rec["id"]] = rec
            latest[rec["instance"]] = rec
    opened = {r["instance"]: r for r in last_by_id.values() if r.get("event") not in CLOSING_EVENTS}
    return latest, opened


def _restarts_in_window(s: dict, config: Config, name: str) -> int:
    window = next((i.restart.window for i in config.instances if i.name == name), 1800.0)
    restarts = s.get("restarts") if isinstance(s.get("restarts"), list) else []
    return sum(1 for t in restarts if _number(t) is not None and time.time() - t < window)


def status_exit_code(status: dict[str, Any]) -> int:
    """0 when a daemon runs (not stalled) and every instance is healthy; else 1."""
    d = status["daemon"]
    if not d["running"] or d.get("stalled") or not status["instances"]:
        return 1
    return 0 if all(i["state"] == "healthy" and not i["open_incident"] for i in status["instances"]) else 1


# --- rendering: fits 80 columns; long texts end in an ellipsis, never cut mid-word unmarked

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
        return [_fit(line, width) for line in lines]
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
    for i, row in zip(instances, rows):
        lines.append(Text(_row(row, widths), style=STATE_STYLES.get(i["state"], "red")))
        p = i["last_probe"]
        if p and not p["ok"] and p.get("reason"):
            lines.append(Text(f"  last probe: {p['reason']}"))
        if i.get("shim"):
            from mlxwatch.shim.heartbeat import describe

            lines.append(Text(f"  {describe(i['shim'])}"))
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
    return [_fit(line, width) for line in lines]


def render_status(status: dict[str, Any], console: Console, fit: bool | None = None) -> None:
    """Print the status; on a terminal (or with ``fit``) each line fits the console's width.
    Piped output keeps whole lines: a reason cut to 80 columns is lost to a log reader."""
    fit = console.is_terminal if fit is None else fit
    for line in status_lines(status, console.width if fit else 10**6):
        console.print(line, soft_wrap=True)


def _row(cells: tuple[str, ...], widths: list[int]) -> str:
    return "  ".join(_cut(c, w).ljust(w) for c, w in zip(cells, widths)).rstrip()


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _fit(line: Text, width: int) -> Text:
    if len(line.plain) <= width:
        return line
    out = line[: max(0, width - 1)]
    out.append("…")
    return out


def _ago(ts: float | None) -> str:
    if not ts:
        return ""
    return f"{format_duration(max(0.0, time.time() - ts))} ago"


def _stopped_at(rec: dict) -> object:
    """Where an open incident stands: a clean stop's ``interrupted`` record names the state."""
    return rec.get("state") if rec.get("event") == "interrupted" and rec.get("state") else rec.get("event")
