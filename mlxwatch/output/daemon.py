"""The daemon's lines for people: what ``run`` says as it starts, and ``resume``'s answer::

    for line in watch_plan([(inst, lookup_instance(inst)) for inst in config.instances], time.time()):
        log.info("%s", line)
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from rich.console import Console

from mlxwatch.config import InstanceConfig
from mlxwatch.daemon.watcher import FIRST_PROBE_SPREAD
from mlxwatch.durations import format_duration, human_duration
from mlxwatch.host.process import ServerLookup
from mlxwatch.output.text import lines_of


def watch_plan(found: list[tuple[InstanceConfig, ServerLookup]], now: float,
               seen_before: frozenset[str] = frozenset()) -> list[str]:
    """What ``run`` says as it starts, per instance (with its server lookup): what it watches,
    when the first probe comes and how long one may wait; and, for a server process younger
    than startup_timeout (a model still loading), the wall time before which no verdict is
    drawn. Without it a first run on a loading server said nothing for minutes. An instance in
    ``seen_before`` has the very process an earlier run saw healthy: it is not loading, and gets
    no such grace (the watcher's own rule)."""
    lines = []
    for inst, lookup in found:
        p = inst.probe
        log = f", log {inst.log}" if inst.log else ""
        lines.append(f"{inst.name}: watching {inst.url}{log}: first probe within "
                     f"{human_duration(min(p.interval, FIRST_PROBE_SPREAD))}, then every {human_duration(p.interval)} "
                     f"(first token within {human_duration(p.first_token_timeout)}); "
                     f"{p.failures} failed probes in a row make a verdict"
                     # as the log says it then: "HUNG after 1 failed probe(s)"
                     + ("; after a stall kernel sight saw, the one probe that confirms it decides"
                        if inst.kernel != "off" and p.failures > 1 else ""))
        proc = lookup.identity or lookup.loading
        if proc is None:
            lines.append(f"{inst.name}: no server process found ({lookup.detail}): a failed probe counts at once")
            continue
        up = max(0.0, now - proc.create_time)
        if inst.name in seen_before:
            lines.append(f"{inst.name}: server PID {proc.pid} was seen healthy by an earlier run: "
                         "a failed probe counts at once")
        elif up < p.startup_timeout:
            until = datetime.fromtimestamp(proc.create_time + p.startup_timeout).strftime("%H:%M:%S")
            lines.append(f"{inst.name}: server PID {proc.pid} started {format_duration(up)} ago: no verdict before "
                         f"{until} (startup_timeout {human_duration(p.startup_timeout)}) unless it answers first")
    return lines


def render_resume(console: Console, name: str, request: Path, state: str | None, daemon_running: bool,
                  state_dir: Path) -> None:
    """``resume NAME``: the request is written; who applies it, and when (reflowed to the
    terminal, or to 80 columns piped: it was one line of 132 to 150)."""
    lines_of(console, f"resume requested for {name}: {request}")
    lines_of(console, "the daemon applies it at its next probe" if daemon_running else
             f"no daemon runs on {state_dir} now: the next one applies it when it starts")
    if state != "gave_up":
        lines_of(console, f"note: {name} is not given up (state {state or 'not recorded yet'}); resuming only "
                          "clears its restart history")
