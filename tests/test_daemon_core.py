"""The daemon core's trust properties, without a model server: supervision, lifecycle, one
daemon per state dir, reload, identity, state that is tracked rather than re-guessed.

The watched servers are a closed loopback port (every probe refused) or the lab's stand-in
(``tests/lab/standin.py``: a token-streaming server whose command line is not mlx-lm's).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from mlxwatch.config import (
    CaptureConfig,
    Config,
    InstanceConfig,
    ProbeConfig,
    RestartConfig,
)
from mlxwatch.daemon.status import collect_status
from mlxwatch.output.status import render_status
from mlxwatch.daemon import supervisor as supervisor_module
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.errors import RestartError, StateError
from mlxwatch.host.process import ProcessIdentity, lookup_server
from mlxwatch.journal import incidents as journal_module
from mlxwatch.journal.incidents import Journal
from mlxwatch.journal.state import StateFile
from lab.ports import free_port  # a loopback port free a moment ago
from test_delivery_units import _end, _sleeper
from mlxwatch.restart.methods import OK, RestartContext, RestartOutcome, restart

FAST = ProbeConfig(interval=0.2, suspect_interval=0.1, first_token_timeout=0.5, timeout=1.0, failures=1,
                   endpoint_timeout=0.3, startup_timeout=30.0)


def config(state_dir: Path, url: str, restart: RestartConfig = RestartConfig(), probe: ProbeConfig = FAST,
           notify: tuple[str, ...] = (), log: Path | None = None, name: str = "gone") -> Config:
    return Config(None, (InstanceConfig(name, url, log, None, probe, restart),), state_dir, notify,
                  CaptureConfig(snapshots=1, spacing=0.1, ceiling=5.0))


class Running:
    """A daemon running in this event loop, stopped (cleanly) at the end of the block."""

    def __init__(self, cfg: Config, **overrides) -> None:
        heartbeat = overrides.pop("heartbeat", 3600.0)
        self.daemon = Daemon(cfg, cfg.state_dir, shared_overrides=overrides, heartbeat=heartbeat)
        self.stop, self.reload = asyncio.Event(), asyncio.Event()
        self.journal = Journal(cfg.state_dir)
        self.cfg = cfg

    async def __aenter__(self) -> "Running":
        self.task = asyncio.create_task(self.daemon.run(self.stop, self.reload, load_config=lambda: self.cfg))
        await self.until(lambda: hasattr(self.daemon, "shared"), what="the daemon to start")
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 30)

    def events(self) -> list[str]:
        return [r["event"] for r in self.journal.records()]

    async def until(self, predicate, timeout: float = 30.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.task.done():
                self.task.result()  # raise what ended it
            assert time.monotonic() < deadline, f"timed out waiting for {what}; journal: {self.events()}"
            await asyncio.sleep(0.05)


async def never(*args, **kwargs):
    await asyncio.Event().wait()


# --- lifecycle: every stop, in every state, leaves a journal the next start closes


async def _block_capture(request):
    await never()


@pytest.mark.parametrize("state, restart_cfg, overrides, event", [
    ("capturing", RestartConfig("command", argv=("true",)), {"capture_fn": _block_capture}, "capturing"),
    ("restarting", RestartConfig("command", argv=("true",)), {"restart_fn": never}, "restarting"),
    ("awaiting_recovery", RestartConfig(), {}, "awaiting_recovery"),
    ("gave_up", RestartConfig("command", argv=("false",), budget=1, backoff=0.1), {}, "gave_up"),
])
async def test_clean_stop_in_any_state_is_closed_coherently_by_the_next_start(tmp_path, monkeypatch, state, restart_cfg,
                                                                               overrides, event):
    """Measured: after SIGTERM mid-incident every later start crashed on the `interrupted`
    record (TypeError in report_interrupted): a launchd crash loop. Now the next start closes
    the incident, keeping where it stopped, and runs on."""
    monkeypatch.setattr(supervisor_module, "STOP_RESTART_WAIT", 0.3)  # the restart that never ends is waited for
    cfg = config(tmp_path / "state", f"http://127.0.0.1:{free_port()}", restart_cfg)
    async with Running(cfg, **overrides) as run:
        await run.until(lambda: event in run.events(), what=event)
    records = run.journal.records()
    assert records[-1]["event"] == "interrupted" and records[-1]["reason"] == "daemon stopped"
    assert [r["id"] for r in run.journal.open_incidents()] == [records[-1]["id"]]
    async with Running(cfg, **overrides) as again:
        await again.until(lambda: "closed" in again.events(), what="closed")
        closed = next(r for r in again.journal.records() if r["event"] == "closed")
        assert closed["id"] == records[-1]["id"] and closed["stopped_at_event"] == records[-1]["state"]
        assert closed["stopped_reason"] == "daemon stopped" and "stopped mid-incident" in closed["reason"]
        assert closed["state"] == records[-1]["state"]
    assert records[-1]["id"] not in [r["id"] for r in again.journal.open_incidents()]


async def test_a_stop_lets_a_restart_under_way_finish(tmp_path):
    """Found by a new user: SIGTERM while a command hook ran (`sleep 25; ... relaunch`) killed
    the hook half-way, leaving the server down, with only `stopped` in the log. Now a stop
    waits for the restart under way (up to STOP_RESTART_WAIT) and journals its outcome."""
    cfg = config(tmp_path / "state", f"http://127.0.0.1:{free_port()}", RestartConfig("command", argv=("true",)))
    hook = {"finished": False}

    async def restart_fn(ctx):
        await asyncio.sleep(1.0)  # the hook's work: stop the server, then start it
        hook["finished"] = True
        return RestartOutcome(OK, "restarted")

    async with Running(cfg, restart_fn=restart_fn) as run:
        await run.until(lambda: "restarting" in run.events(), what="restarting")
    assert hook["finished"], "the stop cut the restart half-way"
    events = run.events()
    assert "restart" in events and events.index("restart") < events.index("interrupted"), events


async def test_a_restart_still_running_after_the_stops_wait_is_ended_and_said(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(supervisor_module, "STOP_RESTART_WAIT", 0.3)
    cfg = config(tmp_path / "state", f"http://127.0.0.1:{free_port()}", RestartConfig("command", argv=("true",)))
    async with Running(cfg, restart_fn=never) as run:
        await run.until(lambda: "restarting" in run.events(), what="restarting")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("gone: its restart was still running 0.3s into the stop and is ended" in m for m in said), said
    assert run.events()[-1] == "interrupted"


def test_sigterm_mid_incident_then_run_again_keeps_running(tmp_path):
    """The crash loop as launchd saw it: `mlxwatch run`, SIGTERM mid-restart, `mlxwatch run`
    again must stay up (not exit 1), and status must not report a stale open incident."""
    path = tmp_path / "config.yaml"
    path.write_text(f"""
state_dir: {tmp_path / 'state'}
capture: {{snapshots: 1, spacing: 0.1, ceiling: 5s}}
instances:
  - name: gone
    url: http://127.0.0.1:{free_port()}
    probe: {{interval: 0.2, first_token_timeout: 0.5, timeout: 1, failures: 1, endpoint_timeout: 0.3}}
    restart: {{command: ["{sys.executable}", "-c", "import time; time.sleep(60)"], timeout: 2m}}
""")
    # `mlxwatch run`, its stop's wait for the restart under way cut from 10 s to 1 s: each stop
    # here comes mid-restart, and the hook never ends (as in the in-process tests above).
    cmd = [sys.executable, "-c", "from mlxwatch.daemon import supervisor; supervisor.STOP_RESTART_WAIT = 1.0; "
           "from mlxwatch.cli import main; main()", "--config", str(path), "run"]
    journal = Journal(tmp_path / "state")
    first = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while "restarting" not in [r["event"] for r in journal.records()]:
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=30)
    assert first.returncode == 0
    second = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while "closed" not in [r["event"] for r in journal.records()]:
            assert second.poll() is None, second.communicate()[1]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert second.poll() is None
    finally:
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=30)
    assert second.returncode == 0, err
    assert "Traceback" not in err


# --- supervision


async def test_a_crashing_watcher_is_logged_journaled_and_restarted(tmp_path, caplog):
    """Measured: an exception in one instance's loop ended its task silently, the instance
    stayed "healthy" in status and a livelock went unhandled. Now the supervisor logs it with
    its traceback, journals `watcher_error`, counts it, and the watcher goes on to a verdict."""
    calls = []

    def flaky_lookup(url, pid_file):
        calls.append(url)
        if len(calls) == 1:
            raise RuntimeError("boom in lookup")
        return lookup_server(url, pid_file)

    cfg = config(tmp_path / "state", f"http://127.0.0.1:{free_port()}")
    caplog.set_level(logging.ERROR, "mlxwatch")
    async with Running(cfg, lookup_fn=flaky_lookup) as run:
        await run.until(lambda: "verdict" in run.events(), what="verdict after the crash")
        assert run.daemon.watcher_errors == 1
    events = run.events()
    assert events.index("watcher_error") < events.index("verdict")
    err = next(r for r in run.journal.records() if r["event"] == "watcher_error")
    assert err["instance"] == "gone" and err["error"] == "RuntimeError: boom in lookup"
    state = json.loads((tmp_path / "state" / "state.json").read_text())
    assert state["daemon"]["watcher_errors"] == 1
    assert state["instances"]["gone"]["watcher_error"]["error"] == "RuntimeError: boom in lookup"
    assert any(r.exc_info and "boom in lookup" in str(r.exc_info[1]) for r in caplog.records)


async def test_a_full_disk_while_journaling_does_not_stop_the_watcher(tmp_path, monkeypatch, caplog):
    """Measured: ENOSPC on a journal write crashed the watcher at every restart, so nothing was
    probed until the disk was freed, and status still said healthy. Now the record waits in
    memory, the watcher goes on, and the journal gets every record, in order, once it can."""
    real = journal_module.append_record
    full = {"on": False, "seen": False}

    def append(path, record):
        if record["event"] == "verdict" and not full["seen"]:
            full["on"] = full["seen"] = True
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, record)

    monkeypatch.setattr(journal_module, "append_record", append)
    cfg = config(tmp_path / "state", f"http://127.0.0.1:{free_port()}")
    caplog.set_level(logging.ERROR, "mlxwatch")
    async with Running(cfg) as run:
        await run.until(lambda: run.daemon.watchers["gone"].detect.state == "hung" and run.daemon.journal.backlog,
                        what="the incident to go on with the disk full")
        assert "verdict" not in run.events()
        probed = run.daemon.state.instance("gone")["last_probe"]["at"]
        await run.until(lambda: run.daemon.state.instance("gone")["last_probe"]["at"] > probed, what="more probes")
        full["on"] = False  # space again: the next record brings the backlog with it
        run.daemon.journal.note("test_marker")
    events = run.events()
    assert events.index("verdict") < events.index("captured") < events.index("awaiting_recovery") < events.index("test_marker")
    assert run.daemon.watcher_errors == 0
    assert sum("cannot write the journal" in r.message for r in caplog.records) == 1


# --- one daemon per state dir


async def test_a_second_daemon_on_the_same_state_dir_is_refused(tmp_path):
    """Measured: two daemons both captured and restarted the same hang (six hook runs)."""
    cfg = config(tmp_path / "state", f"http://127.0.0.1:{free_port()}")
    async with Running(cfg) as run:
        await run.until(lambda: "daemon_start" in run.events())
        with pytest.raises(StateError, match=f"another mlxwatch daemon \\(PID {os.getpid()}\\) is running"):
            await Daemon(cfg, cfg.state_dir).run(asyncio.Event())
        path = tmp_path / "config.yaml"
        path.write_text(f"state_dir: {cfg.state_dir}\ninstances: [{{name: x, url: 'http://127.0.0.1:1'}}]\n")
        proc = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "mlxwatch", "--config", str(path), "run"],
                                       capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        (line,) = proc.stderr.strip().splitlines()
        assert f"PID {os.getpid()}" in line and "Traceback" not in proc.stderr
        status = collect_status(cfg, cfg.state_dir)
        assert status["daemon"]["running"] is True and status["daemon"]["pid"] == os.getpid()
    assert collect_status(cfg, cfg.state_dir)["daemon"]["running"] is False


async def test_status_of_a_running_daemon_mid_incident_says_in_progress(tmp_path, monkeypatch):
    """A running daemon's open incident is not "daemon stopped at ..."."""
    from rich.console import Console

    monkeypatch.setattr(supervisor_module, "STOP_RESTART_WAIT", 0.3)  # the stop's wait for a restart that never ends

    cfg = config(tmp_path / "state", f"http://127.0.0.1:{free_port()}", RestartConfig("command", argv=("true",)))
    async with Running(cfg, restart_fn=never) as run:
        await run.until(lambda: "restarting" in run.events())
        console = Console(width=200, record=True, color_system=None)
        render_status(collect_status(cfg, cfg.state_dir), console)
        text = console.export_text()
    assert "daemon running" in text and "in progress: restarting" in text and "daemon stopped" not in text


# --- reload


async def test_reload_mid_incident_applies_when_it_ends_and_never_orphans_it(tmp_path, standin):
    """Measured: with `restart: none`, a SIGHUP mid-incident orphaned the open incident and
    opened a second one for the same outage, and the new settings were never applied."""
    (url,), mode, _ = standin("hang")
    cfg = config(tmp_path / "state", url)
    async with Running(cfg) as run:
        await run.until(lambda: "awaiting_recovery" in run.events())
        old_watcher = run.daemon.watchers["gone"]
        slower = replace(cfg.instances[0], probe=replace(FAST, interval=0.3))
        run.cfg = replace(cfg, instances=(slower,))
        run.reload.set()
        await run.until(lambda: "gone" in run.daemon.pending, what="pending change")
        await asyncio.sleep(1.0)  # several probes while the incident is open
        assert run.daemon.watchers["gone"] is old_watcher
        mode.write_text("ok")
        await run.until(lambda: "recovered" in run.events())
        await run.until(lambda: run.daemon.watchers["gone"].inst.probe.interval == 0.3, what="new settings applied")
    assert run.events().count("verdict") == 1
    assert run.journal.open_incidents() == []


async def test_a_reload_back_mid_incident_voids_the_change_still_waiting(tmp_path, standin):
    """Found in review: reloaded to B mid-incident, then back to A, the watcher took B once the
    incident ended (the waiting change was never dropped)."""
    (url,), mode, _ = standin("hang")
    cfg = config(tmp_path / "state", url)
    async with Running(cfg) as run:
        await run.until(lambda: "awaiting_recovery" in run.events())
        old_watcher = run.daemon.watchers["gone"]
        run.cfg = replace(cfg, instances=(replace(cfg.instances[0], probe=replace(FAST, interval=0.3)),))
        run.reload.set()
        await run.until(lambda: "gone" in run.daemon.pending, what="pending change")
        run.cfg = cfg
        run.reload.set()
        await run.until(lambda: "gone" not in run.daemon.pending, what="the change voided")
        mode.write_text("ok")
        await run.until(lambda: "recovered" in run.events())
        assert run.daemon.watchers["gone"] is old_watcher
        assert run.daemon.watchers["gone"].inst == cfg.instances[0]


async def test_reload_applies_top_level_settings_and_refuses_a_new_state_dir(tmp_path):
    """Measured: notify and capture changes never reached unchanged instances."""
    cfg = config(tmp_path / "state", f"http://127.0.0.1:{free_port()}", RestartConfig("command", argv=("true",)))
    async with Running(cfg, restart_fn=never) as run:
        await run.until(lambda: "daemon_start" in run.events())
        run.cfg = replace(cfg, notify=("/bin/true",), capture=CaptureConfig(snapshots=2))
        run.reload.set()
        await run.until(lambda: run.daemon.shared.notifier.argv == ("/bin/true",))
        assert run.daemon.shared.capture.snapshots == 2
        run.cfg = replace(run.cfg, state_dir=tmp_path / "elsewhere")
        run.reload.set()
        await run.until(lambda: not run.daemon.state.data["daemon"].get("last_reload", {}).get("ok", True))
        assert "state_dir changed" in run.daemon.state.data["daemon"]["last_reload"]["message"]
        assert run.daemon.config.state_dir == tmp_path / "state"


# --- identity: never signal a stranger


async def test_a_stranger_on_the_port_is_reported_and_never_signalled(tmp_path, standin):
    """Measured: the server died, another program took its port, and mlxwatch adopted its PID,
    classified it, sent it SIGTERM and passed its PID to the hook."""
    (url,), _, stranger = standin("hang")
    restart_cfg = RestartConfig("signal", grace=1.0, budget=1, backoff=0.1)
    cfg = config(tmp_path / "state", url, restart_cfg)
    async with Running(cfg) as run:
        await run.until(lambda: "restart" in run.events() or "nothing_to_restart" in run.events())
    verdict = next(r for r in run.journal.records() if r["event"] == "verdict")
    assert verdict["pid"] is None
    assert verdict["stranger"].startswith(f"port {url.rsplit(':', 1)[1]} taken by PID {stranger.pid}")
    assert "nothing_to_restart" in run.events() and "restart" not in run.events()
    assert stranger.poll() is None  # still running: never signalled
    captured = next(r for r in run.journal.records() if r["event"] == "captured")
    evidence = json.loads((Path(captured["bundle"]) / "manifest.json").read_text())["classification"]["evidence"]
    assert any(f"taken by PID {stranger.pid}" in line and "never captured or signalled" in line for line in evidence)


@pytest.mark.timeout(20)
def test_a_pid_file_that_is_a_fifo_or_holds_no_pid_is_one_clear_line_and_never_blocks(tmp_path):
    """Measured (an adversarial review): a FIFO as pid_file hung `doctor`, and `mlxwatch run`
    logged "stopped" on SIGINT but never exited (its lookup threads blocked in open()); a file
    holding -1 printed "ValueError: pid must be a positive integer"."""
    fifo = tmp_path / "server.pid"
    os.mkfifo(fifo)
    found = lookup_server("http://127.0.0.1:9", fifo)
    assert found.identity is None and found.detail == f"cannot read a PID from {fifo}: it is not a regular file"
    negative = tmp_path / "negative.pid"
    negative.write_text("-1\n")
    assert lookup_server("http://127.0.0.1:9", negative).detail == f"cannot read a PID from {negative}: -1 is no PID"


async def test_a_pid_files_process_that_never_listens_is_never_signalled(tmp_path, standin):
    """Measured (an adversarial review): a pid_file naming a `sleep` (a wrapper's PID, a reused
    one), the URL served by a stranger that hangs: past startup_timeout the daemon "acted on"
    the PID file's process and sent it SIGTERM. A process that never listened while another
    serves the URL, and is no mlx-lm server, is not the server: nothing is signalled. (With
    nothing on the port it may be a server stuck loading: acted on, tests/test_delivery_units.py.)"""
    (url,), _, stranger = standin("hang")
    sleeper = _sleeper()
    try:
        time.sleep(1.2)  # the file is written after the process started: not a stale PID
        pid_file = tmp_path / "server.pid"
        pid_file.write_text(f"{sleeper.pid}\n")
        probe = replace(FAST, startup_timeout=1.0)
        restart_cfg = RestartConfig("signal", grace=1.0, budget=1, backoff=0.1)
        cfg = Config(None, (InstanceConfig("gone", url, None, pid_file, probe, restart_cfg),), tmp_path / "state", (),
                     CaptureConfig(snapshots=1, spacing=0.1, ceiling=5.0))
        async with Running(cfg) as run:
            await run.until(lambda: "restart" in run.events() or "nothing_to_restart" in run.events())
        assert "nothing_to_restart" in run.events() and "restart" not in run.events(), run.events()
        assert sleeper.poll() is None and stranger.poll() is None  # neither was signalled
    finally:
        _end(sleeper)


def test_lookup_matches_the_exact_address_not_only_the_port(standin):
    """Measured: an instance at http://[::1]:PORT restarted a healthy server bound to 127.0.0.1."""
    (url,), _, proc = standin("ok")
    port = url.rsplit(":", 1)[1]
    here = lookup_server(url)
    assert here.identity is None and here.stranger.startswith(f"port {port} taken by PID {proc.pid}")
    other = lookup_server(f"http://[::1]:{port}")
    assert other.identity is None and other.stranger is None and other.loading is None


def test_a_pid_file_whose_process_serves_the_url_is_trusted_whatever_the_clocks_say(tmp_path, standin):
    """Measured in CI: a lab server 20 minutes old, its PID file written just after its start, was
    called "stale: PID ... is now mlx_lm.server" (its create_time, boot time + ticks, had moved
    past the file's time with a step of the system clock), and so never captured. A PID that
    serves the URL is the server; the file's time only judges a PID that does not."""
    (url,), _, proc = standin("ok")
    pid_file = tmp_path / "server.pid"
    pid_file.write_text(f"{proc.pid}\n")
    an_hour_before = time.time() - 3600  # as the file looks after the clock stepped an hour on
    os.utime(pid_file, (an_hour_before, an_hour_before))
    found = lookup_server(url, pid_file)
    assert found.identity is not None and found.identity.pid == proc.pid, found.detail
    idle = _sleeper()
    try:  # a PID that does not serve the URL and started after the file: reused, as before
        pid_file.write_text(f"{idle.pid}\n")
        os.utime(pid_file, (an_hour_before, an_hour_before))
        stale = lookup_server(url, pid_file)
        assert stale.identity is None and stale.loading is None and "is stale" in stale.detail
    finally:
        _end(idle)


# --- state that is tracked, not re-guessed


def test_unreadable_state_is_rebuilt_from_the_journal_not_reset(tmp_path, caplog):
    """Measured: an invalid state.json silently reset the restart budget."""
    journal = Journal(tmp_path)
    now = time.time()
    journal.note("daemon_start", pid=1)
    journal_module.append_record(journal.path, {"ts": now - 50, "event": "restart", "instance": "a", "id": "i1",
                                                "restarts": [{"at": now - 60, "result": "ok"}]})
    journal_module.append_record(journal.path, {"ts": now - 10, "event": "gave_up", "instance": "a", "id": "i1",
                                                "restarts": [{"at": now - 60, "result": "ok"},
                                                             {"at": now - 20, "result": "failed"}]})
    (tmp_path / "state.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, "mlxwatch"):
        state = StateFile(tmp_path, journal.path)
    assert state.instance("a")["restarts"] == [now - 60, now - 20]
    assert state.instance("a")["gave_up_at"] == now - 10
    assert "rebuilt from the journal" in caplog.text


def test_state_json_that_is_a_directory_is_one_line_exit_2(tmp_path):
    """Measured: a directory at state.json gave a traceback."""
    (tmp_path / "state.json").mkdir()
    with pytest.raises(StateError, match="is a directory"):
        StateFile(tmp_path)
    path = tmp_path / "c.yaml"
    path.write_text(f"state_dir: {tmp_path}\ninstances: [{{name: x, url: 'http://127.0.0.1:1'}}]\n")
    for command in (["run"], ["status"]):
        proc = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(path), *command],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "state.json is a directory" in proc.stderr


def test_a_lock_that_is_a_directory_is_named(tmp_path):
    """Found by a new user: with daemon.lock a directory, `run` said `cannot use the state dir
    DIR: Is a directory`, where the directory is fine and the lock is not."""
    state = tmp_path / "state"
    (state / "daemon.lock").mkdir(parents=True)
    state.chmod(0o700)
    path = tmp_path / "c.yaml"
    path.write_text(f"state_dir: {state}\ninstances: [{{name: x, url: 'http://127.0.0.1:1'}}]\n")
    proc = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(path), "run"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"{state / 'daemon.lock'}: Is a directory" in proc.stderr, proc.stderr


async def test_healthy_probes_do_no_lookup_and_no_state_write(tmp_path, standin):
    """Measured: a system-wide socket scan and a whole-file fsynced state write on every
    probe. Now the server is looked up and the state written on state changes only."""
    (url,), _, _ = standin("ok")
    lookups = []

    def counting_lookup(u, pid_file):
        lookups.append(u)
        return lookup_server(u, pid_file)

    cfg = config(tmp_path / "state", url, probe=replace(FAST, interval=0.05))
    async with Running(cfg, lookup_fn=counting_lookup) as run:
        await run.until(lambda: (run.daemon.state.instance("gone").get("last_probe") or {}).get("ok"))
        deadline = time.monotonic() + 30
        while True:  # the first state change written: no write and nothing left to write for a writer's gap
            writes = run.daemon.state.writes
            await asyncio.sleep(0.7)
            if run.daemon.state.writes == writes and not run.daemon.state.dirty.is_set():
                break
            assert time.monotonic() < deadline, f"the state is written on and on: {run.daemon.state.writes} writes"
        writes, probes_at = run.daemon.state.writes, run.daemon.state.instance("gone")["last_probe"]["at"]
        await run.until(lambda: run.daemon.state.instance("gone")["last_probe"]["at"] > probes_at + 1.5, what="probes")
        assert run.daemon.state.writes == writes
        assert lookups == [url]


async def test_one_wedged_instance_does_not_hold_back_another(tmp_path, standin):
    """Each instance has its own connections and task: a hung one cannot delay another."""
    (hung,), _, _ = standin("hang")
    (ok,), _, _ = standin("ok")
    probe = replace(FAST, interval=0.1, first_token_timeout=5.0, timeout=10.0, endpoint_timeout=5.0)
    cfg = Config(None, (InstanceConfig("hung", hung, probe=probe), InstanceConfig("ok", ok, probe=probe)),
                 tmp_path / "state", (), CaptureConfig())
    async with Running(cfg) as run:
        seen = []

        def count():
            p = run.daemon.state.instance("ok").get("last_probe")
            if p and (not seen or seen[-1] != p["at"]):
                seen.append(p["at"])
            return len(seen) >= 10
        await run.until(count, timeout=20, what="ten probes of the healthy instance")
        assert run.daemon.state.instance("hung").get("last_probe") is None  # still waiting on its first


async def test_a_fifo_as_log_is_refused_and_stop_still_works(tmp_path, caplog):
    """Measured: a FIFO as `log:` hung the daemon (SIGTERM ignored)."""
    fifo = tmp_path / "server.log"
    os.mkfifo(fifo)
    cfg = config(tmp_path / "state", f"http://127.0.0.1:{free_port()}", log=fifo)
    with caplog.at_level(logging.WARNING, "mlxwatch"):
        async with Running(cfg) as run:
            await run.until(lambda: "verdict" in run.events())
    assert "not a regular file" in caplog.text


# --- restart: signal


async def test_signal_restart_continues_a_stopped_server_and_says_when_nothing_was_there(tmp_path):
    """Measured: SIGTERM stayed pending on a SIGSTOPped server, and a restart that found
    nothing to restart was recorded as ok."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        ident = ProcessIdentity.of(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        inst = InstanceConfig("x", "http://127.0.0.1:1", restart=RestartConfig("signal", grace=20.0))
        outcome = await restart(RestartContext(inst, ident, None))
        assert outcome.result == "ok" and "exited" in outcome.detail and "SIGKILL" not in outcome.detail
        child.wait(10)
        again = await restart(RestartContext(inst, ident, None))
        assert again.result == "nothing_to_restart"
        assert (await restart(RestartContext(inst, None, None))).result == "nothing_to_restart"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_restart_failure_is_raised_not_recorded_as_ok():
    """A hook that fails raises RestartError (journaled as restart_failed)."""
    inst = InstanceConfig("x", "http://127.0.0.1:1", restart=RestartConfig("command", argv=("false",)))
    with pytest.raises(RestartError):
        asyncio.run(restart(RestartContext(inst, None, None)))


async def test_a_restart_left_running_by_a_killed_daemon_gets_its_startup_time(tmp_path, monkeypatch):
    """A daemon killed while its restart hook ran: the next start closes the incident and gives
    the hook's server `startup_timeout` to appear, instead of a `crashed` verdict (and a second
    restart racing the first) while nothing listens yet."""
    monkeypatch.setattr(supervisor_module, "STOP_RESTART_WAIT", 0.3)  # the stop's wait for a restart that never ends
    url = f"http://127.0.0.1:{free_port()}"
    cfg = config(tmp_path / "state", url, RestartConfig("command", argv=("true",)))
    async with Running(cfg, restart_fn=never) as run:
        await run.until(lambda: "restarting" in run.events())
    async with Running(cfg) as again:
        await again.until(lambda: "closed" in again.events())
        await asyncio.sleep(1.5)  # several refused probes: nothing listens yet
        assert again.daemon.watchers["gone"].detect.state == "starting"
        assert "verdict" not in again.events()[again.events().index("closed"):]
    async with Running(cfg) as later:  # no restart left running this time: an ordinary crashed verdict
        await later.until(lambda: later.events().count("verdict") >= 2)


async def test_renaming_an_instance_mid_incident_does_not_open_a_second_incident(tmp_path, standin):
    """Measured: renaming `b` to `b2` (same URL) during a restart started `b2` at once, which
    opened a second incident and ran a second restart for the same outage."""
    (url,), mode, _ = standin("hang")
    cfg = config(tmp_path / "state", url, name="b")
    async with Running(cfg) as run:
        await run.until(lambda: "awaiting_recovery" in run.events())
        run.cfg = replace(cfg, instances=(replace(cfg.instances[0], name="b2"),))
        run.reload.set()
        await run.until(lambda: "b2" in run.daemon.pending)
        await asyncio.sleep(1.0)
        assert set(run.daemon.watchers) == {"b"}  # b2 waits for b's incident on the same address
        mode.write_text("ok")
        await run.until(lambda: set(run.daemon.watchers) == {"b2"}, what="the rename applied")
    assert run.events().count("verdict") == 1


def test_a_deleted_or_misshapen_state_file_is_rebuilt_from_the_journal(tmp_path, caplog):
    """Measured: a deleted state.json silently reset the restart budget, and one whose `daemon`
    was a list stopped the daemon with an internal error."""
    journal = Journal(tmp_path)
    now = time.time()
    journal_module.append_record(journal.path, {"ts": now, "event": "restart", "instance": "a", "id": "i",
                                                "restarts": [{"at": now - 5, "result": "ok"}]})
    with caplog.at_level(logging.WARNING, "mlxwatch"):
        assert StateFile(tmp_path, journal.path).instance("a")["restarts"] == [now - 5]  # no state.json at all
        (tmp_path / "state.json").write_text('{"instances": {}, "daemon": []}')
        assert StateFile(tmp_path, journal.path).instance("a")["restarts"] == [now - 5]
    assert caplog.text.count("rebuilt from the journal") == 2


def test_restart_times_from_the_future_do_not_hold_the_budget(tmp_path):
    """A clock stepped back (or a bad state file) must not keep an instance given up for a day:
    read back without this boot's monotonic readings, a time from the future counts as now."""
    from mlxwatch.clock import Clock
    from mlxwatch.restart.flapguard import FlapGuard

    now = 1_000_000.0
    clock = Clock(monotonic=lambda: 50.0, wall=lambda: now, boot="this-boot")
    guard = FlapGuard(budget=2, window=1800, backoff=1, max_backoff=10, cooldown=3600)
    assert guard.restore({"restarts": [now - 10, now + 86400], "gave_up_at": now + 86400}, clock)
    assert [t.mono for t in guard.restarts] == [40.0, 50.0] and guard.gave_up_at.mono == 50.0
    assert not guard.cooled_down(50.0 + 3599) and guard.cooled_down(50.0 + 3600)
