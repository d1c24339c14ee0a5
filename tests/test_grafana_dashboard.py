"""The Grafana dashboard (docs/grafana/mlxwatch.json) reads series mlxwatch really exports: every
metric name in every panel's PromQL is in the exporter's own output (rendered here from
``Metrics``, never a list typed in), every ``by (...)`` label is one those series carry, and
promtool evaluates every panel's expression on series recorded from the exporter to at least
one number (not an empty result, not NaN), as docs/alerts.yml is tested.

promtool comes from Debian's package (``scripts/test.sh``; CONTRIBUTING puts
``.venvs/tools/bin`` on PATH); where it is missing that test skips, naming the structural
checks that ran instead."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_fleet_docs import tool

from mlxwatch.config import CaptureConfig, Config, InstanceConfig
from mlxwatch.daemon.metrics import Metrics
from mlxwatch.front.delivery import OUTCOMES, DeliveryView, Observations
from mlxwatch.journal.incidents import Incident

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "mlxwatch.json"
# Grafana's variables, as a query with every Mac and server selected would have them
VARIABLES = {"$__rate_interval": "5m", "$__range": "10m", "$instance": ".*", "$server": ".*"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "le", "inf", "nan"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def targets() -> list[tuple[str, str]]:
    """(panel title, expression) of every query, rows' panels included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend((p["title"], t["expr"]) for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(dashboard()["panels"])
    return out


def substituted(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def recorded() -> tuple[str, str]:
    """Two scrapes of the real exporter, some minutes apart: one instance that was hung,
    captured, restarted and recovered, with a front door that served requests, then more of
    the same (probes, requests, another incident)."""
    config = Config(None, (InstanceConfig("gemma", "http://127.0.0.1:8080"),), None, (), CaptureConfig())
    m = Metrics(lambda: config)
    now = time.time()

    def round_of(n: int, at: float) -> None:
        for k in range(5):
            m.on_state("gemma", {"state": "healthy", "restarts": [at], "last_probe": {
                "at": at + n * 10 + k, "ok": True, "ttft": 0.05 * (k + 1), "total": 0.3 * (k + 1)}})
        inc = Incident("gemma", kind=("livelock", "blocked")[n], seconds_to_recovery=12.0 + n,
                       restarts=[{"at": at, "result": "ok", "detail": "x"}])
        for event in ("capturing", "captured", "restart", "recovered"):
            m.on_record({"ts": at, "event": event, **inc.to_dict()})
        m.on_front("gemma", DeliveryView((), None, 0, {o: (n + 1) * (i + 2) for i, o in enumerate(OUTCOMES)}),
                   Observations(tuple(0.1 * (k + 1) for k in range(6)), tuple(10.0 * (k + 1) for k in range(6))))
        m.on_state(None, {"last_tick": at, "watcher_errors": n, "running": True})
        m.on_state("gemma", {"memory": {"used": 2**30 + n * 2**20, "limit": 2**32, "minutes_left": 40.0 - n}})

    round_of(0, now)
    first = m.exposition().decode()
    round_of(1, now + 300)
    return first, m.exposition().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if not s.name.endswith("_created")}


def test_the_dashboard_has_the_panels_people_expect():
    """Instance states, verdicts and restarts, probe first-token latency, capture durations,
    the door's requests by outcome and tokens/s; a datasource, Mac and server to choose."""
    d = dashboard()
    exprs = " ".join(e for _, e in targets())
    for metric in ("mlxwatch_instance_state", "mlxwatch_incidents_total", "mlxwatch_restarts_total",
                   "mlxwatch_probe_ttft_seconds_bucket", "mlxwatch_capture_seconds", "mlxwatch_front_requests_total",
                   "mlxwatch_front_tokens_per_second_bucket"):
        assert metric in exprs, metric
    assert {v["name"] for v in d["templating"]["list"]} == {"datasource", "instance", "server"}
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] == "mlxwatch"


def test_every_metric_and_label_in_the_panels_is_exported():
    """Each name in each expression is a series the exporter writes; each ``by`` label is one
    of its labels (or Prometheus's own ``instance`` and ``job``)."""
    _, text = recorded()
    exported = samples(text)
    labels: dict[str, set[str]] = {}
    for name, pairs in exported:
        labels.setdefault(name, set()).update(k for k, _ in pairs)
    assert len(targets()) >= 15
    for title, expr in targets():
        expr = substituted(expr)
        names = set(re.findall(r"\bmlxwatch_[a-z_]+\b", expr))
        assert names, (title, expr)
        missing = names - labels.keys()
        assert not missing, f"{title}: {sorted(missing)} not exported (exported: {sorted(labels)})"
        have = set().union(*(labels[n] for n in names)) | {"instance", "job"}
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            unknown = {g.strip() for g in group.split(",")} - have
            assert not unknown, f"{title}: by {sorted(unknown)}: no such label on {sorted(names)}"
        for label in re.findall(r"\b([a-z_]+)=~?\"", expr):
            assert label in have, f"{title}: selects on {label}, no such label"


def test_promtool_evaluates_every_panel_on_recorded_series(tmp_path):
    """Each panel's expression, on series recorded from the exporter (two scrapes, counters
    rising between them, as Prometheus would have scraped every minute), gives numbers."""
    promtool = tool("promtool", "test_every_metric_and_label_in_the_panels_is_exported")
    before, after = (samples(t) for t in recorded())
    series = []
    for (name, pairs), last in sorted(after.items()):
        first = before.get((name, pairs), 0.0)
        rising = name.endswith(("_total", "_bucket", "_count", "_sum"))
        points = [first + (last - first) * i / 10 if rising else last for i in range(11)]
        labels = ",".join([f'{k}="{v}"' for k, v in pairs] + ['job="mlxwatch"', 'instance="mac1:9464"'])
        series.append({"series": f"{name}{{{labels}}}", "values": " ".join(repr(float(p)) for p in points)})
    checks = [{"expr": f"clamp_max(count(({substituted(e)}) == ({substituted(e)})), 1)", "eval_time": "10m",
               "exp_samples": [{"labels": "{}", "value": 1}]} for _, e in targets()]
    (tmp_path / "dashboard.test.yml").write_text(yaml.safe_dump({
        "evaluation_interval": "1m", "rule_files": [],
        "tests": [{"name": "every panel gives numbers", "interval": "1m", "input_series": series,
                   "promql_expr_test": checks}]}))
    out = subprocess.run([promtool, "test", "rules", "dashboard.test.yml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr


@pytest.mark.parametrize("page", ["metrics.md", "fleet.md"])
def test_the_metrics_and_fleet_pages_link_the_dashboard(page):
    assert "grafana/mlxwatch.json" in (ROOT / "docs" / page).read_text()
