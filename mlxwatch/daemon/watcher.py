"""One instance's watch loop: probe, judge, and on a verdict capture -> restart -> recover.

Each instance runs in its own task with its own HTTP connections, so a slow, refused or wedged
instance never delays another's probes or takes its connections. At most one probe per
instance is in flight: a probe that failed at its first-token deadline keeps its stream open
and read until the server ends it or ``probe.timeout`` after sending, and longer while the server
shows progress or delivery (mlx-lm notices a closed stream only when it next writes, so an
abandoned probe would stay in its batch and lose its reply); a token on it is a delivery, and a
verdict waits for those streams unless nothing flows anywhere.

What the server delivers is read through one seam (``mlxwatch.evidence``): the watcher asks
every source the same question, between two instants, and knows none of their details. While a
probe waits it asks every second: nothing flowing to any client for ``probe.quiet_window`` (where
the kernel's counters show every client) ends the wait early; between probes it asks for a
stall, which makes the instance suspect at once.

Blocking work (log and kernel reads, process lookups) runs in threads. A healthy cycle costs one
HTTP exchange and, with kernel sight, one shared kernel reading every few seconds. Every state
change is logged (one line), journaled (one fsynced record) and marked for the state file. On a
verdict the order is fixed: the server is proven (see ``mlxwatch.host.process``), the bundle is
captured while it is still in its bad state, and only then is anything restarted.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

from mlxwatch.capture import Bundle, CaptureRequest, capture_bundle, capture_probe_timeouts
from mlxwatch.capture.death import GoneProcess
from mlxwatch.clock import Clock, Stamp
from mlxwatch.config import CaptureConfig, InstanceConfig
from mlxwatch.daemon.frontwatch import FrontWatch
from mlxwatch.daemon.memwatch import MemoryLook, MemoryWatch
from mlxwatch.daemon.notify import Notifier
from mlxwatch.errors import MlxwatchError
from mlxwatch.evidence import Evidence, Seeing, Stall, Window, sources
from mlxwatch.evidence.cadence import Cadence, Speed
from mlxwatch.evidence.group import GroupSource
from mlxwatch.evidence.log import LogSource
from mlxwatch.evidence.probes import ProbeStreams
from mlxwatch.evidence.sight import Sight
from mlxwatch.front.door import FrontDoor
from mlxwatch.host.group import Group, find_group, refresh
from mlxwatch.host.memuse import read_memory
from mlxwatch.host.sockets import KernelCounters
from mlxwatch.host.process import ProcessIdentity, ServerLookup, lookup_instance, lookup_server, short_cmdline
from mlxwatch.journal.incidents import Event, Incident, Journal
from mlxwatch.journal.state import StateFile, take_resume
from mlxwatch.probes import PROBE_PROMPT, CheckReport, make_client, run_check
from mlxwatch.restart import lookagain
from mlxwatch.restart.flapguard import FlapGuard
from mlxwatch.restart.methods import (
    OK,
    RestartContext,
    RestartOutcome,
    describe,
    restart,
)
from mlxwatch.verdict import policy

log = logging.getLogger("mlxwatch.watchdog")

RECOVERY_PROBE_EVERY = 5.0
SETTLE_POLL = 0.5  # how often the look-again looks for a new server after the old one went
FIRST_PROBE_SPREAD = 5.0  # each instance's first probe comes within min(interval, this): spread out
KEPT_FAILED_REPORTS = 20
LOOK_EVERY = 1.0  # seconds between looks while a probe waits or the instance is suspect
WATCH_EVERY = 2.0  # ... while healthy (each source reads at its own rate; a look costs no I/O otherwise)
CONFIRM_AFTER_CUT = 1.0  # a failure the evidence ended (nothing flowed anywhere) is confirmed this soon


@dataclass
class Shared:
    """What all watchers share. The daemon swaps ``notifier``, ``capture`` and ``bundles_dir``
    in place on a reload, so a changed top-level setting reaches every watcher at once.
    ``clock``: its monotonic readings time every duration (backoff, window, cooldown, grace,
    startup, the shim's re-reads), its wall readings go to records only (``mlxwatch.clock``)."""

    journal: Journal
    state: StateFile
    state_dir: Path
    notifier: Notifier
    capture: CaptureConfig
    bundles_dir: Path
    capture_fn: Callable[[CaptureRequest], Awaitable[Bundle]] = capture_bundle
    restart_fn: Callable[[RestartContext], Awaitable[RestartOutcome]] = restart
    lookup_fn: Callable[[str, Path | None], ServerLookup] = lookup_server  # blocking; run in a thread
    make_client: Callable[[], httpx.AsyncClient] = make_client
    clock: Clock = field(default_factory=Clock)
    kernel: KernelCounters | None = None  # kernel sight, one for the daemon (None: off)


@dataclass
class InstanceWatcher:
    inst: InstanceConfig
    shared: Shared
    stop: asyncio.Event
    detect: policy.Detection = field(init=False)
    guard: FlapGuard = field(init=False)
    log_source: LogSource = field(init=False)
    streams: ProbeStreams = field(init=False)  # failed probes' streams, read on
    group_source: GroupSource = field(init=False)  # the mlx.launch group the server is rank 0 of, if any
    front: FrontWatch = field(init=False)  # what a verdict means for the front door's clients
    sources: sources.Sources = field(init=False)  # every evidence source (mlxwatch.evidence.sources)
    sight: Sight = field(init=False)  # every evidence source, asked as one
    cadence: Cadence = field(init=False)  # the server's own pace, learned (kept in the state file)
    identity: ProcessIdentity | None = None  # recorded when first seen healthy; proven before use
    incident: Incident | None = None
    failed_reports: list[CheckReport] = field(default_factory=list)
    seen_healthy: bool = False  # since the daemon started or the last restart
    restarted_at: float | None = None  # monotonic
    incident_began: float | None = None  # the open incident's first failure (monotonic)
    loading_seen: tuple[tuple[int, float], float] | None = None  # a loading process and when first seen (monotonic)
    restart_in_flight: bool = False  # a stopped daemon left a restart running: its hook may still be at work
    restarting: asyncio.Task | None = None  # the restart under way (a stop lets it finish, up to a bound)
    lingering: asyncio.Task | None = None  # the capture probe's stream, still being read
    probe_sent: float | None = None  # monotonic: when the last probe was sent
    judged_at: float | None = None  # monotonic: the last failed probe's judgement (the next window starts there)
    cut: bool = False  # the last probe's wait was ended early by the evidence (nothing flowed)
    kernel_sight: str | None = None  # "ok", or why the kernel's counters cannot be read (status shows it)
    saved_group: dict | None = None  # the group as the state file has it
    pace_shown: dict | None = None  # what the server owes and by when, as the state file has it
    saved_kernel: dict | None = None  # what kernel sight saw, as the state file has it (status shows it)
    slow_said: bool = False  # this slow episode was journaled and notified (once, until healthy or a verdict)
    client: httpx.AsyncClient | None = None
    said: set[str] = field(default_factory=set)  # notes already logged once
    door: FrontDoor | None = None  # the instance's front door (the daemon starts and stops it; see "front door" below)
    alive_at: float | None = None  # monotonic: the last sign of life (a cycle done, an incident step begun)
    alive_within: float = 0.0  # ... and the most it promised to take until the next one
    memory: MemoryWatch = field(init=False)  # the server's memory trend (memory.*)
    memory_pid: int | None = None  # the process the trend is about
    gone_server: ProcessIdentity | None = None  # the verdict's server, found stopped: its memory is awaited before a restart
    delivered_at: float | None = None  # monotonic: the first token of the probe that proved recovery

    def __post_init__(self) -> None:
        p, r = self.inst.probe, self.inst.restart
        self.detect = policy.Detection(p.failures, p.grace_ceiling, on_refused=self._policy_refused)
        saved = self.shared.state.instance(self.inst.name)
        self.guard = FlapGuard(r.budget, r.window, r.backoff, r.max_backoff, r.cooldown)
        for note in self.guard.restore(saved, self.shared.clock):  # budget and cooldown outlive the daemon
            log.warning("%s: %s", self.inst.name, note)
        if self.guard.gave_up_at is not None:
            self.detect.gave_up()
        server = saved.get("server")
        if isinstance(server, dict) and saved.get("url") == self.inst.url:
            try:
                self.identity = ProcessIdentity.from_dict(server)  # proven again (alive) before any use
            except (KeyError, TypeError, ValueError, IndexError):
                self.identity = None
        self.front = FrontWatch(self.name, lambda: self.door if self.inst.front is not None else None,
                                lambda: self.inst.front, self.shared.journal, self.shared.clock.monotonic)
        group = GroupSource(identity=lambda: self.identity, locate=lambda: self._lookup().identity,
                            followed=self._follow_group, log=lambda: self.inst.log or self.log_source.tracker.log)
        self.sources = sources.build(Seeing(inst=lambda: self.inst, identity=lambda: self.identity,
                                            door=lambda: self.door, kernel=self.shared.kernel,
                                            clock=self.shared.clock.monotonic), group)
        self.streams, self.log_source, self.group_source = self.sources.streams, self.sources.log, self.sources.group
        self.cadence = Cadence(Speed.from_dict(saved.get("cadence")) if saved.get("url") == self.inst.url else Speed())
        self.sight = Sight(self.sources.all, self.cadence)
        self.memory = MemoryWatch(self.inst.memory)

    @property
    def name(self) -> str:
        return self.inst.name

    def _server_pid(self) -> int | None:
        """The recorded server's PID, for the log follower: does it still write a rotated log?"""
        return self.identity.pid if self.identity is not None else None

    def _lookup(self) -> ServerLookup:
        """``lookup_fn`` for this instance (blocking: run it in a thread). An instance restarted by
        launchd is looked up by its label too, and without a configured ``log`` follows the job's
        StandardErrorPath that launchd names."""
        found = lookup_instance(self.inst, self.shared.lookup_fn)
        if self.inst.log is None and found.log is not None and self.log_source.follow(found.log):
            log.info("%s: following %s (the launchd job's log)", self.name, found.log)
        return found

    @property
    def busy_with_incident(self) -> bool:
        """An incident is open (any state, awaiting recovery and given-up included)."""
        return self.incident is not None

    # --- liveness: the supervisor reports a watcher that breaks its promise (docs/deciding.md)

    def cycle_bound(self) -> float:
        """The longest one cycle may take: a check ends within ``timeout`` + ``endpoint_timeout``
        (``run_check``); lookups and log reads ride on the supervisor's slack."""
        p = self.inst.probe
        return p.timeout + p.endpoint_timeout

    def promise(self, within: float) -> None:
        """A sign of life, and a promise of the next one within ``within`` seconds plus a cycle."""
        self.alive_at, self.alive_within = self.shared.clock.monotonic(), within + self.cycle_bound()

    def overdue(self, now: float) -> float:
        """Seconds past the promised next sign of life (<= 0: on time), at monotonic ``now``."""
        if self.alive_at is None:
            return 0.0
        return now - self.alive_at - self.alive_within

    def _step_bound(self, event: Event, extra: dict) -> float:
        """How long an incident's step may take beyond a cycle: it is not "stuck" meanwhile."""
        if event == Event.CAPTURING:
            return self.shared.capture.ceiling
        if event == Event.BACKOFF:
            wait = extra.get("wait")
            return float(wait) if isinstance(wait, (int, float)) else 0.0
        if event == Event.RESTARTING:
            return self.inst.restart.timeout + self.inst.restart.grace
        return 0.0

    # --- the loop

    async def run(self) -> None:
        """Watch until ``stop`` is set. The daemon's supervisor calls this again after a crash."""
        self.promise(self.inst.probe.interval)  # the first cycle starts within its spread (below), at most an interval
        self._after_crash()
        if not self.seen_healthy and self.identity is not None:
            # The process an earlier run saw healthy is still running: it is not loading.
            self.seen_healthy = await asyncio.to_thread(self.identity.alive)
        async with self.shared.make_client() as client:
            self.client = client
            try:
                await self.sight.prime()
                self._save()
                await self._sleep(random.uniform(0, min(self.inst.probe.interval, FIRST_PROBE_SPREAD)))
                loop = asyncio.get_running_loop()
                while not self.stop.is_set():
                    started, was_healthy = loop.time(), self.detect.state == policy.HEALTHY
                    await self.cycle()
                    delay = self.next_delay() * random.uniform(0.9, 1.1)
                    if was_healthy and self.detect.state == policy.HEALTHY:
                        # On schedule: a healthy instance's interval runs from probe start to probe
                        # start, so a probe's own duration does not stretch it.
                        delay = max(0.0, started + delay - loop.time())
                    self.promise(delay)  # a cycle completed: the next one ends within its sleep and a cycle
                    await self._sleep_watching(delay)
            finally:
                await self._end_linger()
                self.client = None

    def _after_crash(self) -> None:
        """A previous ``run`` died mid-incident: close that incident, start over as starting."""
        if self.incident is not None and self.detect.state != policy.GAVE_UP:
            self.shared.journal.record(Event.CLOSED, self.incident, reason="watcher error mid-incident; watching again")
            self.incident = None
            self.front.open("incident closed")
        if self.detect.state not in (policy.GAVE_UP, policy.STARTING):
            self.detect.watching_again()
            self.seen_healthy = False

    def next_delay(self) -> float:
        """A suspect server is probed again soon: one failure is a question, not an answer. A
        failure the evidence ended (nothing sent to any client for ``quiet_window``) already
        watched the server that long, so the confirming probe goes at once: with no client
        traffic this took a hang from about 41 s to about 31 s at the defaults (bench/RESULTS.md,
        "Kernel sight at the defaults")."""
        p = self.inst.probe
        if self.detect.state not in policy.PROBING_SOON:
            return p.interval
        soon = min(p.interval, p.suspect_interval)
        return min(soon, CONFIRM_AFTER_CUT) if self.cut else soon

    async def _sleep(self, seconds: float) -> None:
        """Sleep that a stop request interrupts."""
        try:
            await asyncio.wait_for(self.stop.wait(), timeout=max(0.0, seconds))
        except TimeoutError:
            pass

    async def probe(self, delivered_since: float | None = None) -> CheckReport:
        """One check. While it waits the evidence is looked at every ``LOOK_EVERY`` s
        (``_cut_reason``): nothing flowing to anyone, the probe's own stream included (since
        its last token), past the server's pace ends the wait early, as a failure; so does,
        with ``delivered_since`` (a recovery's wait) and no token yet, a delivery to any client
        since then: the caller has its answer. A failed probe's stream is read on until the server
        ends it or ``probe.timeout`` after it was sent, and longer while the server shows
        progress or delivery (``_hold_streams``): the server serves that reply anyway (mlx-lm
        notices a closed stream only when it writes), and a token on it is a delivery. A healthy
        answer ends the streams still open: nothing they say matters any more."""
        loop = asyncio.get_running_loop()
        check: asyncio.Future[CheckReport] | None = None
        try:
            if self.detect.state == policy.HEALTHY:
                await self.sight.prime()  # evidence is judged from here on: what came before is history
            p = self.inst.probe
            assert self.client is not None
            cut: asyncio.Future[str] = loop.create_future()
            opened = self.shared.clock.monotonic()
            await self._look(opened, end=opened)  # the window opens: what the sources find now came before it
            self.cut, self.probe_sent = False, opened
            own_token: float | None = None  # monotonic: the probe's last token (its stream is no client's)

            def token() -> None:
                nonlocal own_token
                own_token = self.shared.clock.monotonic()

            check = asyncio.ensure_future(run_check(
                self.client, self.inst.url, first_token_timeout=p.first_token_timeout, timeout=p.timeout,
                max_tokens=p.max_tokens, endpoint_timeout=p.endpoint_timeout, read_until=p.timeout, cut=cut,
                on_token=token))
            while not check.done():
                await asyncio.wait({check}, timeout=LOOK_EVERY)
                if check.done() or cut.done():
                    continue
                reason = await self._cut_reason(opened if own_token is None else own_token)
                if (not reason and delivered_since is not None and own_token is None
                        and (await self._look(delivered_since)).delivered):
                    reason = "a client was delivered to meanwhile"
                if reason and not cut.done():
                    self.cut = True
                    cut.set_result(reason)
            report = check.result()
        except BaseException:
            if check is not None and not check.done():
                check.cancel()
                await asyncio.gather(check, return_exceptions=True)
            await self._end_linger()
            raise
        if report.healthy:
            await self._end_linger()
        else:
            self.streams.add(report)
        return report

    async def _look(self, start: float, probe: CheckReport | None = None, suspect: bool = True,
                    end: float | None = None) -> Evidence:
        """Every source's evidence from ``start`` to ``end`` (now); notes said once, open
        streams held. What a source reads now is dated ``end``: a window that starts there
        next does not count it again."""
        now = self.shared.clock.monotonic() if end is None else end
        self.cadence.configure(self.inst.probe.quiet_window, self.inst.probe.grace_ceiling)
        evidence = await self.sight.look(Window(start, now, probe=probe, suspect=suspect))
        for note in evidence.notes:
            self._say(note)
        seen = evidence.detail.get("kernel")
        kernel = self.kernel_sight if seen is None else seen.get("unavailable", "ok")
        group = self.group_source.group.to_dict() if self.group_source.group is not None else None
        pace = self._pace_shown(evidence)
        if kernel != self.kernel_sight or group != self.saved_group or _owes(pace) != _owes(self.pace_shown):
            self.kernel_sight, self.pace_shown = kernel, pace
            self._save()  # status and the rank metrics read them from the state file
        elif pace != self.pace_shown or self.cadence.changed:  # a due time moved, or learning: with the next write
            self.pace_shown = pace
            self.shared.state.update(self.name, quiet=True, **self._cadence_saved())
        if seen is not None and "unavailable" not in seen:
            self._save_kernel(seen)
        self._hold_streams(evidence, now)
        return evidence

    async def _cut_reason(self, sent: float) -> str | None:
        """Why the probe should stop waiting now (``sent``: when it was sent, or its last token), or None:
        nothing flowed to any client (nor any other sign of work) for ``probe.quiet_window``,
        where a source sees every client; or a source's own bound (a stall at the front door)."""
        evidence = await self._look(sent)
        await self._stall_seen(evidence.stall, probing=True)
        now = self.shared.clock.monotonic()
        if evidence.cut_after is not None and now - sent >= evidence.cut_after:
            return evidence.stall.reason if evidence.stall else "the front door delivered nothing meanwhile"
        quiet = evidence.silent_past_pace(now, sent, self.inst.probe.quiet_window)
        if quiet is not None:
            return f"nothing sent to any client for {quiet:.0f}s ({_pace_text(evidence, self.inst.probe.quiet_window)})"
        return None

    def _pace_record(self) -> dict:
        """For the journal: this server's learned pace and what it owed at the last look."""
        pace = self.sight.pace
        shown = pace.to_dict(self.shared.clock.monotonic(), self.shared.clock.wall()) if pace is not None else None
        return {"learned": self.cadence.speed.to_dict(), "owed": shown}

    def _pace_shown(self, evidence: Evidence) -> dict | None:
        """What the server owes and by when, as status shows it (None: nothing beyond the floor)."""
        pace = evidence.pace
        if pace is None or (pace.due is None and not pace.overdue):
            return None
        return pace.to_dict(self.shared.clock.monotonic(), self.shared.clock.wall())

    def _hold_streams(self, evidence: Evidence, now: float) -> None:
        """The failed probes' streams stay open while the server shows progress or delivery
        (anything flowed within its pace: ``quiet_window``, or longer while a sign is due), up to
        ``grace_ceiling`` after the first failure: closing one would cost its reply and leave the
        server a broken pipe."""
        if evidence.last_flow is None:
            return
        if evidence.pace is not None and not evidence.pace.allows(now, evidence.last_flow):
            return
        if evidence.pace is None and now - evidence.last_flow > self.inst.probe.quiet_window:
            return
        p = self.inst.probe
        first = self.detect.first_failure_at if self.detect.first_failure_at is not None else now
        left = first + p.grace_ceiling - now
        if left > 0:
            self.streams.hold(asyncio.get_running_loop().time() + min(left, p.quiet_window + LOOK_EVERY))

    async def _await_late_delivery(self) -> list[str]:
        """Before a verdict: wait for the failed probes' streams still open, until one delivers,
        all end, the evidence shows delivery elsewhere (returned as such), nothing flows
        anywhere for ``quiet_window`` (where a source sees every client), or stop. Returns the
        deliveries (none: the verdict stands)."""
        loop = asyncio.get_running_loop()
        sent = self.probe_sent if self.probe_sent is not None else self.shared.clock.monotonic()
        while not self.stop.is_set():
            if lines := self.streams.count(self.shared.clock.monotonic()):
                return lines
            tasks = self.streams.tasks()
            evidence = await self._look(sent)  # first: an answer to a client counts, open streams or not
            now = self.shared.clock.monotonic()
            if evidence.delivered:
                return list(evidence.delivered)
            if not tasks:
                return []
            quiet = evidence.silent_past_pace(now, sent, self.inst.probe.quiet_window)
            if quiet is not None or (evidence.cut_after is not None and now - sent >= evidence.cut_after):
                return []  # nothing flows anywhere: no late token is coming
            self.promise(self.inst.probe.timeout)  # a bounded step: each stream ends by its bound
            waiting = loop.create_task(self.stop.wait())
            try:
                await asyncio.wait({*tasks, waiting}, timeout=LOOK_EVERY, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
        return []

    async def _end_linger(self) -> None:
        task, self.lingering = self.lingering, None
        await self.streams.end()
        await _end(task)

    async def cycle(self) -> None:
        now = self.shared.clock.monotonic()
        if take_resume(self.shared.state_dir, self.name):
            self._resume("resumed by `mlxwatch resume`")
        elif self.detect.state == policy.GAVE_UP and self.guard.cooled_down(now):
            self._resume(f"cool-down of {self.inst.restart.cooldown:g}s passed")
        report = await self.probe()
        now = self.shared.clock.monotonic()
        self.shared.state.update(self.name, quiet=True, last_probe=_probe_summary(report, self.shared.clock.wall()))
        if report.healthy:
            g = report.generation
            self.cadence.probe_done(g.ttft, g.gaps, g.prompt_tokens, prompt_bytes=len(PROBE_PROMPT),
                                    cached_tokens=g.cached_tokens)
            if g.prompt_tokens:  # the probe's own prompt in the log is no one else's progress
                self.log_source.tracker.probe_totals.add(g.prompt_tokens)
            await self._healthy(report, now)
            await self._watch_memory()
            return
        log.info("%s: probe failed: %s", self.name, _one_line(report.reason))
        if self.detect.state == policy.GAVE_UP or self.incident is not None:
            self.streams.count(now)  # lets go of the failed probes' streams that ended
            return  # gave up, or waiting for a server we may not restart to come back by itself
        if not self.seen_healthy and await self._starting(now):
            return
        # The window: since the previous failed probe's judgement (the wait between included), or
        # since this probe was sent when it is the first failure.
        start = self.judged_at if self.judged_at is not None else (self.probe_sent or now)
        evidence = await self._look(start, probe=report, end=now)
        self.judged_at = now
        self.failed_reports = [*self.failed_reports[-(KEPT_FAILED_REPORTS - 1):], report]
        for line in (*evidence.seen, *evidence.delivered):
            log.info("%s: %s", self.name, line)
        delivered, progress = list(evidence.delivered), list(evidence.progress)
        if evidence.stall is not None and not delivered and not progress:
            log.info("%s: %s", self.name, evidence.stall.reason)
            self.detect.stall_seen()  # the stall was the first failure: this one is decisive
        if not delivered and not self.cut and self.detect.would_judge(now, progress):
            # A verdict waits for the window's failed probes' streams: a token on one is a
            # delivery (slow, never hung), so it must not be cut off. Not when the evidence ended
            # this probe's wait: nothing flowed to anyone for that long.
            delivered += await self._await_late_delivery()
            if self.stop.is_set():
                return
            now = self.shared.clock.monotonic()
        was = self.detect.state
        if not self.detect.failure(now, progress, delivered):
            if self.detect.state == policy.SLOW:
                self._slow(was)
            elif progress:
                log.info("%s: no token, but progress holds the verdict: %s", self.name, "; ".join(progress))
            self._save()
            return
        await self.handle_verdict(now)

    # --- memory (memory.*): the trend, its warning, the opt-in early restart

    async def _watch_memory(self) -> None:
        """Read the healthy server's memory and judge its trend: warn once an episode when it
        says out of memory within ``warn_within``; with ``restart_early``, restart it at a quiet
        moment once within ``restart_within``."""
        ident = self.identity
        if self.inst.memory.watch == "off" or ident is None:
            return
        self.memory.config = self.inst.memory  # a reload's settings apply at once
        if ident.pid != self.memory_pid:
            self.memory.forget()
            self.memory_pid = ident.pid
        reading = await asyncio.to_thread(read_memory, ident.pid)
        if reading is None:
            return
        look = self.memory.add(self.shared.clock.monotonic(), reading)
        self.shared.state.update(self.name, quiet=True, memory=look.to_dict())
        if look.warn:
            log.warning("%s: %s", self.name, look.text())
            payload = {"instance": self.name, "url": self.inst.url, "pid": ident.pid, **look.to_dict()}
            self.shared.journal.note(Event.MEMORY_LOW, **payload)
            self.shared.notifier.fire("memory_low", payload)
        if look.restart:
            await self._restart_early(ident, look)

    async def _restart_early(self, ident: ProcessIdentity, look: MemoryLook) -> None:
        """Drain and restart before the server runs out of memory: only at a quiet moment (no
        request in flight at the front door, nothing sent to any client for ``quiet_window``),
        known from a source that sees every client (kernel sight, the door), and only as the
        flap guard allows; else the next reading asks again."""
        now = self.shared.clock.monotonic()
        evidence = await self._look(now - self.inst.probe.quiet_window, suspect=False)
        busy = self.door is not None and bool(self.door.view().in_flight)
        flowing = evidence.last_flow is not None and now - evidence.last_flow < self.inst.probe.quiet_window
        blind = evidence.quiet_for(now, since=now) is None  # no source sees every client: never a guess
        if busy or flowing or blind or self.guard.exhausted(now) or self.guard.wait_before_restart(now) > 0:
            why = ("a request in flight" if busy or flowing else
                   "no source sees every client's stream (kernel sight or a front door)" if blind else
                   "the restart budget or its backoff")
            log.info("%s: memory: the early restart waits for a quiet moment (%s)", self.name, why)
            return
        self.memory.asked_restart()
        at = self.shared.clock.now()
        self.guard.record_restart(at)
        log.warning("%s: restarting before it runs out of memory (%s)", self.name, look.text())
        self.shared.journal.note(Event.MEMORY_RESTART, instance=self.name, pid=ident.pid, **look.to_dict())
        self.front.restarting("an early restart before the server runs out of memory")
        try:
            outcome = await self.shared.restart_fn(RestartContext(self.inst, ident, None, await self._group_of(ident)))
            log.warning("%s: early restart: %s", self.name, outcome.detail)
        except (MlxwatchError, OSError) as exc:
            log.error("%s: early restart failed: %s", self.name, _one_line(str(exc)))
        finally:
            self.front.open("early restart done")
        # The new process loads with its startup allowance, as after any restart of ours.
        self.seen_healthy, self.restarted_at, self.identity, self.restart_in_flight = False, at.mono, None, True
        self._save()

    async def _starting(self, now: float) -> bool:
        """Not yet seen healthy: is a server process for this instance still loading?

        True (no verdict) while such a process exists and is younger than ``startup_timeout``
        (or the last restart is). A process that has run longer than that is not loading."""
        found = await asyncio.to_thread(self._lookup)
        if found.stranger:
            self._say(f"{found.stranger}: not this instance's server; it will not be touched")
        proc = found.identity or found.loading
        if proc is None:
            if self.restart_in_flight and self.restarted_at is not None \
                    and now - self.restarted_at < self.inst.probe.startup_timeout:
                log.info("%s: starting: the restart a stopped daemon left running may still be at work", self.name)
                return True
            return False
        # The OS gives a process's start as a wall time: its age is clamped at zero and never
        # less than since the daemon first saw it loading (a clock stepped back cannot stretch
        # the allowance past startup_timeout), nor more than since the last restart.
        key = (proc.pid, proc.create_time)
        if self.loading_seen is None or self.loading_seen[0] != key:
            self.loading_seen = (key, now)
        up = max(self.shared.clock.wall() - proc.create_time, now - self.loading_seen[1], 0.0)
        if self.restarted_at is not None:
            up = min(up, now - self.restarted_at)
        if up >= self.inst.probe.startup_timeout:
            return False
        if self.detect.state != policy.STARTING:
            self.detect.starting()
            self._save()
        log.info("%s: starting (%s, up %.0fs): no verdict before %.0fs", self.name, proc.describe(), up,
                 self.inst.probe.startup_timeout)
        return True

    async def _healthy(self, report: CheckReport, now: float) -> None:
        if self.incident is not None:  # came back by itself (restart none, or after giving up)
            await self._recovered(now, "recovered without a restart")
            return
        if not self.seen_healthy:
            await self._first_healthy()
        if self.detect.state != policy.HEALTHY:
            log.info("%s: healthy (first token after %.2fs)", self.name, report.generation.ttft or 0)
            if self.slow_said:
                self.slow_said = False
                self.shared.journal.note(Event.SLOW_ENDED, instance=self.name, ttft=report.generation.ttft)
            self._back_to_healthy()

    def _slow(self, was: str) -> None:
        """Delivered, but later than the deadlines: degraded, never restarted. Said (logged,
        journaled, notified) when it starts; the state file and metrics show it meanwhile."""
        for line in self.detect.delivered:
            log.info("%s: slow: %s", self.name, line)
        if was == policy.SLOW or self.slow_said:
            return
        self.slow_said = True
        log.warning("%s: SLOW: it delivers, but later than the deadlines (first-token %gs); not hung, "
                    "not restarted: %s", self.name, self.inst.probe.first_token_timeout, "; ".join(self.detect.delivered))
        payload = {"instance": self.name, "url": self.inst.url, "state": policy.SLOW,
                   "evidence": list(self.detect.delivered), "reason": self.failed_reports[-1].reason}
        self.shared.journal.note(Event.SLOW, **payload)
        self.shared.notifier.fire("slow", payload)

    async def _first_healthy(self) -> None:
        """Record which process serves this instance: looked up once, here, not per probe."""
        self.seen_healthy, self.restart_in_flight = True, False
        if self.identity is not None and await asyncio.to_thread(self.identity.still_ours, self.inst.url):
            return
        found = await asyncio.to_thread(self._lookup)
        self.identity = found.identity
        if found.identity is not None:
            self.cadence.speed.take_cmdline(found.identity.cmdline)
        if found.identity is None:
            self._say(f"cannot prove which process serves {self.inst.url} ({found.detail}); it will not be "
                      "signalled or captured (set pid_file if the server's command line is not mlx-lm's)")
        else:
            log.info("%s: server is %s", self.name, found.identity.describe())

    def _back_to_healthy(self, **fields: object) -> None:
        """Every way back to healthy: a given-up instance may restart again, the failure count
        starts over."""
        if self.detect.state == policy.GAVE_UP:
            self.guard.resume()
        self.detect.success()
        self.failed_reports.clear()
        self.judged_at = None
        self._save(**fields)

    # --- verdict -> capture -> restart -> recover

    async def _prove_server(self) -> tuple[ProcessIdentity | None, str | None]:
        """The recorded server if it still runs; else one proven by a fresh lookup; else None
        (and who holds the port, if anyone): nothing unproven is ever captured or signalled."""
        if self.identity is not None and await asyncio.to_thread(self.identity.alive):
            return self.identity, None
        found = await asyncio.to_thread(self._lookup)
        self.identity = found.identity
        return found.identity, found.stranger

    async def handle_verdict(self, now: float) -> None:
        self.slow_said = False  # a slow episode ends with a verdict
        last = self.identity  # the server last seen: if it is gone, why it died is asked about it
        server, stranger = await self._prove_server()
        clock = self.shared.clock
        self.incident_began = self.detect.first_failure_at if self.detect.first_failure_at is not None else now
        inc = self.incident = Incident(  # records: wall times, converted once, here
            self.name, first_failure_at=clock.wall_of(self.incident_began), detected_at=clock.wall_of(now),
            failures=[r.reason for r in self.failed_reports], pid=server.pid if server else None,
            restart_method=describe(self.inst.restart), stranger=stranger,
        )
        log.warning("%s: HUNG after %d failed probe(s) (incident %s): %s", self.name, len(self.failed_reports),
                    inc.id, _one_line(self.failed_reports[-1].reason))
        if stranger:
            log.warning("%s: %s: not the server; it is not captured, signalled or passed to a hook", self.name, stranger)
        # the policy's failure() made it hung; the pace says what the silence was held against
        self._change(Event.VERDICT, pace=self._pace_record())
        self.shared.notifier.fire("verdict", inc.to_dict())
        recorded = self.door.recorded() if self.door is not None else None  # front.record: before they are failed
        recorded_at = self.shared.clock.monotonic()
        front_requests = self.front.at_verdict(self.shared.capture, restarting=self.inst.restart.method != "none")

        self._change(Event.CAPTURING, self.detect.capturing())
        await self._end_linger()  # the capture makes its own probe
        self.gone_server = last if server is None else None
        await self._capture(inc, server, front_requests, gone=self.gone_server, recorded=recorded,
                            recorded_at=recorded_at)
        if inc.kind == "busy" and await self._works_on(inc):
            return
        if self.inst.restart.method == "none":
            log.warning("%s: restart method is none: waiting for it to recover by itself", self.name)
            self._change(Event.AWAITING_RECOVERY, self.detect.awaiting_recovery())
            return
        while not self.stop.is_set():
            now = self.shared.clock.monotonic()
            if self.guard.exhausted(now):
                self._give_up(now)
                return
            wait = self.guard.wait_before_restart(now)
            if wait > 0:
                log.info("%s: backing off %.0fs before restarting again", self.name, wait)
                self._change(Event.BACKOFF, self.detect.restarting(), wait=wait)
                await self._sleep(wait)
                if self.stop.is_set():
                    return
            looked = await self._look_again(server)
            if self.stop.is_set():
                return
            if looked.recovered:
                await self._recovered(self.shared.clock.monotonic(), looked.recovered, answered=looked.answered)
                return
            server = looked.act_on
            if await self._restart(inc, server) and await self._await_recovery(inc):
                return
            server, _ = await self._prove_server()

    async def _works_on(self, inc: Incident) -> bool:
        """The bundle found the server working (``busy``: tokens to other clients, a prompt
        advancing, stacks in the forward pass): before anything is restarted, watch one chunk of
        this server's pace (``probe.quiet_window`` at least, ``grace_ceiling`` at most) for a sign
        of work. One came: the incident closes, ``slow`` is said, nothing is restarted (measured
        before: a bundle said ``busy`` and the restart went ahead, losing a client's answer)."""
        p = self.inst.probe
        chunk, basis = self.cadence.speed.chunk_time()
        wait = min(max(chunk, p.quiet_window), p.grace_ceiling)
        since = self.shared.clock.monotonic()
        log.warning("%s: the capture found it busy: watching %.0fs (a chunk at its pace, %s) for a sign of work "
                    "before any restart", self.name, wait, basis)
        self.promise(wait)
        while not self.stop.is_set() and (now := self.shared.clock.monotonic()) < since + wait:
            evidence = await self._look(since)
            if evidence.delivered or (evidence.last_flow is not None and evidence.last_flow > since):
                sign = (*evidence.delivered, *[p for p in evidence.progress if not p.startswith("pace:")],
                        "work flowed to its clients")[0]
                self._not_hung(inc, sign, now - since)
                return True
            await self._sleep(LOOK_EVERY)
        return False

    def _not_hung(self, inc: Incident, sign: str, after: float) -> None:
        """A verdict the evidence took back: closed without a restart, and ``slow`` said."""
        reason = f"not restarted: the capture found it busy, and {after:.0f}s later it showed work: {sign}"
        log.warning("%s: %s", self.name, reason)
        self.shared.journal.record(Event.CLOSED, inc, reason=reason)
        self.incident = None
        self.front.open("the server works")
        self.detect.recovered()
        self.failed_reports.clear()
        self.judged_at = None
        self.slow_said = True
        payload = {"instance": self.name, "url": self.inst.url, "state": policy.SLOW, "evidence": [sign],
                   "reason": reason}
        self.shared.journal.note(Event.SLOW, **payload)
        self.shared.notifier.fire("slow", payload)
        self._save(last_incident=_incident_summary(inc))

    async def _look_again(self, server: ProcessIdentity | None) -> lookagain.LookAgain:
        """Right before a restart: probe once more and prove the server's identity again
        (``mlxwatch.restart.lookagain``). Someone else may have fixed it meanwhile."""
        report = await self.probe()
        self.shared.state.update(self.name, quiet=True, last_probe=_probe_summary(report, self.shared.clock.wall()))
        answered = report.healthy
        if answered:
            self.delivered_at = _first_token_at(report, self.shared.clock.monotonic())
        if not answered:  # a token within `timeout` of sending is a delivery:
            # wait for it before acting. Not when the evidence ended the probe's wait: nothing
            # flowed to anyone (with a front door, its clients' requests were failed at the
            # verdict and it delivered nothing since), so waiting would only hold every client
            # at 503 for up to `timeout`. Then what was delivered while the probe waited still
            # counts (measured: answers sent whole 1.3-5.4 s after the probe, and a restart).
            late = await self._await_late_delivery() if not self.cut else \
                list((await self._look(self.probe_sent or self.shared.clock.monotonic())).delivered)
            if self.stop.is_set():
                return lookagain.LookAgain()
            for line in late:
                log.info("%s: looked again before restarting: %s", self.name, line)
            answered = bool(late)
        alive = server is not None and await asyncio.to_thread(server.alive)
        found = await asyncio.to_thread(self._lookup)
        if not answered and lookagain.gone_unreplaced(server, alive=alive, now_server=found.identity or found.loading):
            found = await self._settle(found)  # someone else's restart may be under way
            if self.stop.is_set():
                return lookagain.LookAgain()
        looked = lookagain.decide(server, answered=answered, alive=alive, now_server=found.identity or found.loading)
        if looked.replaced is not None:
            looked = await self._await_replacement(looked.replaced)
            if self.stop.is_set():
                return lookagain.LookAgain()
        if not looked.recovered:
            log.info("%s: looked again before restarting: %s; %s", self.name, _one_line(report.reason),
                     looked.act_on.describe() if looked.act_on else f"no server process to name ({found.detail or 'none'})")
        return looked

    async def _await_replacement(self, newcomer: ProcessIdentity) -> lookagain.LookAgain:
        """Another server process took the verdict's one's place (someone else restarted it) and
        does not answer: recovered only at its first delivery, waited for while it may still be
        loading (its ``startup_timeout`` from its start); after that it is the server that does
        not deliver, and this daemon acts on it (the flap guard still counts every restart)."""
        inc = self.incident
        assert inc is not None
        left = lookagain.startup_left(newcomer, wall_now=self.shared.clock.wall(),
                                      startup_timeout=self.inst.probe.startup_timeout)
        who = f"new server PID {newcomer.pid} (someone else restarted it)"
        if left > 0:
            log.info("%s: %s does not answer yet: waiting up to %.0fs for its first delivery", self.name, who, left)
            self._change(Event.RECOVERING, self.detect.recovering(), by=who)
            if await self._await_delivery(left) is not None:
                return lookagain.LookAgain(recovered=lookagain.delivered_after_replacement(newcomer), answered=True)
            if self.stop.is_set():
                return lookagain.LookAgain()
        if not await asyncio.to_thread(newcomer.alive):
            return lookagain.LookAgain()
        found = await asyncio.to_thread(self._lookup)
        if lookagain.not_the_server(newcomer, found):
            log.warning("%s: PID %d (%s) has not listened on %s %.0fs after it started, and %s: it is not "
                        "the server, so it is not signalled", self.name, newcomer.pid,
                        short_cmdline(newcomer.cmdline), self.inst.url, self.inst.probe.startup_timeout,
                        found.stranger)
            return lookagain.LookAgain()
        log.warning("%s: %s has not delivered %.0fs after it started: acting on it", self.name, who,
                    self.inst.probe.startup_timeout)
        return lookagain.LookAgain(act_on=newcomer)

    async def _settle(self, found: ServerLookup) -> ServerLookup:
        """The verdict's server is gone and none other is there: watch the instance's address for
        ``lookagain.settle_time`` (stop ends it) for a new server process, as after someone
        else's restart. Returns the last lookup (a new server in it, or none found)."""
        wait = lookagain.settle_time(self.inst.probe.suspect_interval)
        log.info("%s: the server is gone and none other is there yet: watching %.1fs for someone else's restart",
                 self.name, wait)
        self.promise(wait)
        loop = asyncio.get_running_loop()
        end = loop.time() + wait
        while not self.stop.is_set() and (left := end - loop.time()) > 0:
            await self._sleep(min(SETTLE_POLL, left))
            found = await asyncio.to_thread(self._lookup)
            if found.identity is not None or found.loading is not None:
                break
        return found

    async def _capture(self, inc: Incident, server: ProcessIdentity | None,
                       front_requests: list[dict] | None = None, gone: ProcessIdentity | None = None,
                       recorded: tuple | None = None, recorded_at: float | None = None) -> None:
        cap, p = self.shared.capture, self.inst.probe
        group = await self._group_of(server)
        request = CaptureRequest(
            pid=server.pid if server else None, out_dir=self.shared.bundles_dir, label=self.name, url=self.inst.url,
            log=self.inst.log or self.log_source.tracker.log, snapshots=cap.snapshots, spacing=cap.spacing,
            ceiling=cap.ceiling, sudo=cap.sudo, stacks=cap.stacks, redact=cap.redact,
            log_tail_lines=cap.log_tail_lines, **capture_probe_timeouts(p),
            prior_probes=[r.to_dict() for r in self.failed_reports],
            keep=cap.keep, max_bytes=cap.max_bytes, keep_days=cap.keep_days, min_free_bytes=cap.min_free_bytes,
            verdict=_verdict_text(self.failed_reports, inc.stranger), front_requests=front_requests, group=group,
            kernel=self.inst.kernel != "off", recorded=recorded, recorded_at=recorded_at,
            gone=GoneProcess(gone.pid, gone.create_time) if gone is not None else None,
        )
        try:
            bundle = await self.shared.capture_fn(request)
        except Exception as exc:  # no evidence is bad; no restart would be worse
            log.error("%s: capture failed: %s", self.name, exc)
            self._change(Event.CAPTURE_FAILED, error=f"{type(exc).__name__}: {exc}")
            return
        self.lingering = bundle.lingering  # the capture probe's stream: ended before our next probe
        inc.bundle, inc.kind, inc.confidence = str(bundle.path), bundle.classification.kind, bundle.classification.confidence
        inc.cause, inc.cause_summary = bundle.classification.cause, bundle.classification.cause_summary
        log.warning("%s: captured %s (%s, %s confidence)", self.name, bundle.path, inc.kind, inc.confidence)
        if inc.cause_summary:
            log.warning("%s: why it died: %s", self.name, inc.cause_summary)
        self._change(Event.CAPTURED)
        self.shared.notifier.fire("captured", inc.to_dict())  # kind, confidence and bundle are known now

    async def _restart(self, inc: Incident, server: ProcessIdentity | None) -> bool:
        # The attempt counts from the moment it starts: a daemon stopped or killed mid-restart
        # has still spent it (the state file and the journal both have it).
        at = self.shared.clock.now()
        self.guard.record_restart(at)
        attempt = {"at": at.wall, "result": "running", "detail": ""}
        inc.restarts.append(attempt)
        self._change(Event.RESTARTING, self.detect.restarting())
        # A task of its own, so the daemon's stop can wait for it before cancelling this watcher
        # (which cancels it too, as before, when the stop's wait is over).
        group = await self._group_of(server)  # restarted whole: never half a group
        gone = self.gone_server if server is None else None
        held = self.memory.readings[-1][1].used if self.memory.readings and gone is not None \
            and gone.pid == self.memory_pid else None
        self.restarting = asyncio.ensure_future(self.shared.restart_fn(
            RestartContext(self.inst, server, inc.bundle, group, gone=gone, held=held)))
        try:
            outcome = await self.restarting
        except (MlxwatchError, OSError) as exc:
            attempt.update(result="failed", detail=str(exc))
            log.error("%s: restart failed: %s", self.name, _one_line(str(exc)))
            self._change(Event.RESTART_FAILED, error=str(exc))
            return False
        attempt.update(result=outcome.result, detail=outcome.detail)
        log.warning("%s: restart: %s", self.name, outcome.detail)
        released = outcome.released
        if released is not None and released.slow:
            self.shared.journal.note(Event.MEMORY_HELD, instance=self.name, incident=inc.id,
                                     waited=round(released.waited, 1), released=released.released, detail=released.detail)
        self._change(Event.RESTART if outcome.result == OK else Event.NOTHING_TO_RESTART)  # the two results
        self.seen_healthy, self.restarted_at, self.identity = False, at.mono, None  # a new process will be recorded
        return True

    async def _await_recovery(self, inc: Incident) -> bool:
        """Probe until healthy or ``startup_timeout``. A delivery to anyone since the restart (a
        late token on a probe's stream, an answer to a client) verifies it too: measured,
        `not_recovered` while a slow server answered 6 requests, and a second restart."""
        self._change(Event.RECOVERING, self.detect.recovering())
        how = await self._await_delivery(self.inst.probe.startup_timeout)
        if how is not None:
            await self._recovered(self.shared.clock.monotonic(), how)
            return True
        if not self.stop.is_set():
            log.error("%s: not healthy %.0fs after the restart", self.name, self.inst.probe.startup_timeout)
            self._change(Event.NOT_RECOVERED)
        return False

    async def _await_delivery(self, within: float) -> str | None:
        """Probe every few seconds for ``within`` seconds: how it delivered, at the first
        delivery (recovery is delivery, never a new PID): a probe's token, or an answer or
        tokens to any client since the wait began (measured: `not_recovered` while a slow server
        answered 6 requests, and a second restart). None when the time ran out or the daemon
        stops."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        since = self.shared.clock.monotonic()
        while not self.stop.is_set() and loop.time() < deadline:
            self.promise(min(RECOVERY_PROBE_EVERY, self.inst.probe.interval))
            # the probe's wait ends at a delivery to anyone: the recovery is then known (measured:
            # answers flowed from 1 s after the restart, and recovery waited out the probe's
            # first-token timeout, 30 s)
            report = await self.probe(delivered_since=since)
            self.shared.state.update(self.name, quiet=True, last_probe=_probe_summary(report, self.shared.clock.wall()))
            if report.healthy:
                self.delivered_at = _first_token_at(report, self.shared.clock.monotonic())
                return "recovery verified by a probe"
            self.streams.count(self.shared.clock.monotonic())  # lets go of the failed probes' streams that ended
            if delivered := (await self._look(since)).delivered:
                self.delivered_at = self.shared.clock.monotonic()
                return f"recovery verified by a delivery: {delivered[0]}"
            await self._sleep(min(RECOVERY_PROBE_EVERY, self.inst.probe.interval, max(0.0, deadline - loop.time())))
        return None

    async def _recovered(self, now: float, how: str, answered: bool = True) -> None:
        """Close the incident as recovered: only once the instance delivered (``answered`` False
        is kept for a caller that knows better; none does: a new PID that does not answer is
        waited for, then acted on, never called recovered)."""
        inc = self.incident
        assert inc is not None
        # Honest times: from the onset (the first failed probe's sending: its failure was judged
        # only when its wait ended) to the first delivered token of the probe that proved it.
        at, self.delivered_at = (min(now, self.delivered_at) if self.delivered_at is not None else now), None
        inc.recovered_at = self.shared.clock.wall_of(at)  # monotonic readings, as every ``now`` here
        began = self.incident_began if self.incident_began is not None else now
        first = self.failed_reports[0].generation if self.failed_reports else None
        onset = began - (first.total or 0.0) if first is not None else began
        inc.seconds_to_recovery = round(max(0.0, at - onset), 3)
        log.warning("%s: recovered (%s) %.1fs after the first failed probe was sent", self.name, how,
                    inc.seconds_to_recovery)
        self.front.open("recovered")
        self.incident = None
        self.seen_healthy = False
        if self.detect.state == policy.GAVE_UP:  # came back by itself after giving up: restarts allowed again
            self.guard.resume()
        self.detect.recovered(answered)
        self.failed_reports.clear()
        self.judged_at = None
        if not answered:
            self.identity = None
        # The state first, then the record that says so: a daemon stopped right after the
        # journal's `recovered` leaves a state file that agrees (measured: a stop between the
        # two kept gave_up_at, and the next daemon gave up again at once).
        self._save(last_incident=_incident_summary(inc))
        self.shared.journal.record(Event.RECOVERED, inc, how=how)
        self.shared.notifier.fire("recovered", inc.to_dict())
        if answered:
            await self._first_healthy()
            self._save(last_incident=_incident_summary(inc))

    def _give_up(self, now: float) -> None:
        inc = self.incident
        assert inc is not None
        self.guard.give_up(Stamp(now, self.shared.clock.wall_of(now)))
        log.error("%s: GAVE UP: %d restarts within %.0fs; next try after %.0fs or `mlxwatch resume %s`",
                  self.name, self.inst.restart.budget, self.inst.restart.window, self.inst.restart.cooldown,
                  self.name)
        self.shared.journal.record(Event.GAVE_UP, inc)
        self.shared.notifier.fire("gave_up", inc.to_dict())
        self.detect.gave_up()
        self.front.open("gave up: requests reach the server again, and fail on their own")
        self._save(last_incident=_incident_summary(inc))  # kept open: a later good probe records recovery

    def _resume(self, why: str) -> None:
        log.warning("%s: %s: restarts allowed again", self.name, why)
        self.guard.resume()
        self.shared.journal.note(Event.RESUMED, instance=self.name, why=why)
        if self.incident is not None:  # the given-up incident ends here; new failures start a new one
            self.shared.journal.record(Event.CLOSED, self.incident, reason=why)
            self.incident = None
        if self.detect.state == policy.GAVE_UP:
            self.detect.resumed()
        self._save()

    # --- between probes: the evidence watched for a stall (a source's reason to probe now)

    async def _sleep_watching(self, seconds: float) -> None:
        """The wait before the next probe, looking at the evidence meanwhile (every
        ``LOOK_EVERY`` s while failed probes' streams are open or the instance is suspect, else
        every ``WATCH_EVERY`` s; each source reads at its own rate): a stall ends the wait, so the
        next probe runs now, and open streams are held while the server shows work."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while not self.stop.is_set() and (left := end - loop.time()) > 0:
            self.front.failed_alone()
            suspect = self.detect.state != policy.HEALTHY or bool(self.streams.tasks())
            if self.incident is None and self.detect.state in (policy.HEALTHY, *policy.PROBING_SOON):
                evidence = await self._look(self.shared.clock.monotonic() - self.inst.probe.quiet_window,
                                            suspect=suspect)
                if await self._stall_seen(evidence.stall):
                    return
            await self._sleep(min(left, LOOK_EVERY if suspect else WATCH_EVERY))

    async def _stall_seen(self, stall: Stall | None, probing: bool = False) -> bool:
        """A source saw a stall (the shim from inside, the front door, the kernel's counters, a
        group's rank): journaled once an episode (True: this look was its first); between probes
        a healthy server is suspect at once, so the next probe runs now (while a probe waits,
        that probe is the next)."""
        if stall is None or not self.sight.first_time(stall):
            return False
        log.warning("%s: %s: suspect%s", self.name, stall.reason, "" if probing else ", probing now")
        self.shared.journal.note(Event(stall.event), instance=self.name, **stall.journal)
        if not probing and self.detect.state == policy.HEALTHY:
            await self.sight.prime()  # prompt progress logged while it was healthy is history, not progress
            self.detect.suspect()
            self._save()
        return True

    # --- bookkeeping

    def _change(self, event: Event, state: str | None = None, **extra: object) -> None:
        """Journal an incident's step. ``state``: what the policy's transition made it (the
        watcher asks the policy; it never sets a state), or the state as it is."""
        assert self.incident is not None
        self.promise(self._step_bound(event, extra))  # each step is bounded: not stuck while it runs
        self.shared.journal.record(event, self.incident, state=state or self.detect.state, **extra)
        self._save(last_incident=_incident_summary(self.incident))

    def _policy_refused(self, message: str) -> None:
        """The policy refused a transition: a bug, said once per kind; the watcher goes on."""
        log.error("%s: %s", self.name, message)

    def _say(self, note: str | None) -> None:
        """Log a condition once (a missing log is worth one line, not one per probe)."""
        if note and note not in self.said:
            self.said.add(note)
            log.warning("%s: %s", self.name, note)

    async def _group_of(self, server: ProcessIdentity | None) -> Group | None:
        """The ``mlx.launch`` group ``server`` is rank 0 of, its ranks' states read now (None:
        a single server). The one the group source found, if it was found for this process."""
        if server is None:
            return None
        known = self.group_source.group
        if known is not None and self.group_source.found_for == (server.pid, server.create_time):
            return await asyncio.to_thread(refresh, known)
        return await asyncio.to_thread(find_group, server.pid)

    def _follow_group(self, rank0: ProcessIdentity) -> None:
        """The group source found the live group again (its rank 0 went: a relaunch by someone
        else, a new launcher): outside an incident, that rank 0 is the server from now on, so that
        every source and the state file describe the group that serves."""
        if self.incident is None and self.identity is not None and not self.identity.same_process(rank0):
            log.info("%s: following the live group: server is %s", self.name, rank0.describe())
            self.identity = rank0

    def _saved_group(self) -> dict | None:
        self.saved_group = self.group_source.group.to_dict() if self.group_source.group is not None else None
        return self.saved_group

    def _save_kernel(self, seen: dict) -> None:
        """What kernel sight sees, for ``status``: it rides on the state file's next write, and
        changes only when a count changes or something flows (the last flow as a wall time)."""
        ago = seen.get("last_flow_ago")
        kept = {k: seen.get(k) for k in ("connections", "streams", "waiting", "slow_readers")}
        kept["last_flow_at"] = None if ago is None else round(self.shared.clock.wall() - ago)
        if kept != self.saved_kernel:
            self.saved_kernel = kept
            self.shared.state.update(self.name, quiet=True, kernel=kept)

    def _save(self, **fields: Any) -> None:
        now = self.shared.clock.monotonic()
        self.shared.state.update(
            self.name, state=self.detect.state, url=self.inst.url, failures=self.detect.failures,
            restarts_in_window=self.guard.restarts_in_window(now), **self.guard.saved(self.shared.clock),
            pid=self.identity.pid if self.identity else None,
            server=self.identity.to_dict() if self.identity else None,
            incident=self.incident.id if self.incident else None,
            group=self._saved_group(), kernel_sight=self.kernel_sight, **self._cadence_saved(), **fields,
        )

    def _cadence_saved(self) -> dict[str, Any]:
        """The learned speed (kept across daemon restarts) and what the server owes now."""
        self.cadence.changed = False
        return {"cadence": self.cadence.speed.to_dict(), "pace": self.pace_shown}


async def _end(linger: asyncio.Task | None) -> None:
    """End a lingering probe stream (its counts stay in its result)."""
    if linger is not None and not linger.done():
        linger.cancel()
        await asyncio.gather(linger, return_exceptions=True)


def _one_line(text: str, limit: int = 300) -> str:
    """A server's text (an HTML error page, say) in one log line: one line per event."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _owes(pace: dict | None) -> tuple | None:
    """What a shown pace says the server owes, without its due time (which moves every look)."""
    return None if pace is None else (pace.get("owes"), pace.get("overdue"), pace.get("hidden") is not None)


def _pace_text(evidence: Evidence, quiet_window: float) -> str:
    """What the silence was held against: the server's pace, or the plain quiet window."""
    pace = evidence.pace
    if pace is None or pace.due is None:
        if pace is None or pace.floor <= quiet_window:
            return f"probe.quiet_window {quiet_window:g}s"
        return f"{pace.floor:.0f}s: a few decode steps at this server's pace"
    return f"past this server's pace: {pace.owes}, {pace.basis}"


def _verdict_text(reports: list[CheckReport], stranger: str | None) -> str:
    text = f"{len(reports)} failed probe(s), the last: {reports[-1].reason}" if reports else "failed probes"
    return f"{text}; {stranger}" if stranger else text


def _first_token_at(report: CheckReport, now: float) -> float:
    """When ``report``'s first token arrived, on the monotonic clock of ``now`` (its end)."""
    g = report.generation
    return now - max(0.0, (g.total or 0.0) - (g.ttft or 0.0))


def _probe_summary(report: CheckReport, at: float) -> dict:
    g = report.generation
    return {"at": at, "ok": report.healthy, "reason": report.reason, "ttft": g.ttft, "total": g.total, "tokens": g.tokens}


def _incident_summary(inc: Incident) -> dict:
    return {"id": inc.id, "kind": inc.kind, "cause": inc.cause, "detected_at": inc.detected_at, "bundle": inc.bundle,
            "recovered_at": inc.recovered_at, "seconds_to_recovery": inc.seconds_to_recovery}
