"""``mlxwatch status``: the daemon's state file and the journal, daemon running or not.

Whether a daemon runs is read from the state dir's lock (held while it runs, dropped by the
kernel however it dies), not guessed from a PID that may have been reused; a running daemon
whose heartbeat is old is reported as stalled. An open incident is "in progress" while a daemon
runs, and "left open" (closed at the next start) when none does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from mlxwatch.config import Config
from mlxwatch.durations import format_duration
from mlxwatch.watchdog.journal import Journal
from mlxwatch.watchdog.lock import lock_holder
from mlxwatch.watchdog.state import load_state

STALLED_AFTER = 120.0  # seconds without a daemon heartbeat (written every 30 s) before "stalled"


def collect_status(config: Config, state_dir: Path) -> dict[str, Any]:
    state, problem = load_state(state_dir)
    journal = Journal(state_dir)
    daemon = state.get("daemon", {}) if isinstance(state.get("daemon"), dict) else {}
    holder = lock_holder(state_dir)
    running = holder is not None
    tick = daemon.get("last_tick")
    stalled = running and isinstance(tick, (int, float)) and time.time() - tick > STALLED_AFTER
    latest = journal.latest_by_instance()
    open_incidents = {r["instance"]: r for r in journal.open_incidents()}
    names = [i.name for i in config.instances] + [n for n in state.get("instances", {}) if n not in {i.name for i in config.instances}]
    instances = []
    for name in names:
        s = state.get("instances", {}).get(name, {})
        inc = latest.get(name)
        instances.append({
            "name": name,
            "state": s.get("state", "never probed"),
            "last_probe": s.get("last_probe"),
            "failures": s.get("failures", 0),
            "restarts_in_window": _restarts_in_window(s, config, name),
            "last_incident": inc and {k: inc.get(k) for k in ("id", "event", "kind", "detected_at", "bundle",
                                                              "recovered_at", "seconds_to_recovery")},
            "open_incident": open_incidents.get(name) and {"id": open_incidents[name]["id"],
                                                           "stopped_at_event": open_incidents[name]["event"]},
            "shim": _shim_status(s),
        })
    return {"state_dir": str(state_dir), "state_problem": problem,
            "daemon": {**daemon, "running": running, "pid": holder if running and holder > 0 else daemon.get("pid"),
                       "stalled": stalled},
            "instances": instances}


def _shim_status(s: dict) -> dict | None:
    """The launch shim's heartbeat of the recorded server (started by `mlxwatch launch`), if any."""
    from mlxwatch import heartbeat

    server = s.get("server") if isinstance(s.get("server"), dict) else {}
    pid, created = server.get("pid"), server.get("create_time")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    hb, _ = heartbeat.find(pid, float(created) if isinstance(created, (int, float)) else None)
    return hb.summary() if hb is not None else None


def _restarts_in_window(s: dict, config: Config, name: str) -> int:
    window = next((i.restart.window for i in config.instances if i.name == name), 1800.0)
    return sum(1 for t in s.get("restarts", []) if time.time() - t < window)


def render_status(status: dict[str, Any], console: Console) -> None:
    d = status["daemon"]
    if d["running"] and d.get("stalled"):
        console.print(f"[red]daemon running (PID {d['pid']}) but stalled[/]: no heartbeat for "
                      f"{_ago(d.get('last_tick'))}; state in {status['state_dir']}")
    elif d["running"]:
        errors = f", {d['watcher_errors']} watcher error(s)" if d.get("watcher_errors") else ""
        console.print(f"daemon running (PID {d['pid']}{errors}), state in {status['state_dir']}")
    elif d.get("updated_at"):
        console.print(f"[yellow]daemon not running[/] (last update {_ago(d['updated_at'])}); state in {status['state_dir']}")
    else:
        console.print(f"[yellow]daemon has not run yet[/] (no state in {status['state_dir']})")
    table = Table()
    for col in ("instance", "state", "last probe", "TTFT", "total", "failures", "last incident", "restarts"):
        table.add_column(col)
    for i in status["instances"]:
        p = i["last_probe"] or {}
        inc = i["last_incident"]
        inc_text = "-"
        if inc:
            inc_text = f"{inc.get('kind') or '?'} {inc['event']} {_ago(inc.get('detected_at'))}"
        if i["open_incident"]:
            inc_text += " [red](open)[/]"
        table.add_row(
            i["name"], i["state"],
            ("ok" if p.get("ok") else f"failed: {p.get('reason', '')[:40]}") + f" {_ago(p.get('at'))}" if p else "-",
            format_duration(p["ttft"]) if p.get("ttft") is not None else "-",
            format_duration(p["total"]) if p.get("total") is not None else "-",
            str(i["failures"]), inc_text, str(i["restarts_in_window"]),
        )
    console.print(table)
    for i in status["instances"]:
        if i.get("shim"):
            from mlxwatch.heartbeat import describe

            console.print(f"{i['name']}: {describe(i['shim'])}", markup=False)
    for i in status["instances"]:
        if i["open_incident"]:
            o = i["open_incident"]
            if d["running"]:
                console.print(f"[red]{i['name']}: incident {o['id']} in progress: {o['stopped_at_event']}[/]")
            else:
                console.print(f"[red]{i['name']}: incident {o['id']} open: daemon stopped at {o['stopped_at_event']}[/]"
                              " (the daemon will close it when it starts)")
    if status.get("state_problem"):
        console.print(f"[yellow]state file {status['state_problem']}; the daemon rebuilds it from the journal[/]")


def _ago(ts: float | None) -> str:
    if not ts:
        return ""
    return f"{format_duration(max(0.0, time.time() - ts))} ago"
