"""Metrics end to end against the real mlx_lm.server (each mlx-lm version): the daemon serves
/metrics on loopback and writes the textfile while a livelock (the lab's ``spin`` fault) goes
through its incident; scrapes taken during it show the state, incident and restart series move.

Two shapes, because the daemon core moves from ``hung`` to ``capturing`` in the same step when it
can restart: with a ``command:`` restart a scrape sees capturing -> restarting/recovering ->
healthy and a restart counted; with ``restart: none`` the instance stays ``hung`` (awaiting
recovery) until the server comes back by itself, so a scrape sees ``hung`` 1 and then recovery.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlxwatch.config import (
    CaptureConfig,
    Config,
    InstanceConfig,
    MetricsConfig,
    ProbeConfig,
    RestartConfig,
)
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.journal.incidents import Journal
from lab.ports import free_port
from lab.server import LabServer, relaunch_argv
from mlxwatch.verdict.policy import STATES

INCIDENT_STATES = ("hung", "capturing", "restarting", "recovering")


def samples(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(text: str, name: str, **labels) -> float | None:
    return samples(text).get((name, tuple(sorted(labels.items()))))


def incident_kinds(text: str) -> dict[str, float]:
    """The lab server's incidents_total by kind, zero series left out."""
    return {dict(labels)["kind"]: v for (name, labels), v in samples(text).items()
            if name == "mlxwatch_incidents_total" and dict(labels).get("server") == "lab" and v}


def captured_kind(state_dir: Path) -> str:
    """The kind of the incident's bundle, as journaled. A spin from outside is a hang whose kind
    the load can move (livelock, or blocked if every snapshot caught it in mx.eval at idle CPU):
    the metrics must count it under the bundle's kind, whichever that is."""
    kind = next(r["kind"] for r in Journal(state_dir).records() if r.get("event") == "captured")
    assert kind in ("livelock", "blocked"), kind
    return kind


def current_state(text: str) -> str | None:
    states = [s for s in STATES if value(text, "mlxwatch_instance_state", server="lab", state=s) == 1]
    return states[0] if len(states) == 1 else None


def config_for(lab: LabServer, state_dir: Path, metrics: MetricsConfig, restart: RestartConfig) -> Config:
    probe = ProbeConfig(interval=1.0, first_token_timeout=2.0, timeout=4.0, failures=2, grace_ceiling=60.0,
                        endpoint_timeout=2.0, startup_timeout=90.0)
    inst = InstanceConfig("lab", lab.url, lab.log_path, lab.pid_file, probe, restart)
    return Config(None, (inst,), state_dir, (), CaptureConfig(snapshots=3, spacing=0.5, ceiling=25.0), metrics)


class Scraper:
    """Scrapes the daemon's endpoint from the test's event loop (the endpoint has its own thread)."""

    def __init__(self, client: httpx.AsyncClient, url: str, task: asyncio.Task) -> None:
        self.client, self.url, self.task = client, url, task
        self.states: list[str] = []  # each distinct state seen, in order

    async def until(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            if self.task.done():
                self.task.result()
                raise AssertionError("the daemon stopped")
            try:
                text = (await self.client.get(self.url)).text
            except httpx.TransportError:
                text = ""
            state = current_state(text) if text else None
            if state and (not self.states or self.states[-1] != state):
                self.states.append(state)
            if text and predicate(text):
                return text
            assert time.monotonic() < deadline, f"timed out waiting for {what}; states seen: {self.states}"
            await asyncio.sleep(0.1)


async def run_with_metrics(config: Config, body) -> None:
    """Run the real daemon, call ``body(scraper)``, stop it, and check that stop closed the port."""
    host, port = config.metrics.listen
    url = f"http://{host}:{port}/metrics"
    stop = asyncio.Event()
    daemon = Daemon(config, config.state_dir)
    task = asyncio.create_task(daemon.run(stop))
    try:
        while not hasattr(daemon, "state"):
            await asyncio.sleep(0.05)
        async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
            await body(Scraper(client, url, task))
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, trust_env=False, timeout=2)
    assert value(config.metrics.textfile.read_text(), "mlxwatch_daemon_running") == 0


async def textfile_matches_endpoint(scraper: Scraper, textfile: Path) -> None:
    """The textfile holds what a scrape shows. Probes change the histograms every second and the
    textfile follows within half a second, so compare until one moment sees both equal."""
    last = None
    for _ in range(100):
        scraped = samples((await scraper.client.get(scraper.url)).text)
        written = samples(textfile.read_text())
        if scraped == written:
            return
        last = {k: (written.get(k), v) for k, v in scraped.items() if written.get(k) != v}
        await asyncio.sleep(0.1)
    raise AssertionError(f"textfile never matched the endpoint; differing (textfile, endpoint): {last}")


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
async def test_a_livelock_moves_state_incident_and_restart_series_and_the_textfile_follows(lab, tmp_path):
    """healthy -> capturing -> restarting/recovering -> healthy in scrapes taken during the
    incident; incidents_total{kind=<the bundle's kind>} and restarts_total{result="ok"} each go up by one,
    the budget down by one; capture and recovery times are set; the textfile equals a scrape."""
    textfile = tmp_path / "mlxwatch.prom"
    metrics = MetricsConfig(listen=("127.0.0.1", free_port()), textfile=textfile)
    restart = RestartConfig("command", argv=relaunch_argv(lab.workdir),
                            timeout=120.0, backoff=1.0, budget=3)
    config = config_for(lab, tmp_path / "state", metrics, restart)

    async def body(scraper: Scraper) -> None:
        before = await scraper.until(lambda t: current_state(t) == "healthy", 60, "healthy")
        assert value(before, "mlxwatch_incidents_total", server="lab", kind="livelock") == 0
        assert value(before, "mlxwatch_restarts_total", server="lab", result="ok") == 0
        assert value(before, "mlxwatch_restart_budget_remaining", server="lab") == 3
        assert value(before, "mlxwatch_probe_success", server="lab") == 1
        scraper.states = ["healthy"]  # from here on (it was `starting` before its first good probe)
        lab.set_fault("spin")
        during = await scraper.until(lambda t: current_state(t) in INCIDENT_STATES, 60, "the incident")
        assert value(during, "mlxwatch_instance_state", server="lab", state="healthy") == 0
        after = await scraper.until(
            lambda t: current_state(t) == "healthy" and value(t, "mlxwatch_restarts_total", server="lab", result="ok"),
            180, "recovery after a restart")
        assert scraper.states[0] == "healthy" and scraper.states[-1] == "healthy"
        assert "capturing" in scraper.states, scraper.states
        assert {"restarting", "recovering"} & set(scraper.states), scraper.states
        assert incident_kinds(after) == {captured_kind(config.state_dir): 1}
        assert sum(v for (n, _), v in samples(after).items() if n == "mlxwatch_incidents_total") == 1
        assert value(after, "mlxwatch_restarts_total", server="lab", result="ok") == 1
        assert value(after, "mlxwatch_restart_budget_remaining", server="lab") == 2
        assert 0 < value(after, "mlxwatch_capture_seconds", server="lab") < 30
        assert value(after, "mlxwatch_last_recovery_seconds", server="lab") > 0
        assert value(after, "mlxwatch_probe_ttft_seconds_count", server="lab") >= 2
        assert value(after, "mlxwatch_probe_duration_seconds_count", server="lab") > \
            value(after, "mlxwatch_probe_ttft_seconds_count", server="lab")  # failed probes have no ttft
        await textfile_matches_endpoint(scraper, textfile)

    await run_with_metrics(config, body)


@pytest.mark.newest_server_only  # about mlxwatch itself: conftest.py
async def test_with_restart_none_a_scrape_shows_hung_then_recovery(lab, tmp_path):
    """No restart allowed: the livelocked instance is ``hung`` (1) in scrapes until the server
    delivers again by itself (the fault switched off), then ``healthy``; one incident under its
    bundle's kind, no restart counted."""
    textfile = tmp_path / "mlxwatch.prom"
    metrics = MetricsConfig(listen=("127.0.0.1", free_port()), textfile=textfile)
    config = config_for(lab, tmp_path / "state", metrics, RestartConfig())

    async def body(scraper: Scraper) -> None:
        await scraper.until(lambda t: current_state(t) == "healthy", 60, "healthy")
        lab.set_fault("spin")
        hung = await scraper.until(lambda t: current_state(t) == "hung" and incident_kinds(t), 90,
                                   "hung with the incident counted")
        assert incident_kinds(hung) == {captured_kind(config.state_dir): 1}
        assert value(hung, "mlxwatch_instance_state", server="lab", state="hung") == 1
        assert value(hung, "mlxwatch_probe_success", server="lab") == 0
        assert sum(v for (n, _), v in samples(hung).items() if n == "mlxwatch_restarts_total") == 0
        await textfile_matches_endpoint(scraper, textfile)
        lab.set_fault("")
        after = await scraper.until(lambda t: current_state(t) == "healthy", 90, "recovery by itself")
        assert value(after, "mlxwatch_instance_state", server="lab", state="hung") == 0
        assert value(after, "mlxwatch_last_recovery_seconds", server="lab") > 0
        assert incident_kinds(after) == incident_kinds(hung)

    await run_with_metrics(config, body)
