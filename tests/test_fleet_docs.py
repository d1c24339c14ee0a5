"""The fleet page's artefacts are real: the alert rules pass promtool (check and unit tests), the
scrape config passes `promtool check config`, the Alertmanager example passes amtool, and a real
node_exporter serves the metrics textfile.

promtool, amtool and node_exporter come from Debian's packages (``scripts/test.sh`` installs
them and then sets MLXWATCH_REQUIRE_PROMETHEUS_TOOLS=1, so they cannot be skipped silently).
Where they are missing, those tests skip with a reason naming the check that ran instead: the
structural checks below run everywhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

from types import SimpleNamespace

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mlxwatch.config import CaptureConfig, Config, InstanceConfig, MetricsConfig
from mlxwatch.daemon.metrics import Metrics, MetricsExporter
from mlxwatch.journal.incidents import Incident
from lab.ports import free_port  # a loopback port free a moment ago

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"
ALERTS = ["MlxwatchServerHung", "MlxwatchIncident", "MlxwatchServerDied", "MlxwatchMemoryRunningOut",
          "MlxwatchGaveUp", "MlxwatchRestartBudgetLow",
          "MlxwatchFirstTokenSlow", "MlxwatchDaemonDown", "MlxwatchDaemonStalled", "MlxwatchConfigReloadFailed",
          "MlxwatchWatcherErrors", "MlxwatchGroupRankDown"]
REQUIRED = os.environ.get("MLXWATCH_REQUIRE_PROMETHEUS_TOOLS") == "1"


def tool(name: str, instead: str) -> str:
    path = shutil.which(name)
    if path is None:
        if REQUIRED:
            pytest.fail(f"{name} is not on PATH but MLXWATCH_REQUIRE_PROMETHEUS_TOOLS=1")
        pytest.skip(f"{name} not installed (no apt here): only {instead} ran")
    return path


def run(argv: list[str], cwd: Path | None = None) -> str:
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{' '.join(argv)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout + out.stderr


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((DOCS / "alerts.yml").read_text())["groups"] for r in g["rules"]]


def populated_metrics() -> Metrics:
    """A Metrics with every series present (each kind of update seen once)."""
    config = Config(None, (InstanceConfig("gemma", "http://127.0.0.1:8080"),), None, (), CaptureConfig())
    group = {"ranks": [{"rank": 0, "host": "127.0.0.1", "pid": 10, "state": "running"},
                       {"rank": 1, "host": "mac2.local", "pid": 20, "state": "stopped"}]}
    state = SimpleNamespace(data={"instances": {"gemma": {"group": group}}})  # what StateFile.data holds
    m = Metrics(lambda: config, state)  # type: ignore[arg-type]  the state file's data alone
    m.on_state("gemma", {"state": "healthy", "restarts": [time.time()],
                         "last_probe": {"at": 1.0, "ok": True, "ttft": 0.2, "total": 0.3}})
    inc = Incident("gemma", kind="livelock", seconds_to_recovery=12.0,
                   restarts=[{"at": 1.0, "result": "ok", "detail": "x"}])
    for event in ("capturing", "captured", "restart", "recovered"):
        m.on_record({"ts": time.time(), "event": event, **inc.to_dict()})
    m.on_state(None, {"last_tick": time.time(), "watcher_errors": 1, "running": True})
    m.on_state("gemma", {"memory": {"used": 2**30, "limit": 2**32, "minutes_left": 25.0}})
    return m


def exported_names() -> set[str]:
    text = populated_metrics().exposition().decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


# --- alert rules


def test_alert_rules_structure():
    """Runs everywhere (the fallback when promtool is missing): the issue's alerts are all there,
    each with a severity and a summary, every mlxwatch metric a rule uses is one we export, and
    every alert has a unit test in alerts.test.yml."""
    found = rules()
    assert [r["alert"] for r in found] == ALERTS
    names = exported_names()
    tested = {t["alertname"] for case in yaml.safe_load((DOCS / "alerts.test.yml").read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    for rule in found:
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        used = set(re.findall(r"\bmlxwatch_[a-z_]+", rule["expr"]))
        assert used <= names, (rule["alert"], used - names)
        assert used or 'job="mlxwatch"' in rule["expr"], rule["alert"]  # MlxwatchDaemonDown: up{job="mlxwatch"}
        assert rule["alert"] in tested, f"{rule['alert']} has no firing case in alerts.test.yml"


def test_alert_rules_pass_promtool_check():
    promtool = tool("promtool", "test_alert_rules_structure")
    assert f"SUCCESS: {len(ALERTS)} rules found" in run([promtool, "check", "rules", str(DOCS / "alerts.yml")])


def test_alert_rules_unit_tests_pass_promtool():
    """Each alert fires (and stays quiet) on synthetic series as docs/alerts.test.yml says."""
    promtool = tool("promtool", "test_alert_rules_structure")
    assert "SUCCESS" in run([promtool, "test", "rules", "alerts.test.yml"], cwd=DOCS)


def test_exposition_passes_promtool_check_metrics():
    promtool = tool("promtool", "the exposition parse in test_alert_rules_structure")
    out = subprocess.run([promtool, "check", "metrics"], input=populated_metrics().exposition(),
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()


# --- the scrape config and the Alertmanager example


def fleet_block(first_line: str) -> str:
    blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / "fleet.md").read_text(), re.S)
    return next(b for b in blocks if b.startswith(first_line))


def test_scrape_config_in_the_fleet_page_passes_promtool(tmp_path):
    """The prometheus.yml shown in docs/fleet.md, with docs/alerts.yml beside it."""
    text = fleet_block("# prometheus.yml")
    config = yaml.safe_load(text)
    assert {j["job_name"] for j in config["scrape_configs"]} == {"mlxwatch", "node"}
    promtool = tool("promtool", "the YAML parse of the scrape config")
    (tmp_path / "prometheus.yml").write_text(text)
    shutil.copy(DOCS / "alerts.yml", tmp_path / "alerts.yml")
    out = run([promtool, "check", "config", str(tmp_path / "prometheus.yml")])
    assert "SUCCESS" in out and f"{len(ALERTS)} rules found" in out


def test_metrics_config_in_the_fleet_page_is_valid(config_file):
    """The two `metrics:` examples load as they are."""
    from mlxwatch.config import load_config

    for first in ("metrics:\n  listen:", "metrics:\n  textfile:"):
        cfg = load_config(config_file(fleet_block(first)))
        assert cfg.metrics.enabled


def test_alertmanager_example_structure():
    """Runs everywhere: receivers exist, matchers name alerts that exist."""
    am = yaml.safe_load((DOCS / "alertmanager.yml").read_text())
    receivers = {r["name"] for r in am["receivers"]}
    routes = [am["route"], *am["route"].get("routes", [])]
    assert {r["receiver"] for r in routes} <= receivers
    mentioned = set(re.findall(r"Mlxwatch[A-Za-z]+", (DOCS / "alertmanager.yml").read_text()))
    assert mentioned <= set(ALERTS)


def test_alertmanager_example_passes_amtool():
    amtool = tool("amtool", "test_alertmanager_example_structure")
    assert "SUCCESS" in run([amtool, "check-config", str(DOCS / "alertmanager.yml")])


# --- the textfile through a real node_exporter


def test_node_exporter_serves_the_textfile(tmp_path):
    """node_exporter's textfile collector reads our file without a parse error and serves the
    same mlxwatch values."""
    exporter_bin = tool("prometheus-node-exporter", "the textfile/endpoint equality in test_metrics.py")
    metrics = populated_metrics()
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    MetricsExporter(MetricsConfig(textfile=textdir / "mlxwatch.prom"), metrics).write_textfile()
    port = free_port()
    proc = subprocess.Popen([exporter_bin, "--collector.disable-defaults", "--collector.textfile",
                             f"--collector.textfile.directory={textdir}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", trust_env=False, timeout=5).text
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "node_exporter did not start"
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)
        proc.stderr.close()
    served = parsed(text)
    assert served[("node_textfile_scrape_error", ())] == 0
    assert {k: v for k, v in served.items() if k[0].startswith("mlxwatch_")} == parsed(metrics.exposition().decode())


def parsed(text: str) -> dict[tuple, float]:
    """Samples with ``le`` as a number: node_exporter writes 1 where prometheus_client writes 1.0."""
    return {(s.name, tuple(sorted((k, str(float(v)) if k == "le" else v) for k, v in s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_readme_links_the_fleet_page_and_documents_the_metrics():
    readme = (ROOT / "README.md").read_text()
    assert "docs/fleet.md" in readme and "docs/metrics.md" in readme
    metrics = (ROOT / "docs" / "metrics.md").read_text()
    assert "mlxwatch_instance_state" in metrics and "metrics:" in metrics
