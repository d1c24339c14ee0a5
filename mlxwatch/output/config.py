"""``mlxwatch config validate`` and ``config init``: what a config watches, in one line each::

    render_validated(load_runnable_config(path), console)
    render_written(path, created_parent, servers, console, hint="")
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from mlxwatch.config import Config, listen_address
from mlxwatch.host.discover import FoundServer
from mlxwatch.output.text import lines_of


def render_validated(config: Config, console: Console) -> None:
    """The file is valid, and each instance: its URL, then its probe, restart and front door
    settings a line each, reflowed to the terminal or to 80 columns piped (it was one line of
    233 columns)."""
    lines_of(console, f"{config.path}: ok, {len(config.instances)} instance(s)")
    for inst in config.instances:
        p, r = inst.probe, inst.restart
        lines_of(console, f"  {inst.name}: {inst.url}")
        lines_of(console, f"    probe every {p.interval:g}s, first token {p.first_token_timeout:g}s, "
                          f"total {p.timeout:g}s, verdict after {p.failures} failures", "      ")
        lines_of(console, f"    restart {r.method} {r.target or ' '.join(r.argv)}".rstrip(), "      ")
        if inst.front is not None:
            lines_of(console, f"    front door on {listen_address(inst.front.listen)}")


def render_written(path: Path, created_parent: bool, servers: list[FoundServer], console: Console,
                   config_option: str = "") -> None:
    """``config init`` wrote ``path``: each server found, then the next two commands
    (``config_option``: `` --config FILE`` when the file is not the default one)."""
    lines_of(console, f"wrote {path}" + (f" (created {path.parent})" if created_parent else "")
             + f": {len(servers)} instance(s)")
    for s in servers:
        restart = (f"launchd {s.launchd_label}" if s.launchd_label else f"systemd {s.systemd_unit}"
                   if s.systemd_unit else "none (edit restart:)")
        lines_of(console, f"  {s.name}: {s.url} (PID {s.pid}); log {s.log or 'not found'}; restart {restart}")
        if s.group is not None:
            lines_of(console, f"    {s.group_text}")
    lines_of(console, f"next: `mlxwatch{config_option} doctor`, then `mlxwatch{config_option} run`")
