"""The watchdog daemon: one asyncio process, one supervised watcher task per instance.

The loop is small on purpose (as uvicorn's supervisor is): signal handlers only set events;
the loop wakes on them or on its heartbeat, and does the work:

- **Supervision.** Every task it creates it watches. A watcher that raises is logged with its
  traceback (once per distinct error), journaled (``watcher_error``), counted in the daemon's
  health, and started again after a backoff (1 s doubling to 60 s). A crashed watcher never
  leaves its instance looking "healthy" in ``status``. A watcher whose ``run`` returns without
  being stopped is treated as one that raised.
- **Liveness** (as uvicorn's ping, not "the task exists"). Each watcher promises its next sign
  of life (``InstanceWatcher.promise``: after each cycle, within its sleep plus a cycle's bound;
  each incident step with that step's bound). At each heartbeat a watcher more than
  ``LIVENESS_SLACK`` past its promise is *stuck*: logged, one ``watcher_stuck`` journal record
  per episode, ``stuck`` in its state-file entry (``status`` shows it, not "healthy"); its next
  sign of life ends the episode.
- **One daemon per state dir** (``lock.py``): a second ``run`` is refused with the holder's PID.
- **One daemon per server** (``serverlock.py``): a ``run`` whose config watches a URL another
  daemon (another state dir) watches is refused, naming that daemon; so is a reload adding one.
- **Lifecycle.** Any stop (SIGTERM, SIGINT, a crash, SIGKILL) leaves a journal the next start
  reads: incidents left open are closed with where they stopped, partial bundles whose writer
  is gone are kept as ``-incomplete``, restart budgets come back from the state file (or, if
  it is unreadable, from the journal). A stop lets a restart under way finish, for up to
  ``STOP_RESTART_WAIT``: a hook cut half-way (the server stopped, not yet started) would leave
  the server down until the next start.
- **Reload is a swap** (SIGHUP): the new config is built whole in a thread; if ``run`` would
  refuse it (``check_runnable``, a bundles dir others can write), or it moves ``state_dir``, it is refused and the old one
  kept. Otherwise top-level settings apply at once, changed instances restart their watchers
  at once when idle and when their incident ends otherwise, removed instances are dropped at
  once (their incident closed as ``removed``), and the outcome is recorded (a log line, a
  ``config_reload`` journal note, ``last_reload`` in the state file). See docs/deciding.md.
- **Front doors** (``instances[].front``): each is served beside its instance's watcher,
  started before it, given new ``front`` settings in place, replaced when its ``url`` or
  ``front.listen`` change (when the watcher takes the change), stopped when the instance goes
  and at shutdown; read for the metrics every few seconds. See docs/front-door.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable

from mlxwatch.capture.bundle import adopt_partials
from mlxwatch.config import (
    Config,
    FrontConfig,
    InstanceConfig,
    bundles_dir_for,
    check_runnable,
    listen_address,
    same_address,
)
from mlxwatch.daemon.notify import Notifier
from mlxwatch.daemon.watcher import InstanceWatcher, Shared
from mlxwatch.errors import ConfigError, FrontError, StateError
from mlxwatch.front.door import FrontDoor
from mlxwatch.host.sockets import KernelCounters
from mlxwatch.journal.incidents import Event, Journal
from mlxwatch.journal.lock import StateDirLock
from mlxwatch.journal.serverlock import ServerLocks
from mlxwatch.journal.state import StateFile, unusable_state_dir
from mlxwatch.storage import private_dir

log = logging.getLogger("mlxwatch.watchdog")

FRONT_METRICS_EVERY = 5.0  # seconds between readings of the doors for the metrics
HEARTBEAT = 30.0  # seconds between the daemon's own liveness writes (status reads `last_tick`)
LIVENESS_SLACK = 30.0  # seconds past a watcher's promise before it is stuck: thread lookups, log reads, a loaded Mac
MAX_WATCHER_BACKOFF = 60.0
STOP_RESTART_WAIT = 10.0  # seconds a stop waits for a restart under way (launchd kills after 20 s, systemd's unit 60 s)


class Daemon:
    def __init__(self, config: Config, state_dir: Path, *, shared_overrides: dict | None = None,
                 heartbeat: float = HEARTBEAT, liveness_slack: float = LIVENESS_SLACK,
                 door_factory: Callable[..., FrontDoor] = FrontDoor) -> None:
        self.config = config
        self.state_dir = state_dir
        self.overrides = shared_overrides or {}
        self.heartbeat = heartbeat
        self.liveness_slack = liveness_slack
        self.stuck: dict[str, InstanceWatcher] = {}  # watchers in a stuck episode (said once each)
        self.lock = StateDirLock(state_dir)
        self.servers = ServerLocks(state_dir)
        self.watchers: dict[str, InstanceWatcher] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.pending: dict[str, InstanceConfig | None] = {}  # changes waiting for an incident to end
        self.retired: set[asyncio.Task] = set()  # replaced watchers' tasks, awaited at shutdown
        self.door_factory = door_factory
        self.doors: dict[str, tuple[tuple[str, FrontConfig], FrontDoor]] = {}  # name -> ((url, front), serving door)
        self.watcher_errors = 0
        self._errors_logged: set[str] = set()

    def instance_state(self, name: str) -> dict:
        """An instance's tracked state ({} until the daemon has started): for demos and tests."""
        state = getattr(self, "state", None)
        return dict(state.data["instances"].get(name, {})) if state is not None else {}

    # --- start and stop

    async def run(self, stop: asyncio.Event, reload: asyncio.Event | None = None,
                  load_config: Callable[[], Config] | None = None) -> None:
        """Run until ``stop`` is set. Raises ``StateError`` if another daemon holds the state dir
        or it or the bundles dir cannot be used (read-only, not a directory, writable by others,
        ...), ``ConfigError`` if the config is
        not runnable (``check_runnable``: the rule a reload is held to as well)."""
        check_runnable(self.config)
        try:
            self.lock.acquire()
        except OSError as exc:
            raise self._unusable(exc) from None
        try:
            self._take_servers(self.config.instances)
            usable_bundles_dir(self.config, self.state_dir)  # after the state dir: it may hold the bundles dir
            await self._run(stop, reload or asyncio.Event(), load_config)
        finally:
            self.servers.release()
            self.lock.release()

    def _take_servers(self, instances: Iterable[InstanceConfig]) -> None:
        """Hold every instance's address (``serverlock``): ``StateError`` if another daemon
        watches one. Where the runtime dir cannot be used, said once, and not checked."""
        for inst in instances:
            self.servers.take(inst.url, inst.name)
        if self.servers.unavailable and "servers" not in self._errors_logged:
            self._errors_logged.add("servers")
            log.warning("cannot tell whether another daemon watches the same servers: %s", self.servers.unavailable)

    def _unusable(self, exc: OSError) -> StateError:
        """The state dir cannot be used: named with the file that failed (the dir may be fine
        and its lock a directory)."""
        return unusable_state_dir(self.state_dir, exc)

    async def _run(self, stop: asyncio.Event, reload: asyncio.Event, load_config) -> None:
        try:
            self.journal = Journal(self.state_dir)
            self.state = StateFile(self.state_dir, self.journal.path)
            self.state.flush()  # a state dir we cannot write is a start-up error, not a silent one
        except OSError as exc:
            raise self._unusable(exc) from None
        self.journal.start()  # appends from here on: in order, fsynced, in the journal's own thread
        try:
            await self._watch(stop, reload, load_config)
        finally:
            await asyncio.to_thread(self.journal.stop)  # what is queued is written before run returns

    async def _watch(self, stop: asyncio.Event, reload: asyncio.Event, load_config) -> None:
        self.journal.note(Event.DAEMON_START, pid=os.getpid(), instances=[i.name for i in self.config.instances])
        left_open = self.close_left_open()
        bundles = bundles_dir_for(self.config, self.state_dir)
        for path in await asyncio.to_thread(adopt_partials, bundles):
            log.warning("kept an unfinished bundle from an interrupted capture: %s", path)
        now = time.time()
        self.state.set_daemon(pid=os.getpid(), started_at=now, running=True, stopped_at=None, last_tick=now,
                              watcher_errors=0, last_reload=None)
        overrides = {"kernel": KernelCounters(), **self.overrides}  # one view of the kernel for every instance
        self.shared = Shared(journal=self.journal, state=self.state, state_dir=self.state_dir,
                             notifier=Notifier(self.config.notify), capture=self.config.capture,
                             bundles_dir=bundles, **overrides)
        from mlxwatch.daemon.metrics import (
            start_metrics,  # here: mlxwatch.daemon.metrics imports the watchdog package
        )

        # It observes the journal and the state file; metrics settings apply at start only.
        self.metrics = await start_metrics(self.config.metrics, self.journal, self.state, lambda: self.config)
        writer = asyncio.create_task(self.state.run_writer(), name="state-writer")
        await self._sync_doors(self.config.instances)  # before the watchers: their first probe has the door's view
        for inst in self.config.instances:
            self._start(inst)
        for rec in left_open:
            self._resume_restart_in_flight(rec)
        log.info("watching %d instance(s): %s", len(self.tasks), ", ".join(self.tasks) or "none")
        try:
            while not stop.is_set():
                await _wait_any(stop, reload, timeout=min(self.heartbeat, 1.0 if self.pending else
                                                          FRONT_METRICS_EVERY if self.doors else self.heartbeat))
                if writer.done():  # the writer never returns; if it died, say so and start another
                    log.error("state writer stopped: %r; starting it again", writer.exception())
                    writer = asyncio.create_task(self.state.run_writer(), name="state-writer")
                if reload.is_set() and not stop.is_set():
                    reload.clear()
                    await self._reload(load_config)
                self._apply_pending()
                await self._sync_doors([w.inst for w in self.watchers.values()])
                self._read_doors()
                self._check_liveness()
                self.state.set_daemon(last_tick=time.time(), watcher_errors=self.watcher_errors)
        finally:
            await self._shutdown(writer)

    def close_left_open(self) -> list[dict]:
        """Close incidents a stopped daemon left open, saying where each stopped."""
        left = self.journal.open_incidents()
        for rec in left:
            how = "stopped" if rec["event"] == Event.INTERRUPTED else "killed"
            log.warning("%s: incident %s was left open by a %s daemon at '%s' (bundle: %s)",
                        rec["instance"], rec["id"], how, rec.get("state") or rec["event"], rec.get("bundle") or "none")
            self.journal.close_left_open(rec, reason=f"daemon {how} mid-incident at '{rec.get('state') or rec['event']}'")
        return left

    async def _let_restarts_finish(self) -> None:
        """A restart under way at a stop is let finish, up to STOP_RESTART_WAIT: a hook that
        stops the server and then starts it, cut between the two, leaves it down (a new user
        found the hook killed and only `stopped` in the log). One still running after that is
        ended, said in one line."""
        steps = {name: w.restarting for name, w in self.watchers.items()
                 if w.restarting is not None and not w.restarting.done()}
        if not steps:
            return
        log.warning("stopping: waiting up to %gs for the restart of %s to finish", STOP_RESTART_WAIT, ", ".join(steps))
        await asyncio.wait(steps.values(), timeout=STOP_RESTART_WAIT)
        for name, step in steps.items():
            if not step.done():
                log.error("%s: its restart was still running %gs into the stop and is ended: the server may be "
                          "down until mlxwatch starts again", name, STOP_RESTART_WAIT)

    def _resume_restart_in_flight(self, rec: dict) -> None:
        """A daemon stopped while a restart ran: its hook may still be bringing the server up,
        so the watcher gives it ``startup_timeout`` even before a process appears."""
        name = rec.get("instance")
        watcher = self.watchers.get(name) if isinstance(name, str) else None
        at = rec.get("ts")  # the restart was running at this record (its own time is journaled only once it ends)
        if watcher is not None and rec.get("state") in ("restarting", "recovering") and isinstance(at, (int, float)):
            # A wall time from another run: its age, clamped at zero, on this run's monotonic clock.
            watcher.restarted_at, watcher.restart_in_flight = self.shared.clock.mono_of(float(at)), True

    async def _shutdown(self, writer: asyncio.Task) -> None:
        for watcher in self.watchers.values():
            watcher.stop.set()
        await self._let_restarts_finish()
        for task in [*self.tasks.values(), *self.retired]:
            task.cancel()
        await asyncio.gather(*self.retired, return_exceptions=True)
        results = await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for name, result in zip(list(self.tasks), results, strict=True):
            if isinstance(result, Exception):
                log.error("%s: watcher ended with %r during shutdown", name, result)
        for watcher in self.watchers.values():
            if watcher.incident is not None:
                self.journal.record(Event.INTERRUPTED, watcher.incident, state=watcher.detect.state, reason="daemon stopped")
        await self.shared.notifier.drain()
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        self.state.set_daemon(running=False, stopped_at=time.time())
        try:
            await asyncio.to_thread(self.state.flush)
        except OSError as exc:
            log.error("cannot write the state file at stop: %s", exc)
        await self._stop_doors()
        await self.metrics.stop()
        if self.shared.kernel is not None:
            self.shared.kernel.close()
        log.info("stopped")

    # --- supervision

    def _start(self, inst: InstanceConfig) -> None:
        door = self.doors.get(inst.name)
        kept = door is not None and _keeps_door(door[0], (inst.url, inst.front))  # settings, if new, follow in place
        self.watchers[inst.name] = InstanceWatcher(inst, self.shared, asyncio.Event(),
                                                   door=door[1] if door is not None and kept else None)
        self.tasks[inst.name] = asyncio.create_task(self._supervise(inst.name), name=f"watch-{inst.name}")

    async def _supervise(self, name: str) -> None:
        """Run one watcher; if it raises, record it and run it again after a backoff."""
        delay = 1.0
        watcher = self.watchers[name]
        while not watcher.stop.is_set():
            started = time.monotonic()
            try:
                await watcher.run()
                if watcher.stop.is_set():
                    return
                raise RuntimeError("the watcher returned without being stopped")  # silent: a bug, supervised as one
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if time.monotonic() - started > 10 * MAX_WATCHER_BACKOFF:
                    delay = 1.0  # it ran well for a long while: this is a new problem
                self._watcher_failed(watcher, exc, delay)
            watcher.promise(delay)  # waiting out the backoff is not being stuck
            await watcher._sleep(delay)
            delay = min(delay * 2, MAX_WATCHER_BACKOFF)

    def _watcher_failed(self, watcher: InstanceWatcher, exc: Exception, delay: float) -> None:
        self.watcher_errors += 1
        error = f"{type(exc).__name__}: {exc}"
        if error not in self._errors_logged:
            self._errors_logged.add(error)
            log.error("%s: watcher crashed; restarting it in %.0fs", watcher.name, delay, exc_info=exc)
        else:
            log.error("%s: watcher crashed again (%s); restarting it in %.0fs", watcher.name, error, delay)
        self.state.update(watcher.name, watcher_error={"at": time.time(), "error": error})
        self.state.set_daemon(watcher_errors=self.watcher_errors)
        try:
            self.journal.note(Event.WATCHER_ERROR, instance=watcher.name, error=error,
                              incident=watcher.incident.id if watcher.incident else None)
        except OSError as journal_exc:  # a full disk: the log line above is what we have
            log.error("%s: cannot journal the watcher error: %s", watcher.name, journal_exc)

    def _check_liveness(self) -> None:
        """Report each watcher more than ``liveness_slack`` past its promised sign of life (once
        per episode: a log line, a ``watcher_stuck`` record, ``stuck`` in the state file), and
        say when one lives again."""
        now = self.shared.clock.monotonic()
        for name, watcher in self.watchers.items():
            late = watcher.overdue(now)
            if late > self.liveness_slack and name not in self.stuck:
                self.stuck[name] = watcher
                silent = now - (watcher.alive_at or now)
                log.error("%s: watcher stuck: no sign of life for %.0fs (promised within %.0fs) in state '%s'",
                          name, silent, watcher.alive_within, watcher.detect.state)
                self.journal.note(Event.WATCHER_STUCK, instance=name, state=watcher.detect.state,
                                  silent_for=round(silent, 3), promised_within=round(watcher.alive_within, 3),
                                  incident=watcher.incident.id if watcher.incident else None)
                self.state.update(name, stuck={"since": self.shared.clock.wall_of(watcher.alive_at or now),
                                               "state": watcher.detect.state})
            elif late <= self.liveness_slack and self.stuck.get(name) is watcher:
                del self.stuck[name]
                log.warning("%s: watcher alive again (it was stuck)", name)
                self.state.update(name, stuck=None)
        for name in [n for n, w in self.stuck.items() if self.watchers.get(n) is not w]:
            del self.stuck[name]  # retired or dropped: a new watcher starts its own record
            if name in self.watchers:
                self.state.update(name, stuck=None)

    # --- front doors (instances[].front): served beside the watchers, one per instance that has one

    async def _sync_doors(self, instances: Iterable[InstanceConfig]) -> None:
        """Each of ``instances`` (the watchers') with a ``front`` section has its door serving; a door whose
        front settings changed on the same address and server takes them in place; one whose
        instance is gone, or whose address or server URL changed, is stopped (its requests
        drained, then failed loudly) and, if still wanted, started anew. A door that cannot start
        is said once (ERROR, the journal, ``front_error`` in the state file) and tried again at the
        next tick; the watcher watches on without it. Doors follow the watchers: a change that
        waits for an incident to end reaches the door when it reaches the watcher."""
        wanted = {i.name: (i.url, i.front) for i in instances if i.front is not None}
        startup = {i.name: i.probe.startup_timeout for i in instances}  # bounds a door's first Retry-After guess
        for name in [n for n, (spec, _) in self.doors.items() if wanted.get(n) != spec]:
            serving, door = self.doors[name]
            spec = wanted.get(name)
            if spec is not None and _keeps_door(serving, spec):
                door.reconfigure(spec[1])  # the same server and address: no request is cut for a new timeout
                self.doors[name] = (spec, door)
                log.info("%s: front door settings changed in place", name)
                continue
            self.doors.pop(name)
            watcher = self.watchers.get(name)
            if watcher is not None and watcher.door is door:
                watcher.door = None
            await self._stop_door(name, door)
            if name not in wanted:
                self.state.update(name, front=None)
        for name, (url, front) in wanted.items():
            if name not in self.doors:
                door = self.door_factory(name, url, front, clock=self.shared.clock, startup_timeout=startup[name])
                try:
                    await door.start()
                except FrontError as exc:
                    if f"front:{exc}" not in self._errors_logged:
                        self._errors_logged.add(f"front:{exc}")
                        log.error("%s: front door: %s; watching on without it, trying again", name, exc)
                        self.journal.note(Event.FRONT_ERROR, instance=name, error=str(exc))
                        self.state.update(name, front_error=str(exc))
                    continue
                self._errors_logged = {e for e in self._errors_logged if not e.startswith("front:")}
                self.doors[name] = ((url, front), door)
                self.state.update(name, front_error=None)
                log.info("%s: front door on %s for %s", name, listen_address(front.listen), url)
            self.doors[name][1].set_startup_timeout(startup[name])  # a reload may change it
            watcher = self.watchers.get(name)
            if watcher is not None and watcher.door is not self.doors[name][1]:
                watcher.door = self.doors[name][1]  # a new door: the door source takes a new baseline

    def _read_doors(self) -> None:
        """Each door's delivery, read on the event loop (the door's ledger is the loop's), into
        the metrics (their endpoint reads them from its own thread) and the state file (for
        ``mlxwatch status``, riding on the next write)."""
        metrics = self.metrics.metrics
        clock = self.shared.clock
        for name, ((_, front), door) in self.doors.items():
            view = door.view()
            if metrics is not None:
                metrics.on_front(name, view, door.take_observations())
            last = view.last_token_mono
            self.state.update(name, quiet=True, front={
                "listen": listen_address(front.listen), "gate": getattr(door.gate, "value", str(door.gate)),
                "in_flight": sum(1 for r in view.in_flight if r.generation),
                "last_token_at": clock.wall_of(last) if last is not None else None,
                "tokens": view.tokens_total, "outcomes": dict(view.outcomes)})

    async def _stop_door(self, name: str, door: FrontDoor) -> None:
        try:
            await door.stop()
        except Exception as exc:  # a door that fails to stop must not stop the daemon
            log.error("%s: front door did not stop cleanly: %s", name, exc)
        else:
            log.info("%s: front door stopped", name)

    async def _stop_doors(self) -> None:
        doors, self.doors = self.doors, {}
        await asyncio.gather(*(self._stop_door(name, door) for name, (_, door) in doors.items()))

    # --- reload

    async def _reload(self, load_config: Callable[[], Config] | None) -> None:
        if load_config is None:
            return
        try:
            new = check_runnable(await asyncio.to_thread(load_config))  # what `run` would refuse, refused
        except ConfigError as exc:
            self._reloaded(False, f"config reload failed, keeping the old config: {exc}")
            return
        if new.state_dir != self.config.state_dir:
            self._reloaded(False, f"config reload failed, keeping the old config: {new.path or self.config.path}: "
                                  f"state_dir changed from {self.config.state_dir} to {new.state_dir} "
                                  "(restart the daemon to move its state)")
            return
        try:
            bundles = await asyncio.to_thread(usable_bundles_dir, new, self.state_dir)
            self._take_servers(new.instances)
        except StateError as exc:
            self.servers.keep_only([i.url for i in self.config.instances])
            self._reloaded(False, f"config reload failed, keeping the old config: {exc}")
            return
        self.servers.keep_only([i.url for i in new.instances])
        self.config = new
        self.shared.notifier = Notifier(new.notify)
        self.shared.capture = new.capture
        self.shared.bundles_dir = bundles
        wanted = {i.name: i for i in new.instances}
        for name, watcher in self.watchers.items():
            if wanted.get(name) != watcher.inst:
                self.pending[name] = wanted.get(name)
            elif self.pending.pop(name, None) is not None:  # reloaded back to what it runs: the waiting change is void
                self._errors_logged.discard(f"pending:{name}")
        for name, inst in wanted.items():
            if name not in self.watchers:
                self.pending[name] = inst  # started by _apply_pending: maybe after an incident ends
        self._apply_pending()
        self._reloaded(True, f"config reloaded: watching {', '.join(self.watchers) or 'none'}")

    def _reloaded(self, ok: bool, message: str) -> None:
        """Record the outcome where each reader looks (as blackbox_exporter's SafeConfig does):
        one log line, the journal, and ``last_reload`` in the state file (the metrics' gauge)."""
        (log.info if ok else log.warning)("%s", message)
        try:
            self.journal.note(Event.CONFIG_RELOAD, ok=ok, message=message)
        except OSError as exc:  # a full disk: the log line and the state file still say it
            log.error("cannot journal the config reload: %s", exc)
        self.state.set_daemon(last_reload={"at": time.time(), "ok": ok, "message": message})

    def _apply_pending(self) -> None:
        """Apply changed, added and removed instances, except where an incident is open.

        A change waits for its own watcher's incident; a new instance waits for any open
        incident on its address (a rename mid-incident must not open a second incident, and
        run a second restart, for the same outage). A removed instance whose address no
        instance of the config takes over is dropped at once: waiting for its incident to end
        would wait forever for a server that stays hung, with ``status`` reporting it."""
        for name, inst in list(self.pending.items()):
            watcher = self.watchers.get(name)
            if inst is None and watcher is not None and not any(
                    same_address(watcher.inst.url, i.url) for i in self.config.instances):
                self._errors_logged.discard(f"pending:{name}")
                del self.pending[name]
                self._drop(name)
                continue
            busy = watcher is not None and watcher.busy_with_incident
            if inst is not None and not busy:
                busy = any(w.busy_with_incident and same_address(w.inst.url, inst.url)
                           for w in self.watchers.values())
            if busy:
                if f"pending:{name}" not in self._errors_logged:
                    self._errors_logged.add(f"pending:{name}")
                    log.warning("%s: config changed mid-incident; applying it when the incident ends", name)
                continue
            self._errors_logged.discard(f"pending:{name}")
            del self.pending[name]
            if inst is not None:
                if watcher is not None:
                    self._retire(name)
                self._start(inst)
            else:
                self._drop(name)

    def _retire(self, name: str) -> InstanceWatcher:
        """Stop a watcher: its task ends at its next await (no record is written after that:
        nothing in a watcher catches the cancellation) and is awaited at shutdown."""
        watcher = self.watchers.pop(name)
        watcher.stop.set()
        task = self.tasks.pop(name)
        task.cancel()
        self.retired.add(task)
        task.add_done_callback(self.retired.discard)
        return watcher

    def _drop(self, name: str) -> None:
        """An instance removed from the config: watcher stopped, its open incident closed as
        ``removed``, its entry gone from the state file (``status`` no longer reports it)."""
        watcher = self._retire(name) if name in self.watchers else None
        if watcher is not None and watcher.incident is not None:
            log.warning("%s: removed from the config mid-incident: no longer watched; incident %s closed as removed",
                        name, watcher.incident.id)
            self.journal.record(Event.CLOSED, watcher.incident, reason="removed", stopped_at_event=watcher.detect.state)
        else:
            log.info("%s: removed from the config: no longer watched", name)
        self.state.data["instances"].pop(name, None)
        self.state.dirty.set()


def usable_bundles_dir(config: Config, state_dir: Path) -> Path:
    """The config's bundles dir, made or checked as ``private_dir`` does (ours, not writable by
    others): a capture there would fail and lose its evidence, so ``run`` and a reload refuse it
    up front. Raises ``StateError`` (one line naming the dir and the fix)."""
    bundles = bundles_dir_for(config, state_dir)
    try:
        return private_dir(bundles)
    except OSError as exc:
        raise StateError(f"cannot use the bundles dir {bundles}: {exc.strerror or exc}") from None


async def _wait_any(*events: asyncio.Event, timeout: float) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def _keeps_door(serving: tuple[str, FrontConfig], wanted: tuple[str, FrontConfig | None]) -> bool:
    """A door serving ``serving`` (server URL, front settings) stays for ``wanted``: the same
    server on the same address, other settings taken in place (``FrontDoor.reconfigure``)."""
    return wanted[1] is not None and serving[0] == wanted[0] and serving[1].listen == wanted[1].listen
