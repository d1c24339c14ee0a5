"""Memory deaths against the real mlx_lm.server, in a real memory cgroup (v1) as root: the
kernel's OOM killer ends the server, mlxwatch names the cause from the kernel's own lines and
the cgroup's counters, restarts it into the cgroup, and the new server answers.

Newest mlx-lm only: what is tested is the kernel and mlxwatch, not a version's behaviour.
The cgroup is removed at the end; where cgroups cannot be written the test skips, saying why."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from mlxwatch.config import CaptureConfig, Config, InstanceConfig, ProbeConfig, RestartConfig
from lab.cgroup import LabCgroup
from lab.daemon import run_daemon_until
from lab.server import LabServer, relaunch_argv

pytestmark = pytest.mark.newest_server_only

# Measured (0.31.3 and 0.32.2, tiny model): the server idles at ~85 MiB resident; a prompt of
# 250 x 9 words peaks at ~316 MiB (150: ~210; 50: ~124), a probe's at under 100. 180 MiB fits
# the server and its probes, never that prompt.
LIMIT_MIB = 180
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 250)


def in_cgroup(server_python: str, root: Path, cg: LabCgroup) -> LabServer:
    """A lab server whose process runs in ``cg``: started once (the model made, the spec saved),
    then relaunched through the cgroup's door, as the restart command will."""
    server = LabServer.start(server_python, root)
    subprocess.run(cg.inside(relaunch_argv(root)), check=True, capture_output=True, timeout=180)
    server.refresh()
    assert server.pid in cg.pids()
    return server


def send_long_prompt(url: str) -> None:
    def send() -> None:
        try:
            httpx.post(f"{url}/v1/chat/completions", trust_env=False, timeout=120,
                       json={"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 2})
        except httpx.HTTPError:
            pass  # the server died under it: that is the point
    threading.Thread(target=send, daemon=True).start()


async def test_oom_killed_server_is_named_by_the_kernels_lines_and_restarted_in_its_cgroup(server_python, lab_root,
                                                                                             tmp_path):
    with LabCgroup.make(LIMIT_MIB) as cg:
        server = in_cgroup(server_python, lab_root / "oom", cg)
        try:
            old_pid = server.pid
            restart = RestartConfig("command", argv=cg.inside(relaunch_argv(server.workdir)), timeout=120.0, backoff=1.0)
            probe = ProbeConfig(interval=1.0, first_token_timeout=2.0, timeout=4.0, failures=2, grace_ceiling=60.0,
                                endpoint_timeout=2.0, startup_timeout=90.0)
            config = Config(None, (InstanceConfig("lab", server.url, server.log_path, server.pid_file, probe, restart),),
                            tmp_path, (), CaptureConfig(snapshots=2, spacing=0.5, ceiling=25.0))
            journal = await run_daemon_until(config, lambda j: any(r["event"] == "recovered" for r in j.records()),
                                             timeout=240, after_healthy=lambda: send_long_prompt(server.url))
            records = [r for r in journal.records() if r.get("instance") == "lab" and "id" in r]
            captured = next(r for r in records if r["event"] == "captured")
            assert captured["kind"] == "crashed" and captured["cause"] == "oom_killer", captured
            assert cg.name in captured["cause_summary"] and f"limit {LIMIT_MIB} MiB" in captured["cause_summary"]
            bundle = Path(captured["bundle"])
            kernel_lines = (bundle / "death" / "kernel.log").read_text()
            assert f"Killed process {old_pid} " in kernel_lines  # the kernel's own line, copied in
            death = json.loads((bundle / "death.json").read_text())
            assert death["pid"] == old_pid and death["cgroup"]["oom_kill"] >= 1 and death["signal"] == "SIGKILL"
            assert death["cgroup"]["limit"] == LIMIT_MIB * 1024 * 1024
            manifest = json.loads((bundle / "manifest.json").read_text())
            assert manifest["classification"]["cause"] == "oom_killer"
            server.refresh()
            assert server.pid != old_pid and server.pid in cg.pids()  # restarted into its cgroup
            answer = httpx.post(f"{server.url}/v1/chat/completions", trust_env=False, timeout=30,
                                json={"messages": [{"role": "user", "content": "after"}], "max_tokens": 2})
            assert answer.status_code == 200
        finally:
            server.stop()
    assert not cg.path.exists()


LEAK_LIMIT_MIB = 200
LEAK_MIB_PER_S = 5.0  # from ~90 MiB idle: the kill comes some 20-25 s after the leak starts


async def test_a_leak_is_warned_before_the_kill_with_the_minutes_left_it_really_had(server_python, lab_root, tmp_path):
    """The lab's leak fault under a cgroup limit: the daemon's memory_low warning comes before
    the OOM killer does, and its minutes left are within 30 % of the time the server really had."""
    with LabCgroup.make(LEAK_LIMIT_MIB) as cg:
        server = in_cgroup(server_python, lab_root / "leak", cg)
        killed: dict[str, float] = {}
        stop = threading.Event()

        def watch_kill() -> None:  # the kernel's own count, read every 50 ms: when the kill happened
            while not stop.is_set() and "at" not in killed:
                if cg.counter("oom_kill") >= 1:
                    killed["at"] = time.time()
                time.sleep(0.05)

        watcher = threading.Thread(target=watch_kill, daemon=True)
        watcher.start()
        try:
            restart = RestartConfig("command", argv=cg.inside(relaunch_argv(server.workdir)), timeout=120.0, backoff=1.0)
            probe = ProbeConfig(interval=1.0, first_token_timeout=2.0, timeout=4.0, failures=2, grace_ceiling=60.0,
                                endpoint_timeout=2.0, startup_timeout=90.0)
            config = Config(None, (InstanceConfig("lab", server.url, server.log_path, server.pid_file, probe, restart),),
                            tmp_path, (), CaptureConfig(snapshots=2, spacing=0.5, ceiling=25.0))
            journal = await run_daemon_until(
                config, lambda j: "at" in killed and any(r["event"] == "memory_low" for r in j.records()),
                timeout=180, after_healthy=lambda: server.set_fault("leak", LEAK_MIB_PER_S))
        finally:
            stop.set()
            watcher.join()
            server.stop()
        warning = next(r for r in journal.records() if r["event"] == "memory_low")
        assert warning["ts"] < killed["at"], (warning, killed)
        assert warning["bound"] == f"cgroup {cg.name}" and warning["limit"] == LEAK_LIMIT_MIB * 1024 * 1024
        had = killed["at"] - warning["ts"]
        said = warning["minutes_left"] * 60
        print(f"memory_low said {said:.1f}s left; the kill came {had:.1f}s later")  # shown with -s: the measurement
        assert abs(said - had) <= 0.3 * had, f"said {said:.1f}s left, the kill came {had:.1f}s later"
    assert not cg.path.exists()
