"""`mlxwatch run` as the process launchd would run, and what survives it: restart budget with a
failing or hanging hook, SIGKILL mid-incident, clean SIGTERM, SIGHUP with a bad config.

The watched URL is a closed loopback port (nothing listens: every probe is refused), so these
tests need no model server; the real-server paths are in test_watchdog_real.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mlxwatch.journal.incidents import Journal
from lab.ports import (
    free_port as closed_port,  # a loopback port free a moment ago
)
from lab.standin import STANDIN  # the token-streaming stand-in's script


def write_config(tmp_path: Path, restart: str, extra: str = "", budget: int = 2) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(f"""
state_dir: {tmp_path / 'state'}
{extra}
capture: {{snapshots: 1, spacing: 0.2, ceiling: 10s}}
instances:
  - name: gone
    url: http://127.0.0.1:{closed_port()}
    probe: {{interval: 0.3, first_token_timeout: 1, timeout: 2, failures: 2, endpoint_timeout: 0.5, startup_timeout: 1}}
    restart: {{{restart}, budget: {budget}, window: 10m, backoff: 0.2, cooldown: 1h}}
""")
    return path


def start_daemon(config: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "mlxwatch", "--config", str(config), "run"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def events(tmp_path: Path) -> list[str]:
    return [r["event"] for r in Journal(tmp_path / "state").records()]


def stop(proc: subprocess.Popen) -> tuple[str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=30)


def test_failing_restart_hook_is_recorded_and_the_budget_gives_up(tmp_path):
    """Each failed restart is journaled; after `budget` restarts the instance is given up and the
    notify hook hears about it with the incident on stdin."""
    notified = tmp_path / "notified.jsonl"
    hook = [sys.executable, "-c", f"import sys; open({str(notified)!r}, 'a').write(sys.stdin.read() + '\\n')"]
    failing = f'command: ["{sys.executable}", "-c", "import sys; sys.exit(7)"]'
    proc = start_daemon(write_config(tmp_path, failing, extra=f"notify: {json.dumps(hook)}"))
    try:
        wait_for(lambda: "gave_up" in events(tmp_path), 60, "gave_up")
    finally:
        out, err = stop(proc)
    assert proc.returncode == 0, err
    evs = events(tmp_path)
    assert evs.count("restart_failed") == 2 and evs.count("restarting") == 2
    last = [r for r in Journal(tmp_path / "state").records() if r["event"] == "gave_up"][-1]
    assert [r["result"] for r in last["restarts"]] == ["failed", "failed"]
    assert "exit 7" in last["restarts"][0]["detail"]
    assert last["kind"] == "crashed"  # nothing listens: the bundle says the process is gone
    wait_for(lambda: notified.exists() and "gave_up" in notified.read_text(), 10, "notify")
    kinds = [json.loads(line)["event"] for line in notified.read_text().splitlines() if line.strip()]
    assert kinds[0] == "verdict" and "gave_up" in kinds
    assert "GAVE UP" in err


def test_hanging_restart_hook_times_out_and_counts(tmp_path):
    """A hook that hangs is ended at its timeout, recorded as failed, and uses the budget."""
    hanging = f'command: ["{sys.executable}", "-c", "import time; time.sleep(120)"], timeout: 1s'
    proc = start_daemon(write_config(tmp_path, hanging, budget=1))
    try:
        wait_for(lambda: "gave_up" in events(tmp_path), 60, "gave_up")
    finally:
        stop(proc)
    last = [r for r in Journal(tmp_path / "state").records() if r["event"] == "gave_up"][-1]
    assert "timed out after 1s" in last["restarts"][0]["detail"]


def test_sigkill_mid_incident_leaves_a_journal_status_reports(tmp_path):
    """Kill -9 the daemon while a restart is running: status shows the open incident and where
    it stopped; the next daemon start reports it and closes it."""
    slow = f'command: ["{sys.executable}", "-c", "import time; time.sleep(300)"], timeout: 10m'
    config = write_config(tmp_path, slow)
    proc = start_daemon(config)
    try:
        wait_for(lambda: "restarting" in events(tmp_path), 60, "restarting")
        wait_for(lambda: psutil.Process(proc.pid).children(recursive=True), 30, "the restart hook")
        hook = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=10)
    finally:
        for child in hook:  # the hook we caused to start: ended by its own PID
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
    status = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(config), "status", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 1, status.stderr  # no daemon runs: not a healthy status for a monitor
    data = json.loads(status.stdout)
    assert data["daemon"]["running"] is False
    (gone,) = data["instances"]
    assert gone["open_incident"]["stopped_at_event"] == "restarting"
    human = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(config), "status"],
                           capture_output=True, text=True, timeout=60)
    assert "daemon not running" in human.stdout
    assert f"gone: incident {gone['open_incident']['id']} open: daemon stopped at restarting" in human.stdout
    again = start_daemon(config)
    try:
        wait_for(lambda: "closed" in events(tmp_path), 30, "closed")
    finally:
        _, err = stop(again)
    assert "was left open by a killed daemon at 'restarting'" in err


def test_sigterm_stops_cleanly_and_sighup_keeps_old_config_when_new_is_bad(tmp_path):
    """SIGHUP with a broken config: reported, old config kept; SIGTERM: exit 0, state says stopped."""
    config = write_config(tmp_path, "none: true")
    proc = start_daemon(config)
    try:
        wait_for(lambda: (tmp_path / "state" / "state.json").exists(), 30, "state file")
        config.write_text("instances: [{name: x, url: 'http://127.0.0.1:1', probe: {timeout: -1}}]")
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None
    finally:
        out, err = stop(proc)
    assert proc.returncode == 0
    assert "config reload failed, keeping the old config" in err
    assert "instances[0].probe.timeout: must be a positive duration (got -1)" in err
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["daemon"]["running"] is False


def test_run_without_config_points_to_demo(tmp_path, monkeypatch):
    """No config anywhere: exit 2 with one line that says what to do."""
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("MLXWATCH_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "mlxwatch", "run"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "nothing to watch" in line and "mlxwatch demo" in line


def test_resume_command_writes_a_request_the_daemon_consumes(tmp_path):
    """`mlxwatch resume NAME` works without a running daemon; an unknown name is refused."""
    config = write_config(tmp_path, "none: true")
    ok = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(config), "resume", "gone"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and (tmp_path / "state" / "resume" / "gone").exists()
    bad = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(config), "resume", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no instance named 'nope'" in bad.stderr


# --- reload is validated like start; signals before ready; removed instances dropped


def state_json(tmp_path: Path) -> dict:
    try:
        return json.loads((tmp_path / "state" / "state.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return {}


def last_reload(tmp_path: Path) -> dict:
    return state_json(tmp_path).get("daemon", {}).get("last_reload") or {}


@pytest.mark.parametrize("nothing", ["instances: []", ""], ids=["no instances", "empty file"])
def test_reload_refuses_a_config_that_run_refuses_and_keeps_the_old_one(tmp_path, nothing):
    """Measured: an empty config sent with SIGHUP was applied ("watching none", at INFO) though
    `run` refuses the same file with exit 2. Now it is refused with one WARNING line naming the
    file and the problem, journaled and recorded as a failed reload, and the old config runs on."""
    config = write_config(tmp_path, "none: true")
    empty = tmp_path / "empty.yaml"
    empty.write_text(f"state_dir: {tmp_path / 'state'}\n{nothing}" if nothing else "")
    refused = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(empty), "run"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "no instances to watch" in refused.stderr
    proc = start_daemon(config)
    try:
        wait_for(lambda: "gone" in state_json(tmp_path).get("instances", {}), 30, "the instance to be watched")
        config.write_text(empty.read_text())
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: last_reload(tmp_path), 30, "the reload to be recorded")
        assert proc.poll() is None
        assert "gone" in state_json(tmp_path).get("instances", {})  # the old config runs on (not dropped)
    finally:
        out, err = stop(proc)
    assert proc.returncode == 0, err
    reload = last_reload(tmp_path)
    assert reload["ok"] is False and str(config) in reload["message"] and "no instances to watch" in reload["message"]
    (line,) = [ln for ln in err.splitlines() if "config reload" in ln]
    assert " WARNING " in line and str(config) in line and "no instances to watch" in line
    assert "watching none" not in err
    (noted,) = [r for r in Journal(tmp_path / "state").records() if r["event"] == "config_reload"]
    assert noted["ok"] is False and "no instances to watch" in noted["message"]


# Runs `mlxwatch --config FILE run` in this process after holding it at one point of its start
# (touching MARKER, then waiting for RELEASE), so a test can signal it exactly there.
HELD_START = r"""
import sys, time
from pathlib import Path

marker, release, where = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


def hold():
    marker.touch()
    deadline = time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


if where == "config read":  # a config on a slow disk
    import mlxwatch.config as config

    load = config.load_config

    def held_load(path):
        config.load_config = load
        hold()
        return load(path)

    config.load_config = held_load
else:  # the daemon's own imports, as a cold start on a loaded Mac takes them
    class Hold:
        def find_spec(self, name, path=None, target=None):
            if name == "mlxwatch.daemon.supervisor":
                sys.meta_path.remove(self)
                hold()
            return None

    sys.meta_path.insert(0, Hold())

from mlxwatch.cli import main

sys.argv = ["mlxwatch", *sys.argv[4:]]
main()
"""


@pytest.mark.parametrize("where", ["import", "config read"])
def test_a_sighup_while_the_daemon_starts_is_applied_not_fatal(tmp_path, where):
    """Measured: a SIGHUP 0.3 s after start killed the daemon (exit 129): the handlers were set
    only once the event loop ran, after the imports and the config read. Now the signal is
    remembered and the config read again once the daemon is ready."""
    config = write_config(tmp_path, "none: true")
    marker, release = tmp_path / "held", tmp_path / "release"
    proc = subprocess.Popen([sys.executable, "-c", HELD_START, str(marker), str(release), where,
                             "--config", str(config), "run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: marker.exists() or proc.poll() is not None, 60, "the start to reach the held point")
        proc.send_signal(signal.SIGHUP)
        release.touch()
        wait_for(lambda: last_reload(tmp_path) or proc.poll() is not None, 60, "the remembered reload")
        assert proc.poll() is None, f"the daemon died with {proc.returncode}"
    finally:
        out, err = stop(proc)
    assert proc.returncode == 0, err
    assert last_reload(tmp_path)["ok"] is True
    assert "SIGHUP arrived while starting" in err


def start_standin(tmp_path: Path) -> tuple[str, subprocess.Popen]:
    """The lab's token-streaming stand-in on a free loopback port: a healthy server."""
    port = closed_port()
    proc = subprocess.Popen([sys.executable, STANDIN, "--ports", str(port)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return f"http://127.0.0.1:{port}", proc


def status_json(config: Path) -> tuple[int, dict]:
    proc = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(config), "status", "--json"],
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, json.loads(proc.stdout)


def test_an_instance_removed_while_it_stays_hung_is_dropped(tmp_path):
    """Measured: an instance removed from the config while its incident stayed open was never
    dropped (its watcher kept probing, `status` reported it and exited 1 forever). Now it is
    dropped at the reload: watcher stopped, incident closed as `removed`, gone from the state."""
    url, standin = start_standin(tmp_path)
    ok = f"""
  - name: ok
    url: {url}
    probe: {{interval: 0.3, first_token_timeout: 2, timeout: 3, failures: 2, endpoint_timeout: 1}}
    restart: none
"""
    config = write_config(tmp_path, "none: true")
    config.write_text(config.read_text() + ok)
    proc = start_daemon(config)
    try:
        wait_for(lambda: "awaiting_recovery" in events(tmp_path), 60, "the incident of the dead instance")
        config.write_text(f"state_dir: {tmp_path / 'state'}\ninstances:{ok}")
        proc.send_signal(signal.SIGHUP)
        def closed():
            return [r for r in Journal(tmp_path / "state").records()
                    if r["event"] == "closed" and r["instance"] == "gone"]
        wait_for(closed, 30, "the removed instance's incident to be closed")
        wait_for(lambda: status_json(config)[0] == 0, 60, "status to report only the healthy instance")
        code, status = status_json(config)
        assert [i["name"] for i in status["instances"]] == ["ok"]
        assert "gone" not in state_json(tmp_path)["instances"]
        assert closed()[0]["reason"] == "removed"
        n = events(tmp_path).count("captured")
        time.sleep(1.0)  # several of its probe intervals: its watcher is stopped
        assert events(tmp_path).count("captured") == n
        assert not any(r.get("instance") == "gone" for r in Journal(tmp_path / "state").records()
                       if r["ts"] > closed()[0]["ts"])
    finally:
        stop(proc)
        standin.kill()
        standin.communicate(timeout=10)
    assert proc.returncode == 0


def test_a_sigterm_while_the_daemon_starts_stops_it_cleanly(tmp_path):
    """A SIGTERM before the event loop runs (launchd unloading an agent that just started) is
    remembered too: exit 0 with a line, before any watching, instead of death by the signal."""
    config = write_config(tmp_path, "none: true")
    marker, release = tmp_path / "held", tmp_path / "release"
    proc = subprocess.Popen([sys.executable, "-c", HELD_START, str(marker), str(release), "import",
                             "--config", str(config), "run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: marker.exists() or proc.poll() is not None, 60, "the start to reach the held point")
        proc.send_signal(signal.SIGTERM)
        release.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "SIGTERM arrived while starting" in err
    assert "daemon_start" not in events(tmp_path)
