"""Restart methods: launchd, systemd, a custom command, a signal, or none.

Commands are argv lists, never a shell string. ``{name}``, ``{pid}``, ``{url}`` and
``{bundle}`` are substituted inside each argument; the config refuses them in another case
(``{PID}`` would reach the command as written). ``{pid}`` is the proven server process,
checked alive (same PID, same start) right before the hook runs, or empty: never a guess,
never a dead process's PID. ``signal`` re-checks the process identity before every signal it
sends, and continues a stopped process first (SIGTERM stays pending on a SIGSTOPped one). A
restart that found no process to restart says so: it is recorded as ``nothing_to_restart``,
not ``ok``.

A distributed server (an ``mlx.launch`` group, ``RestartContext.group``) is restarted whole,
never one rank: ``signal`` continues every stopped rank, sends the signal to every rank, kills
those still running after the grace, then ends the launcher (it exits by itself once a rank
has exited non-zero; else it is signalled too), and proves every rank and the launcher gone
before it returns: the supervisor (launchd, systemd, a keep-alive loop) starts the launcher again
only once nothing of the old group holds its ports. Ranks go first because SIGTERM ends
``mlx.launch`` without it ending its ranks (measured: they are left running, orphaned), and
SIGTERM to rank 0 while rank 1 is stopped leaves ``mlx.launch`` spinning for ever. The other
methods are followed by the same sweep of the old group's ranks that outlive them. Every
signal to a rank is preceded by proof that it is the very process found (PID and start; for a
remote rank, checked on its host in the same ssh run).

**A dead launcher** (SIGKILL, an OOM kill, ``launchctl kickstart -k``) leaves its ranks running,
orphaned, holding the ports; a supervisor's relaunch meanwhile cannot bind (``Address already in
use``) and never exits (measured on 0.32.2: its rank 0 waits in ``threading._shutdown``, its
rank 1 in ``ResponseGenerator.join``). No restart method alone brings that back. So when the
verdict's group is orphaned, or more than one group holds or waits for the instance's port
(``groups.instance_groups``), every one of them is ended first (ranks, then each live launcher),
proven gone, and only then does the method run and start one group (``signal``: the supervisor
does, once the launcher it watches has exited). docs/distributed.md says what each method does.

**JACCL** ranks always get SIGTERM before SIGKILL (``restart.signal: SIGKILL`` included): a
public report says a SIGKILLed JACCL process leaks its RDMA protection domain (docs/distributed.md
cites it).
"""

from __future__ import annotations

import asyncio
import os
import signal as signals
import time
from dataclasses import dataclass, replace
from typing import Callable

from mlxwatch.config import HOOK_FIELD, InstanceConfig, RestartConfig
from mlxwatch.errors import RestartError
from mlxwatch.host import launchctl
from mlxwatch.host import group as groups
from mlxwatch.host.commands import Runner, run_command
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.restart.release import Released, wait_released

OK, NOTHING_TO_RESTART = "ok", "nothing_to_restart"


@dataclass(frozen=True)
class RestartOutcome:
    result: str  # ok | nothing_to_restart (a failure raises RestartError)
    detail: str
    released: Released | None = None  # the wait for a stopped server's memory before the method ran


@dataclass
class RestartContext:
    """What a restart may refer to."""

    instance: InstanceConfig
    identity: ProcessIdentity | None  # proven to be the server (see mlxwatch.host.process), or None
    bundle: str | None
    group: groups.Group | None = None  # the mlx.launch group whose rank 0 ``identity`` is: restarted whole
    gone: ProcessIdentity | None = None  # the server the verdict was about, found stopped: its memory is awaited
    held: int | None = None  # its last memory reading, bytes (macOS: how far the GPU's in-use memory must fall)


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
        "launcher_pid": str(ctx.group.launcher_pid or "") if ctx.group else "",
        "pids": ",".join(str(r.pid or "") for r in ctx.group.ranks) if ctx.group else "",
        "hosts": ",".join(r.host for r in ctx.group.ranks) if ctx.group else "",
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
    ended = ""
    if ctx.group is not None:
        stale = await asyncio.to_thread(_stale_groups, ctx.group, ctx.instance.port)
        if stale:
            ended = await asyncio.to_thread(_end_groups, stale, cfg)
            if cfg.method == "signal":
                return RestartOutcome(OK, ended + "; the supervisor starts the launcher again")
            ctx = replace(ctx, identity=None, group=None)  # all ended and proven gone: nothing to name
    if cfg.method == "signal":
        if ctx.group is not None:
            return await asyncio.to_thread(_signal_group, ctx.group, cfg)
        return await _signal(ctx, cfg)
    if ctx.identity is not None and not await asyncio.to_thread(ctx.identity.alive):
        ctx = replace(ctx, identity=None, gone=ctx.identity)  # gone since it was proven: its PID may be anyone's soon
    released = None
    if ctx.gone is not None and ctx.identity is None:  # never start the next server into memory still held
        released = await asyncio.to_thread(wait_released, ctx.gone, ctx.instance.memory.release_timeout, ctx.held)
    argv = {"launchd": lambda: launchd_command(cfg, server_pid=ctx.identity.pid if ctx.identity else None),
            "systemd": lambda: systemd_command(cfg),
            "command": lambda: custom_command(cfg, ctx)}[cfg.method]()
    result = await runner(argv, cfg.timeout)
    if not result.ok:
        raise RestartError(f"{argv[0]}: {result.error}")
    detail = (ended + "; then " if ended else "") + f"ran {' '.join(argv)}"
    if released is not None and released.slow:
        detail = f"{released.detail}; then {detail}"
    if ctx.group is not None:
        detail += await asyncio.to_thread(_sweep, ctx.group, cfg.grace)
    return RestartOutcome(OK, detail, released)


def _ranks_text(ranks: list[groups.Rank]) -> str:
    return ", ".join(r.where for r in ranks)


def _stale_groups(group: groups.Group, port: int) -> list[groups.Group]:
    """The groups to end before any restart method runs (blocking): none while ``group`` has
    its launcher and is the only group on ``port``; else ``group`` and every other group that
    holds the port or waits for it (the orphans of a dead launcher, a relaunch that cannot
    bind), each as found now."""
    now = groups.refresh(group)
    others = [g for g in groups.instance_groups(port) if not g.same_group(now) and not set(g.pids) <= set(now.pids)]
    if not now.launcher_gone and not others:
        return []
    return [now, *others]


def _end_groups(found: list[groups.Group], cfg: RestartConfig) -> str:
    """End every group of ``found`` (ranks, then its launcher if alive) and prove each gone
    (blocking). Raises RestartError naming what is left."""
    steps = []
    for group in found:
        orphan = f" ({group.orphan_note()})" if group.orphan_note() else ""
        try:
            outcome = _signal_group(group, cfg)
        except RestartError as exc:
            raise RestartError(f"the instance's groups not all ended: {exc}") from None
        steps.append(f"{group.describe()}{orphan}: {outcome.detail}")
    return f"ended {len(found)} group(s) holding or waiting for port: " + " | ".join(steps)


def _first_signal(group: groups.Group, signame: str) -> str:
    """SIGTERM before SIGKILL for a JACCL rank (its RDMA protection domain leaks on SIGKILL)."""
    return "SIGTERM" if group.backend == "jaccl" and signame == "SIGKILL" else signame


def _sweep(group: groups.Group, grace: float) -> str:
    """After a restart method: the old group's ranks still running after ``grace`` are
    continued and killed (proven first; a JACCL rank is sent SIGTERM first, ``grace`` more).
    What it did, for the outcome's detail."""
    left = groups.wait_ranks_gone(group, grace)
    if not left:
        return "; every rank of the old group is gone"
    groups.signal_ranks(group, left, "SIGCONT")
    if group.backend == "jaccl":
        groups.signal_ranks(group, left, "SIGTERM")
        left = groups.wait_ranks_gone(group, grace) or []
    killed = groups.signal_ranks(group, left, "SIGKILL")
    still = groups.wait_ranks_gone(group, 10.0)
    if still:
        raise RestartError(f"ranks of the old group outlived the restart and SIGKILL: {_ranks_text(still)}")
    return f"; killed ranks that outlived it by {grace:g}s: {_ranks_text(killed)}"


def _signal_group(group: groups.Group, cfg: RestartConfig) -> RestartOutcome:
    """The whole group (see the module docstring); blocking: run in a worker thread."""
    now = groups.refresh(group)
    running = [r for r in now.ranks if r.state in (groups.RUNNING, groups.STOPPED, "unknown") and r.pid]
    launcher = group.launcher

    def launcher_alive() -> bool:
        return launcher is not None and launcher.alive()
    if not running and not launcher_alive():
        return RestartOutcome(NOTHING_TO_RESTART, "every rank and the launcher already gone; nothing to signal")
    steps = []
    stopped = [r for r in running if r.state == groups.STOPPED]
    if stopped:  # SIGTERM stays pending on a stopped process
        groups.signal_ranks(now, stopped, "SIGCONT")
        steps.append(f"continued stopped {_ranks_text(stopped)}")
    first = _first_signal(now, cfg.signal_name)
    sent = groups.signal_ranks(now, running, first)
    steps.append(f"sent {first} to {len(sent)} rank(s)")
    left = groups.wait_ranks_gone(now, cfg.grace)
    if left:
        groups.signal_ranks(now, left, "SIGCONT")
        killed = groups.signal_ranks(now, left, "SIGKILL")
        steps.append(f"SIGKILL to {_ranks_text(killed)} after {cfg.grace:g}s")
        left = groups.wait_ranks_gone(now, 10.0)
    if launcher is not None and launcher_alive() and not _wait(launcher_alive, 5.0):  # it exits once a rank exited non-zero
        os.kill(launcher.pid, signals.SIGCONT)
        os.kill(launcher.pid, getattr(signals, cfg.signal_name))
        steps.append(f"sent {cfg.signal_name} to the launcher {launcher.pid}")
        if not _wait(launcher_alive, cfg.grace) and launcher_alive():
            os.kill(launcher.pid, signals.SIGKILL)
            steps.append("SIGKILL to the launcher")
            _wait(launcher_alive, 10.0)
    if left or launcher_alive():
        what = _ranks_text(left) + (f"; launcher {launcher.pid}" if launcher is not None and launcher_alive() else "")
        raise RestartError(f"group not ended: still running: {what.strip('; ')}")
    gone = "the launcher gone" if not now.launcher_gone else \
        f"the launcher {'PID ' + str(launcher.pid) + ' ' if launcher is not None else ''}was already gone"
    return RestartOutcome(OK, "; ".join(steps) + f"; all {len(group.ranks)} ranks and {gone}")


def _wait(alive: Callable[[], bool], timeout: float) -> bool:
    """Until ``alive()`` is false (True), or ``timeout`` passed (False)."""
    deadline = time.monotonic() + timeout
    while alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


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
