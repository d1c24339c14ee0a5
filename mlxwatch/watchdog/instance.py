"""One instance's watch loop: probe, judge, and on a verdict capture -> restart -> recover.

Each instance runs in its own task, so a slow, refused or wedged instance never delays
another's probes. Every state change is logged (one line), journaled (one fsynced record) and
written to the state file. The order on a verdict is fixed: the bundle is captured while the
process is still in its bad state, and only then is anything restarted.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable

import httpx

from mlxwatch.capture import Bundle, CaptureRequest, capture_bundle
from mlxwatch.config import CaptureConfig, InstanceConfig
from mlxwatch.errors import MlxwatchError
from mlxwatch.probes import CheckReport, run_check
from mlxwatch.process import ProcessIdentity, find_server_pid
from mlxwatch.watchdog import policy
from mlxwatch.watchdog.flapguard import FlapGuard
from mlxwatch.watchdog.journal import Incident, Journal
from mlxwatch.watchdog.notify import Notifier
from mlxwatch.watchdog.progress import ProgressTracker
from mlxwatch.watchdog.restart import RestartContext, describe, restart
from mlxwatch.watchdog.state import StateFile, take_resume

log = logging.getLogger("mlxwatch.watchdog")

RECOVERY_PROBE_EVERY = 5.0


@dataclass
class Shared:
    """What all watchers share: one HTTP client, the journal, the state file, the hooks."""

    client: httpx.AsyncClient
    journal: Journal
    state: StateFile
    state_dir: Path
    notifier: Notifier
    capture: CaptureConfig
    bundles_dir: Path
    capture_fn: Callable[[CaptureRequest], Awaitable[Bundle]] = capture_bundle
    restart_fn: Callable[[RestartContext], Awaitable[str]] = restart
    clock: Callable[[], float] = time.time


@dataclass
class InstanceWatcher:
    inst: InstanceConfig
    shared: Shared
    stop: asyncio.Event
    detect: policy.Detection = field(init=False)
    guard: FlapGuard = field(init=False)
    tracker: ProgressTracker = field(init=False)
    identity: ProcessIdentity | None = None
    incident: Incident | None = None
    failed_reports: list[CheckReport] = field(default_factory=list)

    def __post_init__(self) -> None:
        p, r = self.inst.probe, self.inst.restart
        self.detect = policy.Detection(p.failures, p.grace_ceiling)
        saved = self.shared.state.instance(self.inst.name)
        self.guard = FlapGuard(r.budget, r.window, r.backoff, r.max_backoff, r.cooldown,
                               restarts=list(saved.get("restarts", [])), gave_up_at=saved.get("gave_up_at"))
        if self.guard.gave_up_at is not None:
            self.detect.state = policy.GAVE_UP
        self.tracker = ProgressTracker(self.inst.log)

    @property
    def busy_with_incident(self) -> bool:
        return self.detect.state in (policy.CAPTURING, policy.RESTARTING, policy.RECOVERING)

    # --- the loop

    async def run(self) -> None:
        self.tracker.prime()
        self._save()
        await self._sleep(random.uniform(0, min(self.inst.probe.interval, 5.0)))  # spread instances out
        while not self.stop.is_set():
            await self.cycle()
            await self._sleep(self.next_delay() * random.uniform(0.9, 1.1))

    def next_delay(self) -> float:
        """A suspect server is probed again soon: one failure is a question, not an answer."""
        p = self.inst.probe
        return min(p.interval, p.suspect_interval) if self.detect.state == policy.SUSPECT else p.interval

    async def _sleep(self, seconds: float) -> None:
        """Sleep that a stop request interrupts."""
        try:
            await asyncio.wait_for(self.stop.wait(), timeout=max(0.0, seconds))
        except TimeoutError:
            pass

    async def probe(self) -> CheckReport:
        p = self.inst.probe
        return await run_check(self.shared.client, self.inst.url, first_token_timeout=p.first_token_timeout,
                               timeout=p.timeout, max_tokens=p.max_tokens, endpoint_timeout=p.endpoint_timeout)

    async def cycle(self) -> None:
        now = self.shared.clock()
        if take_resume(self.shared.state_dir, self.inst.name):
            self._resume("resumed by `mlxwatch resume`")
        elif self.detect.state == policy.GAVE_UP and self.guard.cooled_down(now):
            self._resume(f"cool-down of {self.inst.restart.cooldown:g}s passed")
        report = await self.probe()
        now = self.shared.clock()
        self._save(last_probe=_probe_summary(report, now))
        if report.healthy:
            self._healthy(report, now)
            return
        log.info("%s: probe failed: %s", self.inst.name, report.reason)
        if self.detect.state == policy.GAVE_UP or self.incident is not None:
            return  # gave up, or waiting for a server we may not restart to come back by itself
        self.failed_reports.append(report)
        progress = self.tracker.observe([report])
        if not self.detect.failure(now, progress):
            if progress:
                log.info("%s: no token, but progress holds the verdict: %s", self.inst.name, "; ".join(progress))
            self._save()
            return
        await self.handle_verdict(now)

    def _healthy(self, report: CheckReport, now: float) -> None:
        if self.incident is not None:  # came back by itself (restart none, or after giving up)
            self._recovered(now, "recovered without a restart")
            return
        if self.detect.state != policy.HEALTHY:
            log.info("%s: healthy again (first token after %.2fs)", self.inst.name, report.generation.ttft or 0)
        self._back_to_healthy()

    def _back_to_healthy(self, **fields: object) -> None:
        """Every way back to healthy: a given-up instance may restart again, the failure count
        and log position start over, and the (maybe new) server process is looked up."""
        if self.detect.state == policy.GAVE_UP:
            self.guard.resume()
        self.detect.success()
        self.failed_reports.clear()
        self.tracker.prime()
        self._refresh_identity()
        self._save(**fields)

    # --- verdict -> capture -> restart -> recover

    async def handle_verdict(self, now: float) -> None:
        if self.identity is None or not self.identity.alive():
            self._refresh_identity()
        inc = self.incident = Incident(
            self.inst.name, first_failure_at=self.detect.first_failure_at, detected_at=now,
            failures=[r.reason for r in self.failed_reports], pid=self.identity.pid if self.identity else None,
            restart_method=describe(self.inst.restart),
        )
        log.warning("%s: HUNG after %d failed probe(s) (incident %s): %s", self.inst.name, len(self.failed_reports),
                    inc.id, self.failed_reports[-1].reason)
        self._change(policy.HUNG, "verdict")
        self.shared.notifier.fire("verdict", inc.to_dict())

        self._change(policy.CAPTURING, "capturing")
        await self._capture(inc)
        if self.inst.restart.method == "none":
            log.warning("%s: restart method is none: waiting for it to recover by itself", self.inst.name)
            self._change(policy.HUNG, "awaiting_recovery")
            return
        while not self.stop.is_set():
            now = self.shared.clock()
            if self.guard.exhausted(now):
                self._give_up(now)
                return
            wait = self.guard.wait_before_restart(now)
            if wait > 0:
                log.info("%s: backing off %.0fs before restarting again", self.inst.name, wait)
                self._change(policy.RESTARTING, "backoff", wait=wait)
                await self._sleep(wait)
                if self.stop.is_set():
                    return
            if await self._restart(inc) and await self._await_recovery(inc):
                return

    async def _capture(self, inc: Incident) -> None:
        cap, p = self.shared.capture, self.inst.probe
        request = CaptureRequest(
            pid=inc.pid, out_dir=self.shared.bundles_dir, label=self.inst.name, url=self.inst.url, log=self.inst.log,
            snapshots=cap.snapshots, spacing=cap.spacing, ceiling=cap.ceiling, sudo=cap.sudo,
            log_tail_lines=cap.log_tail_lines, probe_first_token_timeout=min(p.first_token_timeout, 10.0),
            probe_timeout=min(p.timeout, 20.0), prior_probes=[r.to_dict() for r in self.failed_reports],
            keep=cap.keep, max_bytes=cap.max_bytes,
        )
        try:
            bundle = await self.shared.capture_fn(request)
        except Exception as exc:  # no evidence is bad; no restart would be worse
            log.error("%s: capture failed: %s", self.inst.name, exc)
            self._change(policy.CAPTURING, "capture_failed", error=f"{type(exc).__name__}: {exc}")
            return
        inc.bundle, inc.kind, inc.confidence = str(bundle.path), bundle.classification.kind, bundle.classification.confidence
        log.warning("%s: captured %s (%s, %s confidence)", self.inst.name, bundle.path, inc.kind, inc.confidence)
        self._change(policy.CAPTURING, "captured")

    async def _restart(self, inc: Incident) -> bool:
        self._change(policy.RESTARTING, "restarting")
        at = self.shared.clock()
        self.guard.record_restart(at)
        ctx = RestartContext(self.inst, self.identity, inc.bundle)
        try:
            result = await self.shared.restart_fn(ctx)
            inc.restarts.append({"at": at, "result": "ok", "detail": result})
            log.warning("%s: restarted: %s", self.inst.name, result)
            self._change(policy.RESTARTING, "restart")
            return True
        except (MlxwatchError, OSError) as exc:
            inc.restarts.append({"at": at, "result": "failed", "detail": str(exc)})
            log.error("%s: restart failed: %s", self.inst.name, exc)
            self._change(policy.RESTARTING, "restart_failed", error=str(exc))
            return False

    async def _await_recovery(self, inc: Incident) -> bool:
        self._change(policy.RECOVERING, "recovering")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.inst.probe.startup_timeout
        while not self.stop.is_set() and loop.time() < deadline:
            report = await self.probe()
            if report.healthy:
                self._recovered(self.shared.clock(), "recovery verified by a probe")
                return True
            await self._sleep(min(RECOVERY_PROBE_EVERY, self.inst.probe.interval))
        if not self.stop.is_set():
            log.error("%s: not healthy %.0fs after the restart", self.inst.name, self.inst.probe.startup_timeout)
            self._change(policy.RECOVERING, "not_recovered")
        return False

    def _recovered(self, now: float, how: str) -> None:
        inc = self.incident
        assert inc is not None
        inc.recovered_at = now
        inc.seconds_to_recovery = round(now - (inc.first_failure_at or inc.detected_at or now), 3)
        log.warning("%s: recovered (%s) %.1fs after the first failed probe", self.inst.name, how, inc.seconds_to_recovery)
        self.shared.journal.record("recovered", inc, how=how)
        self.shared.notifier.fire("recovered", inc.to_dict())
        self.incident = None
        self._back_to_healthy(last_incident=_incident_summary(inc))

    def _give_up(self, now: float) -> None:
        inc = self.incident
        assert inc is not None
        self.guard.give_up(now)
        log.error("%s: GAVE UP: %d restarts within %.0fs; next try after %.0fs or `mlxwatch resume %s`",
                  self.inst.name, self.inst.restart.budget, self.inst.restart.window, self.inst.restart.cooldown,
                  self.inst.name)
        self.shared.journal.record("gave_up", inc)
        self.shared.notifier.fire("gave_up", inc.to_dict())
        self.detect.state = policy.GAVE_UP
        self._save(last_incident=_incident_summary(inc))  # kept open: a later good probe records recovery

    def _resume(self, why: str) -> None:
        log.warning("%s: %s: restarts allowed again", self.inst.name, why)
        self.guard.resume()
        self.shared.journal.note("resumed", instance=self.inst.name, why=why)
        if self.incident is not None:  # the given-up incident ends here; new failures start a new one
            self.shared.journal.record("closed", self.incident, reason=why)
            self.incident = None
        if self.detect.state == policy.GAVE_UP:
            self.detect.success()
        self._save()

    # --- bookkeeping

    def _change(self, state: str, event: str, **extra: object) -> None:
        self.detect.state = state
        assert self.incident is not None
        self.shared.journal.record(event, self.incident, state=state, **extra)
        self._save(last_incident=_incident_summary(self.incident))

    def _refresh_identity(self) -> None:
        try:
            self.identity = ProcessIdentity.of(find_server_pid(self.inst.port, self.inst.pid_file))
        except MlxwatchError as exc:
            log.debug("%s: no process identity: %s", self.inst.name, exc)

    def _save(self, **fields: object) -> None:
        now = self.shared.clock()
        self.shared.state.update(
            self.inst.name, state=self.detect.state, url=self.inst.url, failures=self.detect.failures,
            restarts=self.guard.restarts, restarts_in_window=self.guard.restarts_in_window(now),
            gave_up_at=self.guard.gave_up_at, pid=self.identity.pid if self.identity else None,
            incident=self.incident.id if self.incident else None, **fields,
        )


def _probe_summary(report: CheckReport, at: float) -> dict:
    g = report.generation
    return {"at": at, "ok": report.healthy, "reason": report.reason, "ttft": g.ttft, "total": g.total, "tokens": g.tokens}


def _incident_summary(inc: Incident) -> dict:
    return {"id": inc.id, "kind": inc.kind, "detected_at": inc.detected_at, "bundle": inc.bundle,
            "recovered_at": inc.recovered_at, "seconds_to_recovery": inc.seconds_to_recovery}
