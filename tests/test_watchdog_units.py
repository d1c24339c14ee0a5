"""The watchdog's decisions and side effects, without a model server: policy, flap guard,
restart commands, PID-reuse safety, journal durability, notify hooks, progress evidence."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from mlxwatch.clock import Stamp
from mlxwatch.config import InstanceConfig, RestartConfig
from mlxwatch.daemon.notify import run_notify
from mlxwatch.errors import RestartError
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.journal.incidents import Incident, Journal
from mlxwatch.probes import CheckReport
from mlxwatch.probes.endpoints import EndpointResult
from mlxwatch.probes.generation import GenerationProbeResult, Keepalive
from mlxwatch.restart.flapguard import FlapGuard
from mlxwatch.restart.methods import (
    RestartContext,
    custom_command,
    launchd_command,
    restart,
    systemd_command,
)
from mlxwatch.verdict import policy
from mlxwatch.evidence.log import ProgressTracker
from lab.evidence import LogLooks


def test_verdict_after_n_consecutive_failures():
    """Two failures in a row make a verdict; a success in between resets the count."""
    d = policy.Detection(failures_needed=2, grace_ceiling=600)
    assert d.failure(0, []) is False and d.state == policy.SUSPECT
    d.success()
    assert d.failure(10, []) is False
    assert d.failure(20, []) is True and d.state == policy.HUNG


def test_progress_holds_the_verdict_until_the_ceiling():
    """Visible progress keeps a failing server suspect, but only up to grace_ceiling."""
    d = policy.Detection(failures_needed=2, grace_ceiling=100)
    for t in (0, 10, 20, 50, 90):
        assert d.failure(t, ["log: prompt processing advanced"]) is False
    assert d.graced
    assert d.failure(100, ["log: prompt processing advanced"]) is True  # ceiling reached


def test_progress_stopping_leads_to_a_verdict_on_the_next_failure():
    """Once progress stops, the next failure is enough: the count was held at failures-1."""
    d = policy.Detection(failures_needed=3, grace_ceiling=600)
    d.failure(0, ["x"]), d.failure(10, ["x"]), d.failure(20, ["x"])
    assert d.failure(30, []) is True


def test_flap_guard_backoff_and_budget():
    """Backoff doubles; the budget per window gives up; the window forgets; resume clears."""
    g = FlapGuard(budget=3, window=1000, backoff=10, max_backoff=25, cooldown=500)
    at = lambda t: Stamp(mono=t, wall=1e9 + t)  # noqa: E731 - the guard times on the monotonic reading
    assert g.wait_before_restart(0) == 0
    g.record_restart(at(0))
    assert g.wait_before_restart(4) == 6  # 10 s after the first
    g.record_restart(at(10))
    assert g.wait_before_restart(10) == 20  # doubled
    g.record_restart(at(30))
    assert g.exhausted(31)
    assert g.wait_before_restart(30) == 25  # capped at max_backoff
    g.give_up(at(31))
    assert not g.cooled_down(100) and g.cooled_down(531)
    assert not g.exhausted(1011)  # the first restart left the window
    g.resume()
    assert g.restarts == [] and g.gave_up_at is None


def inst(restart: RestartConfig, url="http://127.0.0.1:8082") -> InstanceConfig:
    return InstanceConfig("gemma", url, restart=restart)


def test_restart_command_construction():
    """launchd kickstart -k in the user's GUI domain (or system); systemctl [--user]; argv substitution."""
    assert launchd_command(RestartConfig("launchd", "com.x.mlx"), uid=501) == \
        ["launchctl", "kickstart", "-k", "gui/501/com.x.mlx"]
    assert launchd_command(RestartConfig("launchd", "com.x.mlx", domain="system"), uid=501) == \
        ["launchctl", "kickstart", "-k", "system/com.x.mlx"]
    assert launchd_command(RestartConfig("launchd", "com.x.mlx", domain="user"), uid=501) == \
        ["launchctl", "kickstart", "-k", "user/501/com.x.mlx"]
    assert systemd_command(RestartConfig("systemd", "mlx.service", user=True)) == \
        ["systemctl", "--user", "restart", "mlx.service"]
    assert systemd_command(RestartConfig("systemd", "mlx.service")) == ["systemctl", "restart", "mlx.service"]
    cfg = RestartConfig("command", argv=("/bin/restart", "--name={name}", "{pid}", "{url}", "{bundle}", "{unknown}; rm -rf /"))
    ctx = RestartContext(inst(cfg), ProcessIdentity(4242, 1.0, ()), "/b/1")
    assert custom_command(cfg, ctx) == ["/bin/restart", "--name=gemma", "4242", "http://127.0.0.1:8082", "/b/1",
                                        "{unknown}; rm -rf /"]  # one argv element, never a shell
    # braces that name no field (JSON, awk, the shell's) are passed as written
    cfg = RestartConfig("command", argv=("sh", "-c", "echo ${pid} {pid}", '{"a": {"b": "{name}"}}', "awk '{print $1}'"))
    assert custom_command(cfg, ctx) == ["sh", "-c", "echo $4242 4242", '{"a": {"b": "gemma"}}', "awk '{print $1}'"]


async def test_command_restart_failure_and_timeout_raise():
    """A hook that exits non-zero or hangs past its timeout is a RestartError naming why."""
    failing = RestartConfig("command", argv=(sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"))
    with pytest.raises(RestartError, match="exit 3: boom"):
        await restart(RestartContext(inst(failing), None, None))
    hanging = RestartConfig("command", argv=(sys.executable, "-c", "import time; time.sleep(60)"), timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(RestartError, match="timed out after 0.5s"):
        await restart(RestartContext(inst(hanging), None, None))
    assert time.monotonic() - t0 < 5


async def test_signal_restart_never_signals_a_reused_pid():
    """A recorded identity whose create time differs (the PID was reused) is never signalled:
    the restart says it found nothing to restart."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        real = ProcessIdentity.of(child.pid)
        reused = ProcessIdentity(child.pid, real.create_time - 100, real.cmdline)
        cfg = RestartConfig("signal", signal_name="SIGTERM", grace=1)
        outcome = await restart(RestartContext(inst(cfg), reused, None))
        assert outcome.result == "nothing_to_restart" and "already gone" in outcome.detail
        assert child.poll() is None  # never signalled
    finally:
        child.kill()
        child.wait()


async def test_signal_restart_terminates_our_listening_server(tmp_path):
    """The real thing: a process listening on the port gets SIGTERM and exits."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    child = subprocess.Popen([sys.executable, "-c",
                              f"import socket,time; s=socket.socket(); s.bind(('127.0.0.1',{port})); s.listen(); time.sleep(60)"])
    try:
        for _ in range(100):
            from mlxwatch.host.process import listening_pids
            if child.pid in listening_pids(port):
                break
            await asyncio.sleep(0.05)
        ident = ProcessIdentity.of(child.pid)
        cfg = RestartConfig("signal", signal_name="SIGTERM", grace=5)
        result = await restart(RestartContext(inst(cfg, f"http://127.0.0.1:{port}"), ident, None))
        child.wait(5)
        assert result.result == "ok" and "sent SIGTERM" in result.detail and child.returncode == -15
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_journal_survives_a_torn_last_line_and_finds_open_incidents(tmp_path):
    """Each record is a whole fsynced line; a torn tail is skipped; unfinished incidents are open."""
    j = Journal(tmp_path)
    a, b = Incident("gemma", detected_at=1.0), Incident("qwen", detected_at=2.0)
    j.record("verdict", a)
    j.record("verdict", b)
    j.record("recovered", b)
    with open(j.path, "a") as fh:
        fh.write('{"event": "restarting", "id": "tor')  # killed mid-write
    assert [r["id"] for r in j.open_incidents()] == [a.id]
    assert (j.path.stat().st_mode & 0o777) == 0o600


async def test_notify_hook_gets_json_and_a_hanging_hook_is_killed(tmp_path):
    """The hook reads the incident as JSON on stdin; one that hangs is killed at its timeout."""
    out = tmp_path / "got.json"
    ok = await run_notify([sys.executable, "-c", f"import sys; open({str(out)!r}, 'w').write(sys.stdin.read())"],
                          "verdict", {"instance": "gemma", "kind": "livelock"})
    assert ok and json.loads(out.read_text()) == {"event": "verdict", "instance": "gemma", "kind": "livelock"}
    t0 = time.monotonic()
    assert await run_notify([sys.executable, "-c", "import time; time.sleep(60)"], "verdict", {}, timeout=0.5) is False
    assert time.monotonic() - t0 < 5
    assert await run_notify(["/nonexistent/hook"], "verdict", {}) is False


def report(status=200, keepalives=()):
    gen = GenerationProbeResult(url="u", started_at=0, status=status, keepalives=[Keepalive(0, a, b) for a, b in keepalives])
    return CheckReport("u", gen, EndpointResult("/health"), EndpointResult("/v1/models"))


def test_progress_tracker_counts_only_work_that_advanced(tmp_path):
    """Another prompt's prompt processing advancing counts; our probe's own lines, admission
    (POST ... 200) lines and lines written before the tracker was primed do not."""
    log = tmp_path / "server.log"
    log.write_text("Starting httpd at 127.0.0.1 on port 1...\n" + "Prompt processing progress: 512/9000\n" * 3)
    t = LogLooks(ProgressTracker(log))
    t.prime()
    with open(log, "a") as fh:  # our probe: admitted (POST 200), prefilled 25/25, then nothing
        fh.write('127.0.0.1 - - [x] "POST /v1/chat/completions HTTP/1.1" 200 -\n'
                 "Prompt processing progress: 24/25\nPrompt processing progress: 25/25\n")
    assert t.observe(report(keepalives=[(24, 25), (25, 25)])).progress == ()
    with open(log, "a") as fh:  # someone else's long prompt is advancing
        fh.write("Prompt processing progress: 1024/25660\nPrompt processing progress: 2048/25660\n")
    assert t.observe(report(status=None)).progress == ("log: prompt processing advanced (2 step(s), now 2048/25660)",)
    with open(log, "a") as fh:  # a client retrying against a livelocked server: admitted, never served
        fh.write('127.0.0.1 - - [x] "POST /v1/chat/completions HTTP/1.1" 200 -\n' * 3)
    assert t.observe(report(status=200)).progress == ()
    with open(log, "a") as fh:  # the same line again is not progress
        fh.write("Prompt processing progress: 2048/25660\n")
    assert t.observe(report(status=200)).progress == ()
    assert t.observe(report(keepalives=[(64, 900), (128, 900)])).progress == (
        "the probe's own prompt was being processed (128/900)",)


def test_progress_in_a_log_of_many_megabytes_is_never_phantom(tmp_path):
    """Measured: past 4 MB of log since the server's start, the sliding read window made every
    failed probe look like progress (58,253 "new" lines), so a livelock waited 10 minutes.
    The log is followed by offset: old lines are never new again, however large it grows."""
    log = tmp_path / "server.log"
    line = "Prompt processing progress: 4096/8192\n"
    with open(log, "w") as fh:
        fh.write("Starting httpd at 127.0.0.1 on port 1...\n")
        fh.write(line * (6 * 1024 * 1024 // len(line)))  # 6 MB of old work
    t = LogLooks(ProgressTracker(log))
    t.prime()
    for _ in range(5):
        with open(log, "a") as fh:  # only admissions: a retrying client
            fh.write('127.0.0.1 - - [x] "POST /v1/chat/completions HTTP/1.1" 200 -\n')
        assert t.observe(report()).progress == ()


def test_log_follower_handles_rotation_truncation_and_bursts(tmp_path):
    """Rotation (new inode) and copy-truncate start over at the new start; a burst larger than
    one read keeps its newest part; a partial last line waits for its newline."""
    from mlxwatch.serverlog.follow import LogFollower

    log = tmp_path / "server.log"
    log.write_text("old\n")
    f = LogFollower(log, max_read=1000)
    f.prime()
    with open(log, "a") as fh:
        fh.write("one\ntw")
    assert f.read_new().lines == ["one"]
    with open(log, "a") as fh:
        fh.write("o\n")
    assert f.read_new().lines == ["two"]
    log.rename(tmp_path / "server.log.1")
    log.write_text("new1\n")
    chunk = f.read_new()
    assert chunk.event == "rotated" and chunk.lines == ["new1"]
    log.write_text("")  # copy-truncate
    assert f.read_new().event == "truncated"
    with open(log, "a") as fh:
        fh.write("x" * 5000 + "\n" + "last\n")
    chunk = f.read_new()
    assert chunk.skipped_bytes > 0 and chunk.lines == ["last"]



def test_suspect_server_is_probed_again_sooner(tmp_path):
    """After one failed probe the next comes after suspect_interval, not the full interval."""
    from mlxwatch.config import CaptureConfig, ProbeConfig
    from mlxwatch.daemon.notify import Notifier
    from mlxwatch.daemon.watcher import InstanceWatcher, Shared
    from mlxwatch.journal.state import StateFile

    shared = Shared(journal=Journal(tmp_path), state=StateFile(tmp_path), state_dir=tmp_path,
                    notifier=Notifier(()), capture=CaptureConfig(), bundles_dir=tmp_path / "b")
    probe = ProbeConfig(interval=30.0, suspect_interval=10.0)
    watcher = InstanceWatcher(InstanceConfig("gemma", "http://127.0.0.1:1", probe=probe), shared, asyncio.Event())
    assert watcher.next_delay() == 30.0
    watcher.detect.failure(0.0, [])
    assert watcher.detect.state == policy.SUSPECT and watcher.next_delay() == 10.0
    watcher.detect.success()
    assert watcher.next_delay() == 30.0
