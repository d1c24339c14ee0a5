"""Restart methods: launchd, systemd, a custom command, a signal, or none.

Commands are argv lists, never a shell string. ``{name}``, ``{pid}``, ``{url}`` and
``{bundle}`` are substituted inside each argument; the config refuses them in another case
(``{PID}`` would reach the command as written). ``{pid}`` is the proven server process,
checked alive (same PID, same start) right before the hook runs, or empty: never a guess,
never a dead process's PID. ``signal`` re-checks the process identity before every signal it
sends, and continues a stopped process first (SIGTERM stays pending on a SIGSTOPped one). A
restart that found no process to restart says so: it is recorded as ``nothing_to_restart``,
not ``ok``.
"""

from __future__ import annotations

import asyncio
import os
import signal as signals
from dataclasses import dataclass, replace

from mlxwatch.config import HOOK_FIELD, InstanceConfig, RestartConfig
from mlxwatch.errors import RestartError
from mlxwatch.host import launchctl
from mlxwatch.host.commands import Runner, run_command
from mlxwatch.host.process import ProcessIdentity

OK, NOTHING_TO_RESTART = "ok", "nothing_to_restart"


@dataclass(frozen=True)
class RestartOutcome:
    result: str  # ok | nothing_to_restart (a failure raises RestartError)
    detail: str


@dataclass
class RestartContext:
    """What a restart may refer to."""

    instance: InstanceConfig
    identity: ProcessIdentity | None  # proven to be the server (see mlxwatch.host.process), or None
    bundle: str | None


def launchd_command(cfg: RestartConfig, uid: int | None = None, server_pid: int | None = None) -> list[str]:
    """``launchctl kickstart -k <domain>/<uid>/<label>``. The uid: ``uid``, else ``restart.uid``,
    else the server process's owner, else ours unless we are root (never ``gui/0``)."""
    try:
        uid = uid if uid is not None else launchctl.launchd_uid(cfg.domain, cfg.uid, server_pid)
    except launchctl.UidUnknown as exc:
        raise RestartError(str(exc)) from None
    return launchctl.kickstart_argv(cfg.domain, uid, cfg.target)


def systemd_command(cfg: RestartConfig) -> list[str]:
    return ["systemctl", *(["--user"] if cfg.user else []), "restart", cfg.target]


def custom_command(cfg: RestartConfig, ctx: RestartContext) -> list[str]:
    values = {
        "name": ctx.instance.name,
        "pid": str(ctx.identity.pid) if ctx.identity else "",
        "url": ctx.instance.url,
        "bundle": ctx.bundle or "",
    }
    return [HOOK_FIELD.sub(lambda m: values[m.group(1)], arg) for arg in cfg.argv]  # one pass: no value is read again


def describe(cfg: RestartConfig) -> str:
    if cfg.method in ("launchd", "systemd"):
        return f"{cfg.method} {cfg.target}"
    if cfg.method == "command":
        return "command " + " ".join(cfg.argv)
    if cfg.method == "signal":
        return f"signal {cfg.signal_name}"
    return "none"


async def restart(ctx: RestartContext, runner: Runner = run_command) -> RestartOutcome:
    """Restart the instance. Raises RestartError when the method failed."""
    cfg = ctx.instance.restart
    if cfg.method == "none":
        return RestartOutcome(NOTHING_TO_RESTART, "no restart configured (capture and notify only)")
    if cfg.method == "signal":
        return await _signal(ctx, cfg)
    if ctx.identity is not None and not await asyncio.to_thread(ctx.identity.alive):
        ctx = replace(ctx, identity=None)  # gone since it was proven: its PID may be anyone's soon
    argv = {"launchd": lambda: launchd_command(cfg, server_pid=ctx.identity.pid if ctx.identity else None),
            "systemd": lambda: systemd_command(cfg),
            "command": lambda: custom_command(cfg, ctx)}[cfg.method]()
    result = await runner(argv, cfg.timeout)
    if not result.ok:
        raise RestartError(f"{argv[0]}: {result.error}")
    return RestartOutcome(OK, f"ran {' '.join(argv)}")


async def _signal(ctx: RestartContext, cfg: RestartConfig) -> RestartOutcome:
    ident = ctx.identity
    if ident is None:
        return RestartOutcome(NOTHING_TO_RESTART, "no proven server process to signal")
    if not await asyncio.to_thread(ident.alive):
        return RestartOutcome(NOTHING_TO_RESTART, f"process {ident.pid} already gone; nothing to signal")
    os.kill(ident.pid, signals.SIGCONT)  # a stopped process would keep SIGTERM pending forever
    os.kill(ident.pid, getattr(signals, cfg.signal_name))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + cfg.grace
    while loop.time() < deadline:
        if not await asyncio.to_thread(ident.alive):
            return RestartOutcome(OK, f"sent {cfg.signal_name} to {ident.pid}; it exited")
        await asyncio.sleep(0.2)
    if await asyncio.to_thread(ident.alive):  # same PID and create time: still our process, so SIGKILL is safe
        os.kill(ident.pid, signals.SIGKILL)
        return RestartOutcome(OK, f"sent {cfg.signal_name} to {ident.pid}; still running after {cfg.grace:g}s, sent SIGKILL")
    return RestartOutcome(OK, f"sent {cfg.signal_name} to {ident.pid}; it exited")
