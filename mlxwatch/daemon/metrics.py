"""Prometheus metrics from the daemon's tracked state: a ``/metrics`` endpoint and a textfile.

Off unless the config sets ``metrics.listen`` or ``metrics.textfile``::

    exporter = await start_metrics(config.metrics, journal, state, lambda: daemon.config)
    ...
    await exporter.stop()

Nothing in the watchers calls this module. ``Metrics`` observes the two sources of truth that
``mlxwatch status`` reads: the journal (every incident state change is a record) and the state
file (each probe's summary, each instance's state and restart times, the daemon's health). So a
scrape shows what ``status`` shows, and a watcher never waits on, or fails because of, metrics.

Series. ``server`` is the instance's name from the config (not ``instance``: Prometheus gives
that label to the scrape target, the Mac, and would rename ours to ``exported_instance``). Every
other label comes from a fixed list, so no URL, path, prompt or message can reach a label:

==========================================================  =========  ==============================================
``mlxwatch_probe_success{server}``                        gauge      1 if the last probe delivered a token in time
``mlxwatch_probe_ttft_seconds{server}``                   histogram  request sent -> first token, of probes that got one
``mlxwatch_probe_duration_seconds{server}``               histogram  request sent -> end or give-up, of every probe
``mlxwatch_last_probe_timestamp_seconds{server}``         gauge      when the watcher's last probe ended (its liveness)
``mlxwatch_instance_state{server,state}``                 gauge      1 for the current state, 0 for the others
``mlxwatch_incidents_total{server,kind}``                 counter    incidents by classified kind (see below)
``mlxwatch_deaths_total{server,cause}``                   counter    deaths by the cause the OS recorded (capture.death)
``mlxwatch_memory_bytes{server}``, ``_limit_bytes``        gauge      the server's memory and the bound it runs under
``mlxwatch_memory_seconds_left{server}``                  gauge      out of memory in about this long (absent: not growing)
``mlxwatch_restarts_total{server,result}``                counter    restarts run: ok, nothing_to_restart, failed
``mlxwatch_capture_seconds{server}``                      gauge      the last capture: ``capturing`` -> ``captured``
``mlxwatch_last_recovery_seconds{server}``                gauge      the last recovery: first failed probe -> proven
``mlxwatch_restart_budget_remaining{server}``             gauge      restarts left in the window (read at scrape)
``mlxwatch_restart_budget{server}``                       gauge      the configured budget (restarts per window)
``mlxwatch_front_requests_total{server,outcome}``           counter    front door requests ended, by outcome (below)
``mlxwatch_front_requests_in_flight{server}``               gauge      front door requests in flight
``mlxwatch_front_first_token_seconds{server}``              histogram  front door: request received -> its first token
``mlxwatch_front_tokens_per_second{server}``                histogram  front door: a request's rate, first to last token
``mlxwatch_rank_up{server,rank,host}``                     gauge      an mlx.launch group's rank: 1 running, else 0
``mlxwatch_patience_seconds{server}``                      gauge      the silence allowed now, at the server's own pace
``mlxwatch_chunk_seconds{server}``                         gauge      the learned bound for one prompt chunk's reading
``mlxwatch_build_info{version,python}``                     gauge      1
``mlxwatch_config_last_reload_successful``                  gauge      0 after a refused SIGHUP reload, else 1
``mlxwatch_config_last_reload_success_timestamp_seconds``   gauge      the last good load (start or reload)
``mlxwatch_watcher_errors_total``                           counter    watchers that crashed and were restarted
``mlxwatch_daemon_heartbeat_timestamp_seconds``             gauge      the daemon's last tick (the textfile's liveness)
``mlxwatch_daemon_running``                                 gauge      1; 0 in the textfile a stopped daemon leaves
==========================================================  =========  ==============================================

``mlxwatch_rank_up`` exists for instances whose server is rank 0 of an ``mlx.launch`` group
(``instances[].group`` in the state file, as the daemon last found the group): one sample per
rank, 0 when the rank is stopped, a zombie, gone, or on a host that could not be asked (a rank
not proven running). ``host`` is the hostfile's name for the rank's host (the user's own, like
``server``). Read at scrape time; a single server has no sample.

The front door's series (``instances[].front``, docs/front-door.md) exist for instances that have
one; ``outcome`` is one of ``ok``, ``cancelled`` (the client went away), ``failed_loudly`` (an
explicit error: the verdict, or the request stalled alone), ``refused_restarting`` (503 while the
server restarts), ``replayed`` (sent again to the recovered server), ``rejected`` (refused before
forwarding: over a size or connection limit, or malformed) and ``timeout`` (the client did not
send its whole request in time). They are read from the door every few seconds by the daemon (``Metrics.on_front``).

An incident is counted once, when its kind is known (``captured``). One whose kind never becomes
known (its capture failed, or it ended or the daemon stopped before the capture finished) is
counted as ``kind="unknown"``, the label the classifier itself uses when the evidence decides
nothing. Counters start at zero with each daemon run (Prometheus' ``increase()`` handles that);
each instance's kinds and results are exported at 0 from its first update, so the first incident
is an increase too. The histograms' buckets run from 50 ms to the largest ``first_token_timeout``
(``timeout`` for durations) configured when the daemon started.

Metrics settings are read at start: a SIGHUP reload that changes them is logged ("apply at the
next daemon start") and otherwise ignored; instances added or removed by a reload appear in and
disappear from the series at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import start_http_server

from mlxwatch import __version__
from mlxwatch.capture.classify import KINDS
from mlxwatch.capture.death import CAUSES
from mlxwatch.clock import Clock
from mlxwatch.config import Config, MetricsConfig, ProbeConfig
from mlxwatch.front.delivery import OUTCOMES, DeliveryView, Observations
from mlxwatch.journal.incidents import Journal
from mlxwatch.journal.state import StateFile
from mlxwatch.restart.flapguard import restarts_in_window
from mlxwatch.restart.methods import NOTHING_TO_RESTART, OK
from mlxwatch.storage import replace_atomically
from mlxwatch.verdict.policy import STATES

log = logging.getLogger("mlxwatch.daemon.metrics")

RESTART_RESULTS = (OK, NOTHING_TO_RESTART, "failed")
OTHER = "other"  # a value outside a label's fixed list (a newer daemon's kind): never the raw text
UNKNOWN_KIND = "unknown"
ENDING_EVENTS = ("recovered", "closed", "interrupted")  # after these an incident gets no more records
_LADDER = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0,
           300.0, 600.0, 900.0, 1800.0, 3600.0)
TEXTFILE_MIN_GAP = 0.5  # changes within this are written together


RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 35.0, 50.0, 75.0, 100.0, 150.0, 250.0, 500.0)  # tokens/s


def buckets_up_to(limit: float) -> tuple[float, ...]:
    """Histogram buckets from 50 ms up to ``limit`` (included) on a 1-2.5-5-ish ladder."""
    return (*[b for b in _LADDER if b < limit], float(limit))


def restart_record(fields: dict[str, Any]) -> dict[str, Any]:
    """What the budget is counted from: the saved restart times, wall and monotonic
    (``FlapGuard.saved``), a copy the event loop never changes under a scrape."""
    return {"restarts": list(fields["restarts"]), "monotonic": fields.get("monotonic")}


def _times(value: Any, factor: float) -> Any:
    return value * factor if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _label(value: Any, allowed: tuple[str, ...]) -> str:
    return value if isinstance(value, str) and value in allowed else OTHER


@dataclass
class _Track:
    """What the metrics remember of one incident until it ends."""

    capturing_at: float | None = None
    counted: bool = False
    restarts_counted: int = 0


class Metrics:
    """The registry and its series, fed by ``on_record`` (journal) and ``on_state`` (state file).

    Observers run on the event loop; scrapes and textfile writes read the registry from other
    threads (prometheus_client's series are thread-safe; the budget is computed from a copy)."""

    def __init__(self, config_fn: Callable[[], Config], state: StateFile | None = None,
                 clock: Clock | None = None) -> None:
        disable_created_metrics()  # `_created` series double the output and no rule here needs them
        self.config_fn = config_fn
        self.state = state
        self.clock = clock or Clock()  # wall readings for times; the budget counts by the flap guard's rule
        self.on_change: Callable[[], None] | None = None
        config = config_fn()
        self.settings = config.metrics  # as started: a reload that changes them is only logged
        ttft_top = max((i.probe.first_token_timeout for i in config.instances), default=ProbeConfig.first_token_timeout)
        total_top = max((i.probe.timeout for i in config.instances), default=ProbeConfig.timeout)
        r = self.registry = CollectorRegistry(auto_describe=True)
        Gauge("mlxwatch_build_info", "mlxwatch version and Python (value 1)", ["version", "python"],
              registry=r).labels(__version__, platform.python_version()).set(1)
        self.probe_success = Gauge("mlxwatch_probe_success", "1 if the last probe delivered a token in time, else 0",
                                   ["server"], registry=r)
        self.probe_ttft = Histogram("mlxwatch_probe_ttft_seconds", "Probe request sent to first delivered token",
                                    ["server"], buckets=buckets_up_to(ttft_top), registry=r)
        self.probe_duration = Histogram("mlxwatch_probe_duration_seconds", "Probe request sent to end or give-up",
                                        ["server"], buckets=buckets_up_to(total_top), registry=r)
        self.last_probe_time = Gauge("mlxwatch_last_probe_timestamp_seconds",
                                     "When the instance's last probe ended: a watcher that stopped probing shows here",
                                     ["server"], registry=r)
        self.instance_state = Gauge("mlxwatch_instance_state", "1 for the instance's current watchdog state",
                                    ["server", "state"], registry=r)
        self.incidents = Counter("mlxwatch_incidents", "Incidents by classified kind (unknown: never classified)",
                                 ["server", "kind"], registry=r)
        self.restarts = Counter("mlxwatch_restarts", "Restarts run, by result", ["server", "result"], registry=r)
        self.deaths = Counter("mlxwatch_deaths", "Servers that died (crashed, or their generation thread died), by "
                              "the cause the OS recorded", ["server", "cause"], registry=r)
        self.memory_bytes = Gauge("mlxwatch_memory_bytes", "The server's memory: resident size (Linux), physical "
                                  "footprint (macOS)", ["server"], registry=r)
        self.memory_limit = Gauge("mlxwatch_memory_limit_bytes", "The bound the server's memory runs under: its "
                                  "cgroup's limit or the machine's memory (Linux), the GPU's wired limit (macOS)",
                                  ["server"], registry=r)
        self.memory_seconds_left = Gauge("mlxwatch_memory_seconds_left", "Out of memory in about this long, from "
                                         "the trend (absent while it does not grow)", ["server"], registry=r)
        self.capture_seconds = Gauge("mlxwatch_capture_seconds", "Duration of the last evidence capture",
                                     ["server"], registry=r)
        self.last_recovery = Gauge("mlxwatch_last_recovery_seconds",
                                   "First failed probe to proven recovery, of the last recovered incident",
                                   ["server"], registry=r)
        self.reload_ok = Gauge("mlxwatch_config_last_reload_successful", "0 if the last config reload was refused",
                               registry=r)
        self.reload_time = Gauge("mlxwatch_config_last_reload_success_timestamp_seconds",
                                 "When the config was last loaded successfully", registry=r)
        self.watcher_errors = Counter("mlxwatch_watcher_errors", "Watchers that crashed and were restarted", registry=r)
        self.heartbeat = Gauge("mlxwatch_daemon_heartbeat_timestamp_seconds", "The daemon's last heartbeat", registry=r)
        self.running = Gauge("mlxwatch_daemon_running", "1 while the daemon runs; 0 once it stopped", registry=r)
        self.front_requests = Counter("mlxwatch_front_requests", "Front door requests ended, by outcome",
                                      ["server", "outcome"], registry=r)
        self.front_in_flight = Gauge("mlxwatch_front_requests_in_flight", "Front door requests in flight",
                                     ["server"], registry=r)
        self.front_first_token = Histogram("mlxwatch_front_first_token_seconds",
                                           "Front door: request received to its first token delivered",
                                           ["server"], buckets=buckets_up_to(ttft_top), registry=r)
        self.front_rate = Histogram("mlxwatch_front_tokens_per_second",
                                    "Front door: one request's tokens per second, first to last token",
                                    ["server"], buckets=RATE_BUCKETS, registry=r)
        self.front_outcomes: dict[str, dict[str, int]] = {}  # the door's totals at the last reading
        r.register(_BudgetCollector(self))
        r.register(_ShimCollector(self))
        r.register(_GroupCollector(self))
        r.register(_PaceCollector(self))
        self.reload_ok.set(1)  # the config the daemon started with loaded, or it would not be running
        self.reload_time.set(self.clock.wall())
        self.running.set(1)
        self.instances: set[str] = set()
        self.tracks: dict[str, _Track] = {}
        self.probe_at: dict[str, Any] = {}
        self.restart_records: dict[str, dict[str, Any]] = {}  # replaced whole, never mutated: safe to read from a scrape
        self.errors_seen = 0
        self._said: set[str] = set()

    # --- observers

    def on_front(self, name: str, view: DeliveryView, observations: Observations) -> None:
        """One reading of an instance's front door (on the event loop). The door's outcome totals
        start at zero with each door; the counters add what grew since the last reading (a new
        door's totals, whole)."""
        self._seen(name)
        last = self.front_outcomes.get(name, {})
        for outcome in OUTCOMES:
            total = int(view.outcomes.get(outcome, 0))
            before = last.get(outcome, 0)
            grown = total - before if total >= before else total
            self.front_requests.labels(name, outcome).inc(grown)
        self.front_outcomes[name] = {o: int(view.outcomes.get(o, 0)) for o in OUTCOMES}
        self.front_in_flight.labels(name).set(len(view.in_flight))
        for seconds in observations.first_token_latency:
            self.front_first_token.labels(name).observe(seconds)
        for rate in observations.tokens_per_second:
            self.front_rate.labels(name).observe(rate)
        self._changed()

    def on_record(self, entry: dict[str, Any]) -> None:
        """A journal record was written."""
        name, inc_id, event = entry.get("instance"), entry.get("id"), entry.get("event")
        if not isinstance(name, str) or not isinstance(inc_id, str):
            return  # a note outside incidents: daemon_start, resumed, watcher_error (counted from the state)
        self._seen(name)
        track = self.tracks.setdefault(inc_id, _Track())
        ts = entry.get("ts")
        if event == "capturing":
            track.capturing_at = ts
        elif event in ("captured", "capture_failed"):
            if isinstance(ts, (int, float)) and track.capturing_at is not None:
                self.capture_seconds.labels(name).set(round(ts - track.capturing_at, 3))
            self._count(name, track, entry.get("kind") if event == "captured" else None)
            if event == "captured" and entry.get("cause") is not None:
                self.deaths.labels(name, _label(entry.get("cause"), CAUSES)).inc()
        restarts = entry.get("restarts")
        restarts = restarts if isinstance(restarts, list) else []
        for restart in restarts[track.restarts_counted:]:
            result = restart.get("result") if isinstance(restart, dict) else None
            if result == "running":  # journaled as it starts; counted once its result is known
                break
            self.restarts.labels(name, _label(result, RESTART_RESULTS)).inc()
            track.restarts_counted += 1
        if event == "recovered" and isinstance(entry.get("seconds_to_recovery"), (int, float)):
            self.last_recovery.labels(name).set(entry["seconds_to_recovery"])
        if event in ENDING_EVENTS:
            self._count(name, track, None)
            del self.tracks[inc_id]
        self._changed()

    def on_state(self, name: str | None, fields: dict[str, Any]) -> None:
        """The state file changed: an instance's fields, or the daemon's (``name`` None)."""
        if name is None:
            self._on_daemon(fields)
        else:
            self._seen(name)
            if "state" in fields:
                for state in STATES:
                    self.instance_state.labels(name, state).set(1 if fields["state"] == state else 0)
            probe = fields.get("last_probe")
            if isinstance(probe, dict) and probe.get("at") != self.probe_at.get(name):
                self.probe_at[name] = probe.get("at")
                self.probe_success.labels(name).set(1 if probe.get("ok") else 0)
                if isinstance(probe.get("at"), (int, float)):
                    self.last_probe_time.labels(name).set(probe["at"])
                if isinstance(probe.get("ttft"), (int, float)):
                    self.probe_ttft.labels(name).observe(probe["ttft"])
                if isinstance(probe.get("total"), (int, float)):
                    self.probe_duration.labels(name).observe(probe["total"])
            if isinstance(fields.get("restarts"), list):
                self.restart_records[name] = restart_record(fields)
            if isinstance(fields.get("memory"), dict):
                self._on_memory(name, fields["memory"])
        self._changed()

    def _on_memory(self, name: str, memory: dict[str, Any]) -> None:
        for gauge, value in ((self.memory_bytes, memory.get("used")), (self.memory_limit, memory.get("limit")),
                             (self.memory_seconds_left, _times(memory.get("minutes_left"), 60))):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                gauge.labels(name).set(value)
            else:
                try:
                    gauge.remove(name)
                except KeyError:
                    pass

    def _on_daemon(self, fields: dict[str, Any]) -> None:
        if isinstance(fields.get("last_tick"), (int, float)):
            self.heartbeat.set(fields["last_tick"])
        if "running" in fields:
            self.running.set(1 if fields["running"] else 0)
        errors = fields.get("watcher_errors")
        if isinstance(errors, int):
            if errors > self.errors_seen:
                self.watcher_errors.inc(errors - self.errors_seen)
            self.errors_seen = errors
        reload = fields.get("last_reload")
        if isinstance(reload, dict):
            if reload.get("ok"):
                self.reload_ok.set(1)
                self.reload_time.set(reload.get("at") or self.clock.wall())
                self._check_settings()
            else:
                self.reload_ok.set(0)
        self._forget_removed()

    # --- bookkeeping

    def _seen(self, name: str) -> None:
        """An instance's first update: its counters start at 0, so its first incident is an increase."""
        if name in self.instances:
            return
        self.instances.add(name)
        for kind in (*KINDS, OTHER):
            self.incidents.labels(name, kind)
        for result in (*RESTART_RESULTS, OTHER):
            self.restarts.labels(name, result)
        for cause in (*CAUSES, OTHER):
            self.deaths.labels(name, cause)

    def _count(self, name: str, track: _Track, kind: Any) -> None:
        if not track.counted:
            track.counted = True
            self.incidents.labels(name, _label(kind or UNKNOWN_KIND, KINDS)).inc()

    def _forget_removed(self) -> None:
        """Drop the series of instances a reload removed (no longer configured, no longer tracked)."""
        live = {i.name for i in self.config_fn().instances}
        if self.state is not None:
            live |= set(self.state.data.get("instances", {}))
        for name in self.instances - live:
            self.instances.discard(name)
            self.probe_at.pop(name, None)
            self.front_outcomes.pop(name, None)
            self.restart_records.pop(name, None)
            for metric, others in ((self.instance_state, STATES), (self.incidents, (*KINDS, OTHER)),
                                   (self.restarts, (*RESTART_RESULTS, OTHER)), (self.probe_success, ()),
                                   (self.deaths, (*CAUSES, OTHER)), (self.memory_bytes, ()),
                                   (self.memory_limit, ()), (self.memory_seconds_left, ()),
                                   (self.last_probe_time, ()),
                                   (self.probe_ttft, ()), (self.probe_duration, ()), (self.capture_seconds, ()),
                                   (self.last_recovery, ()), (self.front_requests, OUTCOMES),
                                   (self.front_in_flight, ()), (self.front_first_token, ()), (self.front_rate, ())):
                for labels in [(name, o) for o in others] if others else [(name,)]:
                    try:
                        metric.remove(*labels)
                    except KeyError:
                        pass

    def _check_settings(self) -> None:
        new = self.config_fn().metrics
        if new != self.settings and repr(new) not in self._said:
            self._said.add(repr(new))
            log.warning("metrics settings changed in the reloaded config; they apply at the next daemon start "
                        "(still serving %s)", describe(self.settings))

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def budget_remaining(self) -> Iterator[tuple[str, int, int]]:
        """(name, restarts left, budget) of each configured instance, counted as the flap guard
        and ``status`` count them (``flapguard.restarts_in_window``)."""
        records = dict(self.restart_records)
        for inst in self.config_fn().instances:
            recent = restarts_in_window(records.get(inst.name, {}), inst.restart.window, self.clock)
            yield inst.name, max(0, inst.restart.budget - recent), inst.restart.budget

    def exposition(self) -> bytes:
        """The text a scrape gets (thread-safe)."""
        return generate_latest(self.registry)


class _ShimCollector:
    """With the launch shim (``mlxwatch launch``), what the server itself says it delivers: read
    from its heartbeat at scrape time, as ``status`` shows it. Servers without the shim have no
    sample (absent, not zero: "no data" is not "no tokens")."""

    RATE = "mlxwatch_shim_tokens_per_second", "Tokens per second the server delivered (launch shim heartbeat)"
    SINCE = "mlxwatch_shim_seconds_since_last_token", "Seconds since the server last delivered a token (launch shim)"

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(*self.RATE, labels=["server"]), GaugeMetricFamily(*self.SINCE, labels=["server"])]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from mlxwatch.shim import heartbeat

        rate, since = self.describe()
        instances = self.metrics.state.data.get("instances", {}) if self.metrics.state is not None else {}
        for inst in self.metrics.config_fn().instances:
            server = (instances.get(inst.name) or {}).get("server")
            if not isinstance(server, dict) or not isinstance(server.get("pid"), int):
                continue
            created = server.get("create_time")
            try:
                hb, _ = heartbeat.find(server["pid"], float(created) if isinstance(created, (int, float)) else None)
            except Exception:  # a scrape never fails for one server's heartbeat
                continue
            if hb is None:
                continue
            summary = hb.summary()
            if isinstance(summary.get("tokens_per_s"), (int, float)):
                rate.add_metric([inst.name], float(summary["tokens_per_s"]))
            if isinstance(summary.get("since_last_token"), (int, float)):
                since.add_metric([inst.name], float(summary["since_last_token"]))
        yield rate
        yield since


class _GroupCollector:
    """Each rank of an instance's ``mlx.launch`` group, as the daemon last found it (the state
    file's ``group``, ``Group.to_dict()``): up when running. Instances without a group have no
    sample."""

    UP = "mlxwatch_rank_up", "1 if the mlx.launch group's rank runs, else 0 (stopped, gone, not reachable)"

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(*self.UP, labels=["server", "rank", "host"])]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        (up,) = self.describe()
        instances = self.metrics.state.data.get("instances", {}) if self.metrics.state is not None else {}
        for inst in self.metrics.config_fn().instances:
            saved = instances.get(inst.name) if isinstance(instances, dict) else None
            for rank, host, state in group_ranks(saved.get("group") if isinstance(saved, dict) else None):
                up.add_metric([inst.name, str(rank), host], 1.0 if state == "running" else 0.0)
        yield up


def group_ranks(group: Any) -> list[tuple[int, str, str]]:
    """(rank, host, state) of each rank in a saved ``Group.to_dict()``; nothing from a damaged
    or missing entry (the state file is read as untrusted input)."""
    ranks = group.get("ranks") if isinstance(group, dict) else None
    found = []
    for r in ranks if isinstance(ranks, list) else []:
        if isinstance(r, dict) and isinstance(r.get("rank"), int) and not isinstance(r.get("rank"), bool):
            found.append((r["rank"], str(r.get("host") or "?"), str(r.get("state") or "unknown")))
    return found


class _PaceCollector:
    """Each instance's pace (docs/deciding.md#patience), as the watcher last saved it: the
    silence allowed now (``probe.quiet_window``, or longer while a sign it owes is not yet due)
    and the learned bound for one prompt chunk. Read at scrape time (the due time is a clock's)."""

    PATIENCE = "mlxwatch_patience_seconds", "The silence allowed now, from the server's own pace and what it owes"
    CHUNK = "mlxwatch_chunk_seconds", "The learned bound for reading one prompt chunk (--prefill-step-size tokens)"

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(*self.PATIENCE, labels=["server"]), GaugeMetricFamily(*self.CHUNK, labels=["server"])]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        patience, chunk = self.describe()
        instances = self.metrics.state.data.get("instances", {}) if self.metrics.state is not None else {}
        now = time.time()
        for inst in self.metrics.config_fn().instances:
            saved = instances.get(inst.name) if isinstance(instances, dict) else None
            saved = saved if isinstance(saved, dict) else {}
            pace, cadence = saved.get("pace"), saved.get("cadence")
            allowed = inst.probe.quiet_window
            if isinstance(pace, dict):
                floor, due = _finite(pace.get("floor")), _finite(pace.get("due"))
                allowed = max(floor if floor is not None else allowed, due - now if due is not None else 0.0)
            patience.add_metric([inst.name], allowed)
            bound = _finite(cadence.get("chunk_bound")) if isinstance(cadence, dict) else None
            if bound is not None:
                chunk.add_metric([inst.name], bound)
        yield patience
        yield chunk


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class _BudgetCollector:
    """The budget depends on the clock (restarts leave the window), so it is read at scrape time."""

    REMAINING = "mlxwatch_restart_budget_remaining", "Restarts left in the window before the instance is given up"
    BUDGET = "mlxwatch_restart_budget", "Restarts allowed per window (restart.budget)"

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily(*self.REMAINING, labels=["server"]), GaugeMetricFamily(*self.BUDGET, labels=["server"])]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        remaining, budget = self.describe()
        for name, left, total in self.metrics.budget_remaining():
            remaining.add_metric([name], left)
            budget.add_metric([name], total)
        yield remaining
        yield budget


def describe(settings: MetricsConfig) -> str:
    parts = []
    if settings.listen is not None:
        host, port = settings.listen
        parts.append(f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics")
    if settings.textfile is not None:
        parts.append(f"textfile {settings.textfile}")
    return " and ".join(parts) or "nothing"


def write_textfile(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically: node_exporter never reads half a file. The temp file's name
    is random and does not end in .prom (the collector ignores it), and it is created with
    ``O_EXCL|O_NOFOLLOW``: a link planted in a shared textfile directory is never written
    through, whatever user the daemon runs as. 0644: node_exporter may run as another user,
    and the file holds instance names and numbers only."""
    replace_atomically(path, data, mode=0o644)


class MetricsExporter:
    """Serves and writes one ``Metrics``: the HTTP endpoint runs in prometheus_client's own
    thread; the textfile is written off the event loop when something changed."""

    def __init__(self, settings: MetricsConfig, metrics: Metrics | None, journal: Journal | None = None,
                 state: StateFile | None = None, min_gap: float = TEXTFILE_MIN_GAP) -> None:
        self.settings = settings
        self.metrics = metrics
        self.journal, self.state = journal, state
        self.min_gap = min_gap
        self.server: Any = None
        self.thread: Any = None
        self.writer: asyncio.Task | None = None
        self.writing: asyncio.Future | None = None  # the textfile write in its thread, if one runs
        self.dirty = asyncio.Event()
        self.write_error: str | None = None
        self.address: tuple[str, int] | None = None  # where the endpoint listens (the port, if 0 was asked)

    async def start(self) -> None:
        if self.metrics is None:
            if self.state is not None and self.state.data.get("daemon", {}).get("metrics"):
                self.state.set_daemon(metrics=None)  # an earlier run's settings, no longer true
            return
        if self.journal is not None:
            self.journal.observers.append(self.metrics.on_record)
        if self.state is not None:
            self.state.observers.append(self.metrics.on_state)
        error = None
        if self.settings.listen is not None:
            host, port = self.settings.listen
            try:
                self.server, self.thread = await asyncio.to_thread(start_http_server, port, host, self.metrics.registry)
                self.address = self.server.server_address[:2]
            except OSError as exc:
                error = f"cannot listen on {describe(MetricsConfig(listen=self.settings.listen))}: {exc.strerror or exc}"
                log.error("metrics: %s; the watchdog runs on without the endpoint", error)
        if self.settings.textfile is not None:
            self.metrics.on_change = self.dirty.set
            self.dirty.set()
            self.writer = asyncio.create_task(self._write_loop(), name="metrics-textfile")
        if self.state is not None:
            self.state.set_daemon(metrics={"serving": describe(self.settings), "error": error})
        if error is None:
            log.info("metrics: %s", describe(self.settings))

    async def stop(self) -> None:
        """Detach, write the textfile a last time (``mlxwatch_daemon_running 0`` if the daemon
        said so), and close the endpoint."""
        if self.metrics is None:
            return
        for observers, fn in ((getattr(self.journal, "observers", []), self.metrics.on_record),
                              (getattr(self.state, "observers", []), self.metrics.on_state)):
            if fn in observers:
                observers.remove(fn)
        if self.writer is not None:
            self.writer.cancel()
            await asyncio.gather(self.writer, return_exceptions=True)
            self.writer = None
            if self.writing is not None:  # a write in its thread outlives the cancel: the last word is ours
                await asyncio.gather(self.writing, return_exceptions=True)
            try:
                await asyncio.to_thread(self.write_textfile)
            except OSError as exc:
                log.error("metrics: cannot write %s at stop: %s", self.settings.textfile, exc.strerror or exc)
        if self.server is not None:
            server, self.server = self.server, None
            await asyncio.to_thread(server.shutdown)
            server.server_close()

    def write_textfile(self) -> None:
        assert self.metrics is not None and self.settings.textfile is not None
        write_textfile(self.settings.textfile, self.metrics.exposition())

    async def _write_loop(self) -> None:
        while True:
            await self.dirty.wait()
            await asyncio.sleep(self.min_gap)
            self.dirty.clear()
            try:
                self.writing = asyncio.ensure_future(asyncio.to_thread(self.write_textfile))
                await asyncio.shield(self.writing)
            except Exception as exc:  # a full disk or a missing directory: say it once, keep trying
                error = f"{type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}"
                if self.write_error is None:
                    log.error("metrics: cannot write %s: %s; will retry", self.settings.textfile, error)
                self.write_error = error
                self.dirty.set()
                await asyncio.sleep(5.0)
                continue
            if self.write_error is not None:
                log.warning("metrics: %s written again after: %s", self.settings.textfile, self.write_error)
                self.write_error = None


async def start_metrics(settings: MetricsConfig, journal: Journal, state: StateFile,
                        config_fn: Callable[[], Config]) -> MetricsExporter:
    """Start what ``settings`` asks for (nothing when metrics are off). Never raises for a port
    that cannot be bound or a textfile that cannot be written: those are logged, and the
    watchdog, which matters more, runs on."""
    metrics = None
    if settings.enabled:
        metrics = Metrics(config_fn, state)
        for name, record in list(state.data.get("instances", {}).items()):  # budgets survive daemon restarts
            if isinstance(record, dict) and isinstance(record.get("restarts"), list):
                metrics.restart_records[name] = restart_record(record)
        daemon = state.data.get("daemon", {})
        metrics.on_state(None, {k: daemon[k] for k in ("last_tick", "watcher_errors") if k in daemon})
    exporter = MetricsExporter(settings, metrics, journal, state)
    await exporter.start()
    return exporter
