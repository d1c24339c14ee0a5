"""``mlxwatch status``: the daemon's state file and the journal, daemon running or not.

Whether a daemon runs is read from the state dir's lock (held while it runs, dropped by the
kernel however it dies), not guessed from a PID that may have been reused; a running daemon
whose heartbeat is old is reported as stalled. An open incident is "in progress" while a daemon
runs, and "left open" (closed at the next start) when none does.

The state file and the journal are read as untrusted input: a hand-edited or damaged
``state.json`` (``[]``, ``{"instances": 5}``, a probe that is a number) or a journal line with
odd fields is shown as far as it makes sense, never a traceback::

    status = collect_status(config, state_dir)  # plain data (JSON-ready); output/status.py renders it
    code = status_exit_code(status)             # 0 all healthy and a daemon runs, else 1
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from mlxwatch.clock import Clock
from mlxwatch.config import Config, RestartConfig
from mlxwatch.journal.incidents import CLOSING_EVENTS, Journal
from mlxwatch.journal.lock import lock_holder
from mlxwatch.journal.state import load_state
from mlxwatch.restart.flapguard import restarts_in_window

STALLED_AFTER = 120.0  # seconds without a daemon heartbeat (written every 30 s) before "stalled"


def _dict(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _number(value: Any) -> float | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return float(value) if math.isfinite(value) else None


def _count(value: Any) -> int | None:
    """A whole number >= 0 (a PID, a rank, a count), or None for anything else."""
    number = _number(value)
    return int(number) if number is not None and number >= 0 and number == int(number) else None


def _pace_status(value: Any) -> dict | None:
    """What the server owes now and by when (the watcher's cadence), as the state file has it."""
    pace = _dict(value)
    if not pace:
        return None
    return {"owes": _text(pace.get("owes")), "basis": _text(pace.get("basis")), "due": _number(pace.get("due")),
            "floor": _number(pace.get("floor")), "hidden": _text(pace.get("hidden")),
            "overdue": _text(pace.get("overdue"))}


def _cadence_status(value: Any) -> dict | None:
    """The server's learned pace: a chunk's bound and what it rests on, a decode step."""
    cadence = _dict(value)
    if not cadence:
        return None
    step = _dict(cadence.get("step"))
    return {"chunk_bound": _number(cadence.get("chunk_bound")), "basis": _text(cadence.get("basis")),
            "chunk_tokens": _count(cadence.get("chunk_tokens")), "step": _number(step.get("mean"))}


def _memory_status(memory: Any) -> dict[str, Any] | None:
    """The server's memory as the watcher last read it (``daemon.memwatch``): numbers or None."""
    if not isinstance(memory, dict) or _number(memory.get("used")) is None:
        return None
    return {"used": _number(memory.get("used")), "limit": _number(memory.get("limit")),
            "room": _number(memory.get("room")), "rate": _number(memory.get("rate")),
            "minutes_left": _number(memory.get("minutes_left")), "bound": _text(memory.get("bound")),
            "measure": _text(memory.get("measure")), "pressure": _text(memory.get("pressure"))}


def _text(value: Any) -> str | None:
    """A string to show, its control characters (a newline, an escape sequence from a damaged or
    planted file) made visible as ``?``: they would break the table or drive the terminal."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else "?" for c in text)


def collect_status(config: Config, state_dir: Path, clock: Clock | None = None) -> dict[str, Any]:
    """``clock`` (tests inject one) counts the restarts in the window as the flap guard does."""
    clock = clock or Clock()
    state, problem = load_state(state_dir)
    journal = Journal(state_dir, read_only=True)  # status only reads: it creates nothing
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
        stuck = _dict(s.get("stuck")) if running else {}  # a stopped daemon's watchers are not stuck, just gone
        instances.append({
            "name": _text(name),
            "configured": name in configured,
            "state": "stuck" if stuck else _text(s.get("state")) or "never probed",
            "stuck": stuck and {"since": _number(stuck.get("since")), "state": _text(stuck.get("state"))} or None,
            "last_probe": {"at": _number(probe.get("at")), "ok": probe.get("ok") is True,
                           "reason": _text(probe.get("reason")), "ttft": _number(probe.get("ttft")),
                           "total": _number(probe.get("total")), "tokens": _number(probe.get("tokens"))}
            if probe else None,
            "failures": _count(s.get("failures")) or 0,
            "restarts_in_window": _restarts_in_window(s, config, name, clock),
            "budget": next((i.restart.budget for i in config.instances if i.name == name), None),
            "last_incident": inc and {k: inc.get(k) for k in ("id", "event", "kind", "cause", "confidence", "detected_at",
                                                              "bundle", "recovered_at", "seconds_to_recovery")},
            "open_incident": opened and {"id": opened["id"], "stopped_at_event": _stopped_at(opened),
                                         "kind": opened.get("kind"), "cause": _text(opened.get("cause")),
                                         "cause_summary": _text(opened.get("cause_summary"))},
            "shim": _shim_status(s),
            "front": _front_status(s) if running else None,
            "kernel_sight": _text(s.get("kernel_sight")),
            "kernel": _kernel_status(s),
            "memory": _memory_status(s.get("memory")),
            "group": group_status(s.get("group")),
            "pace": _pace_status(s.get("pace")),
            "cadence": _cadence_status(s.get("cadence")),
        })
    return {"state_dir": str(state_dir), "state_problem": problem,
            "config": str(config.path) if config.path else None,
            "daemon": {**_daemon_fields(daemon), "running": running,
                       "pid": holder if holder is not None and holder > 0 else _count(daemon.get("pid")),
                       "stalled": stalled},
            "instances": instances}


def _daemon_fields(daemon: dict) -> dict[str, Any]:
    """What the daemon wrote about itself, each field as it writes it or left out: a damaged
    file must not put a string PID or a non-JSON number into ``status --json``."""
    fields: dict[str, Any] = {}
    for key in ("started_at", "stopped_at", "last_tick", "updated_at"):
        if (number := _number(daemon.get(key))) is not None:
            fields[key] = number
    if (errors := _count(daemon.get("watcher_errors"))) is not None:
        fields["watcher_errors"] = errors
    metrics = _dict(daemon.get("metrics"))
    if metrics:
        fields["metrics"] = {"serving": _text(metrics.get("serving")), "error": _text(metrics.get("error"))}
    reload = _dict(daemon.get("last_reload"))
    if reload:
        fields["last_reload"] = {"at": _number(reload.get("at")), "ok": reload.get("ok") is True,
                                 "message": _text(reload.get("message"))}
    return fields


def _kernel_status(s: dict) -> dict | None:
    """What kernel sight saw at the watcher's last look (client streams, requests waiting for an
    answer, slow readers, the last byte to any client as a wall time), when it can see."""
    kernel = _dict(s.get("kernel"))
    if not kernel or s.get("kernel_sight") != "ok":
        return None
    return {**{k: _count(kernel.get(k)) for k in ("connections", "streams", "waiting", "slow_readers")},
            "last_flow_at": _number(kernel.get("last_flow_at"))}


def _shim_status(s: dict) -> dict | None:
    """The launch shim's heartbeat of the recorded server (started by `mlxwatch launch`), if any."""
    from mlxwatch.shim import heartbeat

    server = _dict(s.get("server"))
    pid, created = server.get("pid"), server.get("create_time")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    hb, _ = heartbeat.find(pid, float(created) if isinstance(created, (int, float)) else None)
    return hb.summary() if hb is not None else None


def group_status(saved: Any) -> dict | None:
    """An ``mlx.launch`` group as the daemon last found it (the state file's ``group``, a
    ``Group.to_dict()``): its launcher, backend and each rank's number, host, PID and state.
    None for a single server, and for an entry too damaged to name any rank."""
    g = _dict(saved)
    ranks = []
    for item in _list(g.get("ranks")):
        r = _dict(item)
        number = _count(r.get("rank"))
        if number is None:
            continue
        ranks.append({"rank": number, "host": _text(r.get("host")) or "?", "pid": _count(r.get("pid")),
                      "state": _text(r.get("state")) or "unknown"})
    if not ranks:
        return None
    hosts, errors = _list(g.get("hosts")), _list(g.get("errors"))
    return {"launcher_pid": _count(_dict(g.get("launcher")).get("pid")), "backend": _text(g.get("backend")),
            "size": max(len(hosts), len(ranks)), "ranks": sorted(ranks, key=lambda r: r["rank"]),
            "errors": [str(e) for e in errors], "orphaned": _text(g.get("orphaned"))}


def _front_status(s: dict) -> dict | None:
    """The front door as the running daemon last read it (every few seconds), or the error that
    keeps it from serving."""
    front, error = _dict(s.get("front")), _text(s.get("front_error"))
    if not front and not error:
        return None
    outcomes = _dict(front.get("outcomes"))
    return {"listen": _text(front.get("listen")), "gate": _text(front.get("gate")), "error": error,
            "in_flight": _count(front.get("in_flight")) or 0,
            "last_token_at": _number(front.get("last_token_at")),
            "outcomes": {str(k): n for k, v in outcomes.items() if (n := _count(v)) is not None}}


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


def _restarts_in_window(s: dict, config: Config, name: str, clock: Clock) -> int:
    """By the guard's own rule (``flapguard.restarts_in_window``): the saved monotonic readings
    on this boot, so a wall-clock step changes nothing the guard would not count."""
    window = next((i.restart.window for i in config.instances if i.name == name), RestartConfig.window)
    return restarts_in_window(s, window, clock)


def status_exit_code(status: dict[str, Any]) -> int:
    """0 when a daemon runs (not stalled) and every instance is healthy, its front door (if it
    has one) serving; else 1. A door that cannot listen leaves its clients refused."""
    d = status["daemon"]
    if not d["running"] or d.get("stalled") or not status["instances"]:
        return 1
    return 0 if all(i["state"] == "healthy" and not i["open_incident"] and not (i.get("front") or {}).get("error")
                    for i in status["instances"]) else 1


def _stopped_at(rec: dict) -> object:
    """Where an open incident stands: a clean stop's ``interrupted`` record names the state."""
    return rec.get("state") if rec.get("event") == "interrupted" and rec.get("state") else rec.get("event")
