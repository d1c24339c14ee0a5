"""The watchdog daemon: one asyncio process, one watcher task per configured instance.

The loop is small on purpose (as uvicorn's supervisor is): signal handlers only set events;
the loop waits on them. SIGTERM/SIGINT stop cleanly (watchers cancelled, open incidents marked
interrupted, state written); SIGHUP reloads the config, and a bad new config is reported and
the old one kept. At start, incidents a killed daemon left open are reported and closed, and
partial bundles it left are kept as ``-incomplete``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Callable

from mlxwatch.capture.bundle import adopt_partials
from mlxwatch.config import Config, default_state_dir
from mlxwatch.errors import ConfigError
from mlxwatch.probes import make_client
from mlxwatch.watchdog.instance import InstanceWatcher, Shared
from mlxwatch.watchdog.journal import Journal
from mlxwatch.watchdog.notify import Notifier
from mlxwatch.watchdog.state import StateFile

log = logging.getLogger("mlxwatch.watchdog")


def state_dir_for(config: Config, override: Path | None = None) -> Path:
    return override or config.state_dir or default_state_dir()


def bundles_dir_for(config: Config, state_dir: Path) -> Path:
    return config.capture.dir or state_dir / "bundles"


class Daemon:
    def __init__(self, config: Config, state_dir: Path, *, shared_overrides: dict | None = None) -> None:
        self.config = config
        self.state_dir = state_dir
        self.journal = Journal(state_dir)
        self.state = StateFile(state_dir)
        self.overrides = shared_overrides or {}
        self.watchers: dict[str, InstanceWatcher] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.pending: dict[str, object] = {}

    def report_interrupted(self) -> list[dict]:
        """Close incidents a killed daemon left open, saying where each stopped."""
        left = self.journal.open_incidents()
        for rec in left:
            log.warning("%s: incident %s was left open by a stopped daemon at '%s' (bundle: %s)",
                        rec["instance"], rec["id"], rec["event"], rec.get("bundle") or "none")
            fields = {k: v for k, v in rec.items() if k not in ("ts", "event")}
            self.journal.note("closed", **fields, reason=f"daemon stopped mid-incident at '{rec['event']}'")
        return left

    async def run(self, stop: asyncio.Event, reload: asyncio.Event | None = None,
                  load_config: Callable[[], Config] | None = None) -> None:
        reload = reload or asyncio.Event()
        self.journal.note("daemon_start", pid=os.getpid(), instances=[i.name for i in self.config.instances])
        self.report_interrupted()
        for path in adopt_partials(bundles_dir_for(self.config, self.state_dir)):
            log.warning("kept an unfinished bundle from an interrupted capture: %s", path)
        self.state.set_daemon(pid=os.getpid(), started_at=time.time(), running=True)
        async with make_client() as client:
            self.client = client
            self.notifier = Notifier(self.config.notify)
            for inst in self.config.instances:
                self._start(inst)
            log.info("watching %d instance(s): %s", len(self.tasks), ", ".join(self.tasks) or "none")
            while not stop.is_set():
                waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(reload.wait())]
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
                if reload.is_set() and not stop.is_set():
                    reload.clear()
                    self._reload(load_config)
            await self._shutdown(stop)

    def _shared(self) -> Shared:
        return Shared(client=self.client, journal=self.journal, state=self.state, state_dir=self.state_dir,
                      notifier=self.notifier, capture=self.config.capture,
                      bundles_dir=bundles_dir_for(self.config, self.state_dir), **self.overrides)

    def _start(self, inst) -> None:
        stop = asyncio.Event()
        watcher = InstanceWatcher(inst, self._shared(), stop)
        self.watchers[inst.name] = watcher
        self.tasks[inst.name] = asyncio.create_task(watcher.run(), name=f"watch-{inst.name}")

    def _reload(self, load_config: Callable[[], Config] | None) -> None:
        if load_config is None:
            return
        try:
            new = load_config()
        except ConfigError as exc:
            log.error("config reload failed, keeping the old config: %s", exc)
            return
        old = {i.name: i for i in self.config.instances}
        self.config = new
        self.notifier = Notifier(new.notify)
        wanted = {i.name: i for i in new.instances}
        for name in list(self.tasks):
            if name not in wanted or wanted[name] != old.get(name):
                if self.watchers[name].busy_with_incident:
                    log.warning("%s: config changed mid-incident; keeping the old settings until it ends", name)
                    continue
                self.watchers[name].stop.set()
                self.tasks.pop(name).cancel()
                self.watchers.pop(name)
        for name, inst in wanted.items():
            if name not in self.tasks:
                self._start(inst)
        log.info("config reloaded: watching %s", ", ".join(self.tasks) or "none")

    async def _shutdown(self, stop: asyncio.Event) -> None:
        for watcher in self.watchers.values():
            watcher.stop.set()
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for watcher in self.watchers.values():
            if watcher.incident is not None:
                self.journal.record("interrupted", watcher.incident, reason="daemon stopped")
        await self.notifier.drain()
        self.state.set_daemon(running=False, stopped_at=time.time())
        log.info("stopped")
