"""``mlxwatch run`` (the daemon, in the foreground), ``status`` and ``resume``."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from contextlib import nullcontext
from typing import Any

from rich.console import Console

from mlxwatch.cli.common import EXIT_OK, EXIT_UNHEALTHY, explicit_config, load_optional, state_dir
from mlxwatch.config import Config, load_config, load_runnable_config, missing_config_hint, resolve_config_path
from mlxwatch.errors import UsageError


class _HeldSignals:
    """SIGTERM, SIGINT and SIGHUP that arrive while ``run`` starts, before its event loop takes
    them, are remembered, not acted on: SIGHUP's default action would kill the daemon (exit
    129), SIGTERM's would skip its clean stop. The handlers only append; ``go`` replays them."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.arrived: list[int] = []
        self.previous = {signum: signal.signal(signum, self._remember) for signum in self.SIGNALS}

    def _remember(self, signum: int, frame: object) -> None:
        self.arrived.append(signum)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def cmd_run(args: argparse.Namespace, out: Console) -> int:
    held = _HeldSignals()  # first: the imports and the config read below can take seconds on a busy Mac
    try:
        return _run_daemon(args, held)
    finally:
        held.restore()


def _run_daemon(args: argparse.Namespace, held: _HeldSignals) -> int:
    import logging

    # httpx imports its command-line client (click, pygments, rich.syntax: 5.6 MB of a 60 MB goal at
    # 300 instances, bench/RESULTS.md) only to offer `httpx.main`; a module that cannot be imported
    # is its own fallback (a None in sys.modules raises ModuleNotFoundError). The daemon never uses it.
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
    from mlxwatch.daemon.selflog import RotatingStderr
    from mlxwatch.daemon.supervisor import Daemon
    from mlxwatch.host.limits import raise_open_files_limit

    path = resolve_config_path(args.config)
    if not path.exists() and not explicit_config(args):
        hint = missing_config_hint(path)
        raise UsageError(f"no config at {path}: nothing to watch. {hint[:1].upper()}{hint[1:]}; "
                         "`mlxwatch demo` shows the watchdog work on a tiny local server")
    config = load_runnable_config(path)
    handler = RotatingStderr()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler], force=True)
    if args.log_level != "DEBUG":  # httpx logs every request at INFO: three lines per probe, not events
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    before, after = raise_open_files_limit()  # before the doors size their connection caps on it
    if after != before:
        logging.getLogger("mlxwatch.run").debug("open-files limit raised from %d to %d", before, after)
    daemon = Daemon(config, state_dir(config, args.state_dir))

    async def go() -> None:
        loop = asyncio.get_running_loop()
        stop, reload = asyncio.Event(), asyncio.Event()
        for signum in held.SIGNALS:  # the loop takes them from here on
            loop.add_signal_handler(signum, (reload if signum == signal.SIGHUP else stop).set)
        log = logging.getLogger("mlxwatch.watchdog")
        for arrived in dict.fromkeys(held.arrived):
            if arrived == signal.SIGHUP:
                log.info("SIGHUP arrived while starting: the config is read again once the daemon is ready")
                reload.set()
            else:
                log.info("%s arrived while starting: stopping before the daemon starts", signal.Signals(arrived).name)
                stop.set()
        if stop.is_set():
            return
        announce = asyncio.create_task(_announce_watch(daemon, config, logging.getLogger("mlxwatch.run")))
        try:
            await daemon.run(stop, reload, load_config=lambda: load_runnable_config(path))
        finally:
            announce.cancel()

    asyncio.run(go())
    return EXIT_OK


async def _announce_watch(daemon: Any, config: Config, log: Any) -> None:
    """One INFO line per fact a first run would otherwise wait minutes to learn (output.daemon's
    watch_plan), said once the daemon holds its state dir and has started its watchers (before
    their first probe, which comes 0-5 s later): a daemon refused at start still says one line only."""
    from mlxwatch.host.process import lookup_instance
    from mlxwatch.output.daemon import watch_plan

    def plan() -> list[str]:
        seen_before = frozenset(name for name, watcher in daemon.watchers.items()
                                if watcher.identity is not None and watcher.identity.alive())
        return watch_plan([(inst, lookup_instance(inst)) for inst in config.instances], time.time(), seen_before)

    while not daemon.tasks:
        await asyncio.sleep(0.05)
    for line in await asyncio.to_thread(plan):
        log.info("%s", line)


def cmd_status(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.daemon.status import collect_status, status_exit_code
    from mlxwatch.output.status import StatusWatch, render_status

    if args.count is not None and args.watch is None:
        raise UsageError("status: --count needs --watch")
    config = load_optional(args)
    where = state_dir(config, args.state_dir)

    def once() -> tuple[dict, int]:
        status = collect_status(config, where)
        return status, status_exit_code(status)

    if args.watch is None:
        status, code = once()
        if args.json:
            print(json.dumps({**status, "exit_code": code}, indent=2, default=str))
        else:
            render_status(status, out)
        return code
    code, shown = EXIT_UNHEALTHY, 0
    try:
        with nullcontext() if args.json else StatusWatch(out, args.watch) as view:
            while True:
                status, code = once()
                shown += 1
                if view is None:  # --json
                    print(json.dumps({**status, "exit_code": code}, default=str), flush=True)
                else:
                    view.show(status)
                if args.count is not None and shown >= args.count:
                    return code
                time.sleep(args.watch)
    except KeyboardInterrupt:
        return code  # the last status's code: a watch stopped by hand still says how things were


def cmd_resume(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.journal.lock import lock_holder
    from mlxwatch.journal.state import load_state, request_resume
    from mlxwatch.output.daemon import render_resume

    path = resolve_config_path(args.config)
    if not explicit_config(args) and not path.exists():
        raise UsageError(f"resume: no config at {path}, so no instance is known; give --config FILE "
                         "(the config the daemon runs with)")
    config = load_config(path)
    inst = config.instance(args.name)  # an unknown name is a config error, not a silent no-op
    where = state_dir(config, args.state_dir)
    saved, _ = load_state(where)
    record = saved.get("instances", {}).get(inst.name, {})
    state = record.get("state") if isinstance(record.get("state"), str) else None
    holder = lock_holder(where)
    try:
        request = request_resume(where, inst.name)
    except OSError as exc:  # a read-only file system, another user's dir: the user's to fix, exit 2
        raise UsageError(f"resume: cannot write the request in {where}: {exc.strerror or exc}; run it as the "
                         "daemon's user, or give --state-dir DIR (the daemon's state dir)") from None
    if args.json:
        print(json.dumps({"instance": inst.name, "request": str(request), "state": state,
                          "daemon_running": holder is not None, "state_dir": str(where)}, indent=2))
        return EXIT_OK
    render_resume(out, inst.name, request, state, holder is not None, where)
    return EXIT_OK
