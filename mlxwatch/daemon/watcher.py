"""One instance's watch loop: probe, judge, and on a verdict capture -> restart -> recover.

Each instance runs in its own task with its own HTTP connections, so a slow, refused or wedged
instance never delays another's probes or takes its connections. At most one probe per
instance is in flight: a probe that failed at its first-token deadline keeps its stream open
and read until the server ends it or ``probe.timeout`` after sending (mlx-lm notices a closed
stream only when it next writes, so an abandoned probe would stay in its batch and queue the next
one); a token within that time is a delivery, and a verdict waits for those streams.

Blocking work (log reads, process lookups) runs in threads and only when the state changes:
a healthy probe costs one HTTP exchange and nothing else. Every state change is logged (one
line), journaled (one fsynced record) and marked for the state file. On a verdict the order is
fixed: the server is proven (see ``mlxwatch.host.process``), the bundle is captured while it is
still in its bad state, and only then is anything restarted.
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
from mlxwatch.clock import Clock, Stamp
from mlxwatch.config import CaptureConfig, InstanceConfig
from mlxwatch.daemon.notify import Notifier
from mlxwatch.daemon.frontwatch import FrontWatch, quiet_start, requests_evidence
from mlxwatch.errors import MlxwatchError
from mlxwatch.front.door import FrontDoor, Gate
from mlxwatch.host.process import ProcessIdentity, ServerLookup, lookup_instance, lookup_server
from mlxwatch.journal.incidents import Event, Incident, Journal
from mlxwatch.journal.state import StateFile, take_resume
from mlxwatch.probes import CheckReport, make_client, run_check
from mlxwatch.restart import lookagain
from mlxwatch.restart.flapguard import FlapGuard
from mlxwatch.restart.methods import (
    OK,
    RestartContext,
    RestartOutcome,
    describe,
    restart,
)
from mlxwatch.shim import heartbeat
from mlxwatch.shim.watch import POLL as SHIM_POLL
from mlxwatch.shim.watch import ShimWatch
from mlxwatch.verdict import policy
from mlxwatch.verdict.progress import ProgressTracker, late_delivery

log = logging.getLogger("mlxwatch.watchdog")

RECOVERY_PROBE_EVERY = 5.0
SETTLE_POLL = 0.5  # how often the look-again looks for a new server after the old one went
FIRST_PROBE_SPREAD = 5.0  # each instance's first probe comes within min(interval, this): spread out
KEPT_FAILED_REPORTS = 20


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


@dataclass
class InstanceWatcher:
    inst: InstanceConfig
    shared: Shared
    stop: asyncio.Event
    detect: policy.Detection = field(init=False)
    guard: FlapGuard = field(init=False)
    tracker: ProgressTracker = field(init=False)
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
    open_probes: list[CheckReport] = field(default_factory=list)  # failed probes whose late tokens are not counted yet
    draining: list[asyncio.Task] = field(default_factory=list)  # streams counted already, read on to their bound
    door_cut: bool = False  # the last probe's first-token deadline was cut by a stall at the front door
    looking_again: bool = False  # the probe right before a restart is under way
    slow_said: bool = False  # this slow episode was journaled and notified (once, until healthy or a verdict)
    client: httpx.AsyncClient | None = None
    said: set[str] = field(default_factory=set)  # notes already logged once
    shimwatch: ShimWatch | None = None  # the launch shim's heartbeat readings (see "launch shim" below)
    door: FrontDoor | None = None  # the instance's front door (the daemon starts and stops it; see "front door" below)
    frontwatch: FrontWatch | None = None  # the door's delivery view, read as signals for the policy
    alive_at: float | None = None  # monotonic: the last sign of life (a cycle done, an incident step begun)
    alive_within: float = 0.0  # ... and the most it promised to take until the next one

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
        self.tracker = ProgressTracker(self.inst.log, writer_pid=self._server_pid)

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
        if self.inst.log is None and found.log is not None and found.log != self.tracker.log:
            log.info("%s: following %s (the launchd job's log)", self.name, found.log)
            self.tracker = ProgressTracker(found.log, writer_pid=self._server_pid)
            self.tracker.prime()
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
                self._say(await asyncio.to_thread(self.tracker.prime))
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
            self._front_gate(Gate.OPEN, "incident closed")
        if self.detect.state not in (policy.GAVE_UP, policy.STARTING):
            self.detect.watching_again()
            self.seen_healthy = False

    def next_delay(self) -> float:
        """A suspect server is probed again soon: one failure is a question, not an answer."""
        p = self.inst.probe
        return min(p.interval, p.suspect_interval) if self.detect.state in policy.PROBING_SOON else p.interval

    async def _sleep(self, seconds: float) -> None:
        """Sleep that a stop request interrupts."""
        try:
            await asyncio.wait_for(self.stop.wait(), timeout=max(0.0, seconds))
        except TimeoutError:
            pass

    async def probe(self) -> CheckReport:
        """One check. A failed probe's stream is read on until the server ends it or
        ``probe.timeout`` after it was sent (``read_until``), whatever probes come meanwhile:
        the server serves that reply anyway (mlx-lm notices a closed stream only when it
        writes), and a token within ``timeout`` of sending is a delivery (``_late_deliveries``).
        A healthy answer ends the streams still open: nothing they say matters any more."""
        try:
            if self.detect.state == policy.HEALTHY and self.tracker.follower is not None:
                # Progress is judged from here on: lines written while it was healthy are history.
                self._say(await asyncio.to_thread(self.tracker.prime))
            p = self.inst.probe
            assert self.client is not None
            first_token_timeout = self._front_probe_starts()
            self.door_cut = first_token_timeout < p.first_token_timeout
            report = await run_check(self.client, self.inst.url, first_token_timeout=first_token_timeout,
                                     timeout=p.timeout, max_tokens=p.max_tokens, endpoint_timeout=p.endpoint_timeout,
                                     read_until=p.timeout)
        except BaseException:
            await self._end_linger()
            raise
        if report.healthy:
            await self._end_linger()
        elif report.lingering is not None:
            self.open_probes.append(report)
        return report

    def _late_deliveries(self) -> list[str]:
        """Tokens that arrived on failed probes' streams after their deadlines (within their
        ``timeout``: the stream is not read longer), each probe counted once. Streams that ended
        with nothing are let go; counted ones are read on to their bound."""
        lines, still_open = [], []
        for report in self.open_probes:
            line = late_delivery(report)
            if line:
                lines.append(line)
                if report.lingering is not None and not report.lingering.done():
                    self.draining.append(report.lingering)
            elif report.lingering is not None and not report.lingering.done():
                still_open.append(report)
        self.open_probes = still_open
        self.draining = [t for t in self.draining if not t.done()]
        return lines

    async def _await_late_delivery(self) -> list[str]:
        """Before a verdict: wait for the failed probes' streams still open (each at most until
        ``timeout`` after its probe was sent), until one delivers, all end, or stop. Returns the
        late deliveries (none: the verdict stands)."""
        loop = asyncio.get_running_loop()
        while not self.stop.is_set():
            if lines := self._late_deliveries():
                return lines
            tasks = {r.lingering for r in self.open_probes if r.lingering is not None}
            if not tasks:
                return []
            self.promise(self.inst.probe.timeout)  # a bounded step: each stream ends by its read_until
            waiting = loop.create_task(self.stop.wait())
            try:
                await asyncio.wait({*tasks, waiting}, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
        return []

    async def _end_linger(self) -> None:
        tasks = [self.lingering, *(r.lingering for r in self.open_probes), *self.draining]
        self.lingering, self.open_probes, self.draining = None, [], []
        for task in tasks:
            await _end(task)

    async def cycle(self) -> None:
        now = self.shared.clock.monotonic()
        if take_resume(self.shared.state_dir, self.name):
            self._resume("resumed by `mlxwatch resume`")
        elif self.detect.state == policy.GAVE_UP and self.guard.cooled_down(now):
            self._resume(f"cool-down of {self.inst.restart.cooldown:g}s passed")
        report = await self.probe()
        now = self.shared.clock.monotonic()
        front_delivered = self._front_reading()  # the door's deliveries while this probe waited
        self.shared.state.update(self.name, quiet=True, last_probe=_probe_summary(report, self.shared.clock.wall()))
        if report.healthy:
            await self._healthy(report, now)
            return
        log.info("%s: probe failed: %s", self.name, _one_line(report.reason))
        late = self._late_deliveries()  # the earlier failed probes' tokens that came after their deadlines
        if self.detect.state == policy.GAVE_UP or self.incident is not None:
            return  # gave up, or waiting for a server we may not restart to come back by itself
        if not self.seen_healthy and await self._starting(now):
            return
        progress = await asyncio.to_thread(self.tracker.observe, report)
        for note in progress.notes:
            self._say(note)
        self.failed_reports = [*self.failed_reports[-(KEPT_FAILED_REPORTS - 1):], report]
        busy, delivered = await self._shim_on_failure(report)
        delivered += self._front_on_failure(front_delivered)
        delivered += late
        signals = list(progress.signals) + busy
        if not delivered and not progress.delivered and not self.door_cut and self.detect.would_judge(now, signals):
            # A verdict waits for the window's failed probes' streams: a token within `timeout` of
            # a probe's sending is a delivery (slow, never hung), so it must not be cut off. Not
            # when the door cut this probe's deadline: it saw no token to anyone for that long.
            delivered += await self._await_late_delivery()
            if self.stop.is_set():
                return
            now = self.shared.clock.monotonic()
        was = self.detect.state
        if not self.detect.failure(now, list(progress.signals) + busy, list(progress.delivered) + delivered):
            if self.detect.state == policy.SLOW:
                self._slow(was)
            elif progress.signals or busy:
                log.info("%s: no token, but progress holds the verdict: %s", self.name,
                         "; ".join([*progress.signals, *busy]))
            self._save()
            return
        await self.handle_verdict(now)

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
        self._change(Event.VERDICT)  # the policy's failure() made it hung
        self.shared.notifier.fire("verdict", inc.to_dict())
        front_requests = self._front_at_verdict()

        self._change(Event.CAPTURING, self.detect.capturing())
        await self._end_linger()  # the capture makes its own probe
        await self._capture(inc, server, front_requests)
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

    async def _look_again(self, server: ProcessIdentity | None) -> lookagain.LookAgain:
        """Right before a restart: probe once more and prove the server's identity again
        (``mlxwatch.restart.lookagain``). Someone else may have fixed it meanwhile."""
        self.looking_again = True
        try:
            report = await self.probe()
        finally:
            self.looking_again = False
        self.shared.state.update(self.name, quiet=True, last_probe=_probe_summary(report, self.shared.clock.wall()))
        answered = report.healthy
        if not answered and not self.door_cut:  # a token within `timeout` of sending is a delivery:
            # wait for it before acting. Not with a front door: its clients' requests were failed
            # at the verdict and a probe cut to front.stall_timeout saw no token to anyone either,
            # so waiting would only hold every client at 503 for up to `timeout`.
            late = await self._await_late_delivery()
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
        if not looked.recovered:
            log.info("%s: looked again before restarting: %s; %s", self.name, _one_line(report.reason),
                     looked.act_on.describe() if looked.act_on else f"no server process to name ({found.detail or 'none'})")
        return looked

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
                       front_requests: list[dict] | None = None) -> None:
        cap, p = self.shared.capture, self.inst.probe
        request = CaptureRequest(
            pid=server.pid if server else None, out_dir=self.shared.bundles_dir, label=self.name, url=self.inst.url,
            log=self.inst.log or self.tracker.log, snapshots=cap.snapshots, spacing=cap.spacing,
            ceiling=cap.ceiling, sudo=cap.sudo, stacks=cap.stacks, redact=cap.redact,
            log_tail_lines=cap.log_tail_lines, **capture_probe_timeouts(p),
            prior_probes=[r.to_dict() for r in self.failed_reports],
            keep=cap.keep, max_bytes=cap.max_bytes, keep_days=cap.keep_days, min_free_bytes=cap.min_free_bytes,
            verdict=_verdict_text(self.failed_reports, inc.stranger), front_requests=front_requests,
        )
        try:
            bundle = await self.shared.capture_fn(request)
        except Exception as exc:  # no evidence is bad; no restart would be worse
            log.error("%s: capture failed: %s", self.name, exc)
            self._change(Event.CAPTURE_FAILED, error=f"{type(exc).__name__}: {exc}")
            return
        self.lingering = bundle.lingering  # the capture probe's stream: ended before our next probe
        inc.bundle, inc.kind, inc.confidence = str(bundle.path), bundle.classification.kind, bundle.classification.confidence
        log.warning("%s: captured %s (%s, %s confidence)", self.name, bundle.path, inc.kind, inc.confidence)
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
        self.restarting = asyncio.ensure_future(self.shared.restart_fn(RestartContext(self.inst, server, inc.bundle)))
        try:
            outcome = await self.restarting
        except (MlxwatchError, OSError) as exc:
            attempt.update(result="failed", detail=str(exc))
            log.error("%s: restart failed: %s", self.name, _one_line(str(exc)))
            self._change(Event.RESTART_FAILED, error=str(exc))
            return False
        attempt.update(result=outcome.result, detail=outcome.detail)
        log.warning("%s: restart: %s", self.name, outcome.detail)
        self._change(Event.RESTART if outcome.result == OK else Event.NOTHING_TO_RESTART)  # the two results
        self.seen_healthy, self.restarted_at, self.identity = False, at.mono, None  # a new process will be recorded
        return True

    async def _await_recovery(self, inc: Incident) -> bool:
        self._change(Event.RECOVERING, self.detect.recovering())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.inst.probe.startup_timeout
        while not self.stop.is_set() and loop.time() < deadline:
            self.promise(min(RECOVERY_PROBE_EVERY, self.inst.probe.interval))
            report = await self.probe()
            self.shared.state.update(self.name, quiet=True, last_probe=_probe_summary(report, self.shared.clock.wall()))
            if report.healthy:
                await self._recovered(self.shared.clock.monotonic(), "recovery verified by a probe")
                return True
            self._late_deliveries()  # lets go of the failed probes' streams that ended
            await self._sleep(min(RECOVERY_PROBE_EVERY, self.inst.probe.interval))
        if not self.stop.is_set():
            log.error("%s: not healthy %.0fs after the restart", self.name, self.inst.probe.startup_timeout)
            self._change(Event.NOT_RECOVERED)
        return False

    async def _recovered(self, now: float, how: str, answered: bool = True) -> None:
        """Close the incident as recovered. ``answered`` False: another server process replaced
        the one the verdict was about and does not answer yet (loading): it starts over as
        ``starting``, with its startup allowance."""
        inc = self.incident
        assert inc is not None
        inc.recovered_at = self.shared.clock.wall_of(now)  # now: monotonic, as every ``now`` here
        began = self.incident_began if self.incident_began is not None else now
        inc.seconds_to_recovery = round(now - began, 3)
        log.warning("%s: recovered (%s) %.1fs after the first failed probe", self.name, how, inc.seconds_to_recovery)
        self._front_gate(Gate.OPEN, "recovered")
        self.shared.journal.record(Event.RECOVERED, inc, how=how)
        self.shared.notifier.fire("recovered", inc.to_dict())
        self.incident = None
        self.seen_healthy = False
        if self.detect.state == policy.GAVE_UP:  # came back by itself after giving up: restarts allowed again
            self.guard.resume()
        self.detect.recovered(answered)
        self.failed_reports.clear()
        if not answered:
            self.identity = None
            self._save(last_incident=_incident_summary(inc))
            return
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
        self._front_gate(Gate.OPEN, "gave up: requests reach the server again, and fail on their own")
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

    # --- launch shim (`mlxwatch launch`): the proven server's heartbeat as signals for the policy
    # (mlxwatch.shim.watch). Without a heartbeat every method here is a no-op.

    def _shim(self) -> ShimWatch:
        if self.shimwatch is None:
            self.shimwatch = ShimWatch()
        self.shimwatch.mode, self.shimwatch.stall_timeout = self.inst.shim, self.inst.probe.stall_timeout  # reloads
        self.shimwatch.reset_for(self.identity.pid if self.identity else None)
        return self.shimwatch

    async def _shim_read(self) -> heartbeat.Heartbeat | None:
        watch = self._shim()
        if watch.mode == "off" or self.identity is None or not watch.should_read(self.shared.clock.monotonic()):
            return None
        hb, problem = await asyncio.to_thread(heartbeat.find, self.identity.pid, self.identity.create_time)
        if hb is None:
            watch.absent(self.shared.clock.monotonic())
            if watch.mode == "required":
                self._say(f"shim: required, but the server (PID {self.identity.pid}) has none: {problem}")
        return hb

    async def _shim_on_failure(self, report: CheckReport) -> tuple[list[str], list[str]]:
        """A failed probe: (busy, delivered) from the heartbeat. Busy lines hold the verdict like
        prompt progress; tokens delivered to other clients make the server slow, not hung; a
        stall it shows makes this failure decisive (the heartbeat was the first failure)."""
        hb = await self._shim_read()
        judged = self._shim().judge(hb, report.generation.tokens)
        for line in judged.evidence + judged.busy + judged.delivered:
            log.info("%s: %s", self.name, line)
        if judged.stall and not judged.busy and not judged.delivered:
            self.detect.stall_seen()
        return judged.busy, judged.delivered

    async def _sleep_watching_shim(self, seconds: float) -> bool:
        """``_sleep``, reading the heartbeat every ``SHIM_POLL`` s meanwhile: a stall (requests in
        flight and no token for stall_timeout, a stale heartbeat, a dead thread) makes the
        server suspect at once and ends the wait, so the next probe runs now. Without a
        heartbeat this is ``_sleep`` after one read. True: it ended early for a stall."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while not self.stop.is_set():
            left = end - loop.time()
            if left <= 0:
                return False
            if (self.inst.shim == "off" or self.identity is None or self.incident is not None
                    or self.detect.state not in (policy.HEALTHY, *policy.PROBING_SOON)):
                await self._sleep(left)
                return False
            hb = await self._shim_read()
            if hb is None:
                await self._sleep(left)
                return False
            judged = self._shim().judge(hb)
            if self._shim().first_time(judged):
                log.warning("%s: %s: suspect, probing now", self.name, judged.stall)
                self.shared.journal.note(Event.SHIM_STALL, instance=self.name, pid=hb.pid, reason=judged.stall,
                                         evidence=judged.evidence, heartbeat=hb.summary())
                await self._suspect_now()
                return True
            await self._sleep(min(left, SHIM_POLL))
        return False

    # --- front door (instances[].front): the door's delivery view as signals for the policy
    # (mlxwatch.daemon.frontwatch), and the door told what the verdict means for its clients.
    # Without a door every method here is a no-op.

    def _front(self) -> FrontWatch:
        assert self.inst.front is not None
        if self.frontwatch is None:
            self.frontwatch = FrontWatch(self.inst.front.stall_timeout)
        return self.frontwatch

    def _front_reading(self) -> list[str]:
        """Tokens the door delivered since the last reading (a line, or none): taken when a probe
        starts and when it ends, so the window is the probe's own wait. Tokens delivered before
        it started say the server worked then, not that it works now."""
        if self.door is None or self.inst.front is None:
            return []
        return self._front().delivered(self.door.view())

    def _front_stalled(self) -> str | None:
        """Outside an incident: requests in flight through the door and no token to anyone for
        ``front.stall_timeout`` (the reason), else None."""
        if self.door is None or self.inst.front is None or self.incident is not None:
            return None
        stall = self._front().stall(self.door.view(), self.shared.clock.monotonic())
        return stall.reason if stall else None

    def _front_probe_starts(self) -> float:
        """A probe starts: the door's reading window opens (tokens it delivers while this probe
        waits are what count), and the probe's first-token deadline is returned:
        ``probe.first_token_timeout``, but no longer than ``front.stall_timeout`` once clients'
        requests in flight through the door have had no token for half that (a stall under way:
        waiting longer only delays the verdict). While tokens flow the deadline is the full one,
        so a busy server's probe is not called late (``slow``) for waiting its turn."""
        p = self.inst.probe
        if self.door is None or self.inst.front is None:
            return p.first_token_timeout
        view, now = self.door.view(), self.shared.clock.monotonic()
        self._front().delivered(view)
        quiet_since = quiet_start(view)
        if self.looking_again:  # the door failed every request at the verdict: it is the witness
            return min(p.first_token_timeout, self.inst.front.stall_timeout)
        if self.incident is not None or quiet_since is None or now - quiet_since < self.inst.front.stall_timeout / 2:
            return p.first_token_timeout
        return min(p.first_token_timeout, self.inst.front.stall_timeout)

    def _front_on_failure(self, delivered: list[str]) -> list[str]:
        """A failed probe: the door's deliveries in its window count as the shim's "tokens to
        other clients" do (slow, never a verdict); a stall the door still shows, with nothing
        delivered, makes this failure decisive (the stall was the first)."""
        for line in delivered:
            log.info("%s: %s", self.name, line)
        stalled = self._front_stalled()
        if stalled and not delivered:
            log.info("%s: %s", self.name, stalled)
            self.detect.stall_seen()
        return delivered

    async def _front_poll(self) -> bool:
        """One look at the door while waiting for the next probe: requests it failed alone are
        said; a stall makes the instance suspect at once. True: probe now."""
        if self.door is None or self.inst.front is None:
            return False
        for req in self.door.take_stalled_requests():
            log.warning("%s: front door: request %s (%s %s) got no token for %gs while others did; it failed loudly",
                        self.name, req.id, req.method, req.path, self.inst.front.request_stall_timeout)
            self.shared.journal.note(Event.FRONT_REQUEST_STALLED, instance=self.name, request=req.id, path=req.path,
                                     tokens=req.tokens, timeout=self.inst.front.request_stall_timeout)
        if self.incident is not None or self.detect.state not in (policy.HEALTHY, *policy.PROBING_SOON):
            return False
        watch, view = self._front(), self.door.view()
        stall = watch.stall(view, self.shared.clock.monotonic())
        if not watch.first_time(stall):
            return False
        assert stall is not None
        log.warning("%s: %s: suspect, probing now", self.name, stall.reason)
        self.shared.journal.note(Event.FRONT_STALL, instance=self.name, reason=stall.reason,
                                 in_flight=len(view.in_flight))
        await self._suspect_now()
        return True

    async def _suspect_now(self) -> None:
        """A stall seen from inside (the shim) or at the front door makes a healthy server suspect
        at once, so the next probe runs now. The log is primed first, as ``probe`` does for a
        healthy server: prompt progress logged while it was healthy is history, not progress."""
        if self.detect.state == policy.HEALTHY:
            if self.tracker.follower is not None:
                self._say(await asyncio.to_thread(self.tracker.prime))
            self.detect.suspect()
            self._save()

    async def _sleep_watching(self, seconds: float) -> None:
        """The wait before the next probe, watching the front door (every ``SHIM_POLL`` s) and the
        launch shim meanwhile: a stall either sees ends the wait, so the next probe runs now."""
        if self.door is None:
            await self._sleep_watching_shim(seconds)
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while not self.stop.is_set() and (left := end - loop.time()) > 0:
            if await self._front_poll():
                return
            if await self._sleep_watching_shim(min(left, SHIM_POLL)):
                return

    def _front_at_verdict(self) -> list[dict] | None:
        """The verdict, for the door's clients: the requests in flight are kept as evidence, then
        each ends with an explicit error (never an empty success); when a restart follows, new
        requests get 503 + Retry-After (or are held up to ``front.hold``) until it is verified."""
        if self.door is None:
            return None
        view = self.door.view()
        cap = self.shared.capture
        evidence = requests_evidence(view, self.shared.clock.monotonic(), bodies=cap.requests == "bodies", redact=cap.redact)
        failed = self.door.fail_in_flight("the server is hung (mlxwatch verdict); retry later")
        if failed:  # no line about no request: most verdicts come with nobody waiting
            log.warning("%s: front door: %d request(s) in flight failed loudly", self.name, failed)
        if self.inst.restart.method != "none":
            self._front_gate(Gate.RESTARTING, "a restart follows the verdict")
        return evidence

    def _front_gate(self, gate: Gate, why: str) -> None:
        if self.door is not None:
            log.info("%s: front door: %s (%s)", self.name, getattr(gate, "value", gate), why)
            self.door.set_gate(gate)

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

    def _save(self, **fields: Any) -> None:
        now = self.shared.clock.monotonic()
        self.shared.state.update(
            self.name, state=self.detect.state, url=self.inst.url, failures=self.detect.failures,
            restarts_in_window=self.guard.restarts_in_window(now), **self.guard.saved(self.shared.clock),
            pid=self.identity.pid if self.identity else None,
            server=self.identity.to_dict() if self.identity else None,
            incident=self.incident.id if self.incident else None, **fields,
        )


async def _end(linger: asyncio.Task | None) -> None:
    """End a lingering probe stream (its counts stay in its result)."""
    if linger is not None and not linger.done():
        linger.cancel()
        await asyncio.gather(linger, return_exceptions=True)


def _one_line(text: str, limit: int = 300) -> str:
    """A server's text (an HTML error page, say) in one log line: one line per event."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _verdict_text(reports: list[CheckReport], stranger: str | None) -> str:
    text = f"{len(reports)} failed probe(s), the last: {reports[-1].reason}" if reports else "failed probes"
    return f"{text}; {stranger}" if stranger else text


def _probe_summary(report: CheckReport, at: float) -> dict:
    g = report.generation
    return {"at": at, "ok": report.healthy, "reason": report.reason, "ttft": g.ttft, "total": g.total, "tokens": g.tokens}


def _incident_summary(inc: Incident) -> dict:
    return {"id": inc.id, "kind": inc.kind, "detected_at": inc.detected_at, "bundle": inc.bundle,
            "recovered_at": inc.recovered_at, "seconds_to_recovery": inc.seconds_to_recovery}
