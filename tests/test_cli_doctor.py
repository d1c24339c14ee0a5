"""`mlxwatch doctor` on machines this one is not: a Mac without root, a Linux whose ptrace scope
refuses py-spy, a launchd label that is not loaded, a systemd unit that does not exist, a hook
that is not executable, a log the server does not write. Each is one finding with a fix.
(The real server's case is in ``test_cli_real.py``.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxwatch.config import CaptureConfig, Config, InstanceConfig, MemoryConfig, RestartConfig
from mlxwatch.doctor import FAIL, OK, SKIP, WARN, Env, diagnose, exit_code, pyspy_hint
from mlxwatch.host import launchctl
from mlxwatch.host.commands import CommandResult
from mlxwatch.host.group import Group, Rank
from mlxwatch.host.memuse import MemoryReading
from mlxwatch.host.process import ProcessIdentity, ServerLookup


class Report:
    def __init__(self, healthy=True, reason="ok"):
        self.healthy, self.reason = healthy, reason
        self.generation = type("G", (), {"tokens": 4 if healthy else 0, "ttft": 0.05 if healthy else None})()


def env(**over) -> Env:
    """A machine where everything works, unless told otherwise."""
    server = ProcessIdentity(4242, 1.0, ("python", "-m", "mlx_lm.server"), ("127.0.0.1", 8080))

    async def runner(argv, timeout):
        if argv[-1] == "--version":
            return CommandResult(list(argv), 0, b"py-spy 0.4.3\n", b"", 0.1)
        return CommandResult(list(argv), 0, b"Thread 1 ...", b"", 0.1)

    async def check(inst):
        return Report()

    values = dict(platform="linux", euid=1000, runner=runner, which=lambda name: f"/usr/bin/{name}",
                  find_py_spy=lambda: "/venv/bin/py-spy", lookup=lambda inst: ServerLookup(identity=server),
                  check=check, open_files=lambda pid: {}, ptrace_scope=lambda: 0,
                  job_status=lambda label, domain, uid: launchctl.JobStatus(f"gui/501/{label}", True, 4242,
                                                                            "running", None, None, "loaded"),
                  launchctl_available=lambda: True, alive=lambda identity: True, find_group=lambda pid: None,
                  kernel_log=lambda: None,
                  memory=lambda pid: MemoryReading(150 * 2**20, "rss", 180 * 2**20, 30 * 2**20, "cgroup /lab"))
    values.update(over)
    return Env(**values)


async def test_doctor_says_what_memory_and_death_evidence_it_can_read(tmp_path):
    """The server's memory and its bound (or why not), and whether the kernel's log names a
    dead server's cause: each one line, with its fix."""
    found, _ = await run(config(tmp_path), env(), tmp_path)
    assert found[("gemma", "memory")].message == "150 MiB resident of 180 MiB (cgroup /lab)"
    assert found[(None, "why it died")].status == "ok" and "/dev/kmsg" in found[(None, "why it died")].message
    found, _ = await run(config(tmp_path), env(kernel_log=lambda: "/dev/kmsg: Operation not permitted",
                                               memory=lambda pid: None), tmp_path)
    died = found[(None, "why it died")]
    assert died.status == "warn" and "Operation not permitted" in died.message and "dmesg_restrict" in died.fix
    assert found[("gemma", "memory")].status == "warn"
    found, _ = await run(config(tmp_path, memory=MemoryConfig(watch="off")), env(), tmp_path)
    assert found[("gemma", "memory")].status == "skip"


def config(tmp_path: Path, **inst) -> Config:
    return Config(tmp_path / "c.yaml", (InstanceConfig("gemma", "http://127.0.0.1:8080", **inst),), tmp_path / "state",
                  (), CaptureConfig())


async def run(cfg, e, tmp_path) -> dict[str, object]:
    findings = await diagnose(cfg, tmp_path / "c.yaml", None, tmp_path / "state", env=e)
    return {(f.instance, f.check): f for f in findings}, exit_code(findings)


async def test_all_good_but_the_log_is_warned_about(tmp_path):
    """A proven server, a healthy probe, py-spy reads it: exit 0; no log configured is a warning."""
    found, code = await run(config(tmp_path), env(), tmp_path)
    assert code == 0
    assert found[("gemma", "server")].status == OK and "PID 4242" in found[("gemma", "server")].message
    assert found[("gemma", "stacks")].status == OK
    assert found[("gemma", "log")].status == WARN and "set the instance's log" in found[("gemma", "log")].fix
    assert found[(None, "sample")].status == SKIP


async def test_py_spy_refused_on_linux_names_ptrace_scope(tmp_path):
    """Measured: "Failed to get process executable name" passed on verbatim, no hint."""
    async def runner(argv, timeout):
        if argv[-1] == "--version":
            return CommandResult(list(argv), 0, b"py-spy 0.4.3\n", b"", 0.1)
        return CommandResult(list(argv), 1, b"", b"Error: Failed to get process executable name. Check that the "
                             b"process is running.\nReason: Permission denied (os error 13)\n", 0.1,
                             "exit 1: Error: Failed to get process executable name. Check that the process is running.")

    found, code = await run(config(tmp_path), env(runner=runner, ptrace_scope=lambda: 1), tmp_path)
    stacks = found[("gemma", "stacks")]
    assert code == 1 and stacks.status == FAIL
    assert "kernel.yama.ptrace_scope is 1" in stacks.fix and "setcap cap_sys_ptrace+ep /venv/bin/py-spy" in stacks.fix


async def test_a_server_that_restarted_while_read_is_no_access_problem(tmp_path):
    """Found in a walk through the README: doctor ran while the demo restarted its server, and
    py-spy's "Failed to get process executable name" for the vanished PID came with the fix for
    a refused ptrace (--cap-add SYS_PTRACE), which was wrong: a later capture read it fine."""
    async def runner(argv, timeout):
        if argv[-1] == "--version":
            return CommandResult(list(argv), 0, b"py-spy 0.4.3\n", b"", 0.1)
        return CommandResult(list(argv), 1, b"", b"Error: Failed to get process executable name. Check that the "
                             b"process is running.\n", 0.1, "exit 1: Error: Failed to get process executable name.")

    found, code = await run(config(tmp_path), env(runner=runner, euid=0, alive=lambda identity: False), tmp_path)
    stacks = found[("gemma", "stacks")]
    assert stacks.status == WARN and "exited while py-spy read it" in stacks.message, stacks
    assert "SYS_PTRACE" not in stacks.fix and "`mlxwatch doctor` again" in stacks.fix
    found, code = await run(config(tmp_path), env(runner=runner, euid=0), tmp_path)  # still there: refused
    assert found[("gemma", "stacks")].status == FAIL and "SYS_PTRACE" in found[("gemma", "stacks")].fix


async def test_macos_without_root_or_sudo_says_how_to_allow_py_spy(tmp_path):
    found, code = await run(config(tmp_path), env(platform="darwin", euid=501), tmp_path)
    assert code == 1
    assert found[("gemma", "stacks")].status == FAIL and "capture.sudo" in found[("gemma", "stacks")].fix
    assert found[(None, "spindump")].status in (WARN, OK) or "not found" in found[(None, "spindump")].message


async def test_launchd_label_not_loaded(tmp_path):
    not_loaded = lambda label, domain, uid: launchctl.JobStatus(  # noqa: E731
        f"gui/{uid}/{label}", False, detail=f"launchctl print gui/{uid}/{label}: Could not find service")
    cfg = config(tmp_path, restart=RestartConfig("launchd", target="com.example.mlx", uid=501))
    found, code = await run(cfg, env(job_status=not_loaded), tmp_path)
    restart = found[("gemma", "restart")]
    assert code == 1 and restart.status == FAIL and "Could not find service" in restart.message
    assert "launchctl bootstrap gui/501 ~/Library/LaunchAgents/com.example.mlx.plist" in restart.fix


async def test_launchd_restart_on_linux(tmp_path):
    cfg = config(tmp_path, restart=RestartConfig("launchd", target="com.example.mlx", uid=501))
    found, _ = await run(cfg, env(launchctl_available=lambda: False), tmp_path)
    assert found[("gemma", "restart")].status == FAIL and "only on macOS" in found[("gemma", "restart")].message


@pytest.mark.parametrize("stdout, returncode, error, status", [
    (b"loaded\n", 0, None, OK),
    (b"not-found\n", 0, None, FAIL),
    (b"", None, "systemctl: not found", FAIL),
])
async def test_systemd_unit(stdout, returncode, error, status, tmp_path):
    async def runner(argv, timeout):
        if argv[0] == "systemctl":
            assert argv == ["systemctl", "--user", "show", "--property=LoadState", "--value", "mlx.service"]
            return CommandResult(list(argv), returncode, stdout, b"", 0.1, error)
        return CommandResult(list(argv), 0, b"py-spy 0.4.3\n", b"", 0.1)

    cfg = config(tmp_path, restart=RestartConfig("systemd", target="mlx.service", user=True))
    found, _ = await run(cfg, env(runner=runner), tmp_path)
    assert found[("gemma", "restart")].status == status


async def test_restart_hook_must_be_an_executable_file(tmp_path):
    script = tmp_path / "restart.sh"
    script.write_text("#!/bin/sh\n")
    cfg = config(tmp_path, restart=RestartConfig("command", argv=(str(script), "{name}")))
    found, _ = await run(cfg, env(), tmp_path)
    assert found[("gemma", "restart")].status == FAIL and "chmod +x" in found[("gemma", "restart")].fix
    script.chmod(0o755)
    found, _ = await run(cfg, env(), tmp_path)
    assert found[("gemma", "restart")].status == OK
    cfg = config(tmp_path, restart=RestartConfig("command", argv=("no-such-restarter",)))
    found, _ = await run(cfg, env(which=lambda name: None), tmp_path)
    assert found[("gemma", "restart")].status == FAIL and "not on PATH" in found[("gemma", "restart")].message


async def test_log_that_the_server_does_not_write(tmp_path):
    """A log path that exists but is not the server's stdout/stderr: a warning naming what it writes."""
    log = tmp_path / "server.log"
    log.write_text("x\n")
    other = tmp_path / "other.log"
    other.write_text("")
    st = os.stat(other)
    found, code = await run(config(tmp_path, log=log), env(open_files=lambda pid: {(st.st_dev, st.st_ino): str(other)}),
                            tmp_path)
    assert code == 0 and found[("gemma", "log")].status == WARN
    assert f"does not write {log}" in found[("gemma", "log")].message and str(other) in found[("gemma", "log")].message
    st = os.stat(log)
    found, _ = await run(config(tmp_path, log=log), env(open_files=lambda pid: {(st.st_dev, st.st_ino): str(log)}),
                         tmp_path)
    assert found[("gemma", "log")].status == OK and "written by PID 4242" in found[("gemma", "log")].message


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "does not exist"),
    (lambda p: os.mkfifo(p), "is not a regular file"),
])
async def test_log_missing_or_not_a_file(make, message, tmp_path):
    log = tmp_path / "server.log"
    make(log)
    found, code = await run(config(tmp_path, log=log), env(), tmp_path)
    assert code == 1 and found[("gemma", "log")].status == FAIL and message in found[("gemma", "log")].message


async def test_a_stranger_on_the_port_and_nothing_listening(tmp_path):
    stranger = ServerLookup(stranger="port 8080 taken by PID 7: python3 -m http.server")
    found, code = await run(config(tmp_path), env(lookup=lambda inst: stranger,
                                                 check=lambda inst: _unhealthy()), tmp_path)
    assert code == 1 and found[("gemma", "server")].status == FAIL and "pid_file" in found[("gemma", "server")].fix
    assert found[("gemma", "probe")].status == FAIL
    found, code = await run(config(tmp_path), env(lookup=lambda inst: ServerLookup(detail="nothing listens")), tmp_path)
    assert found[("gemma", "probe")].status == SKIP and found[("gemma", "stacks")].status == SKIP


async def _unhealthy():
    return Report(False, "HTTP error: HTTP 404")


async def test_no_config_and_bad_config(tmp_path):
    findings = await diagnose(None, tmp_path / "c.yaml", None, tmp_path / "state", env=env())
    assert findings[0].status == FAIL and "mlxwatch config init" in findings[0].fix and exit_code(findings) == 1
    findings = await diagnose(None, tmp_path / "c.yaml", "c.yaml: probe.timeout: must be ...", tmp_path, env=env())
    assert findings[0].status == FAIL and findings[0].message == "c.yaml: probe.timeout: must be ..."


async def test_state_dir_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    findings = await diagnose(config(tmp_path), tmp_path / "c.yaml", None, blocker / "state", env=env())
    state = next(f for f in findings if f.check == "state dir")
    assert state.status == FAIL and "is not a directory" in state.message


async def test_py_spy_missing(tmp_path):
    found, code = await run(config(tmp_path), env(find_py_spy=lambda: None), tmp_path)
    assert code == 1 and found[(None, "py-spy")].status == FAIL and "pip install py-spy" in found[(None, "py-spy")].fix
    assert found[("gemma", "stacks")].status == SKIP


@pytest.mark.parametrize("error, platform, euid, sudo, scope, expected", [
    ("exit 1: Error: Failed to get process executable name", "linux", 1000, False, 1, "ptrace_scope is 1"),
    ("Permission denied (os error 13)", "linux", 1000, False, 0, "run mlxwatch as the server's user, or as root"),
    ("Operation not permitted (os error 1)", "linux", 0, False, 1, "--cap-add SYS_PTRACE"),
    ("This program requires root on OSX", "darwin", 501, False, None, None),
    ("Permission denied", "darwin", 501, False, None, "capture.sudo"),
    ("sudo: a password is required", "darwin", 501, True, None, "sudoers rule"),
    ("Failed to find python version from target process", "linux", 1000, False, 0, None),
])
def test_pyspy_hint(error, platform, euid, sudo, scope, expected):
    hint = pyspy_hint(error, platform, euid, sudo, scope, "/venv/bin/py-spy")
    assert (hint is None) if expected is None else (expected in hint)


@pytest.mark.parametrize("mode", [0o777, 0o770], ids=["world-writable", "group-writable"])
async def test_a_state_dir_the_daemon_would_refuse_fails_here_too(tmp_path, mode):
    """Found by a new user: doctor said `ok state dir ... is writable` (exit 0) for a state dir
    of mode 777, which `mlxwatch run` refuses (exit 2). One rule now (storage.private_dir_problem)."""
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, mode)
    found, code = await run(config(tmp_path), env(), tmp_path)
    finding = found[(None, "state dir")]
    assert code == 1 and finding.status == FAIL
    assert f"chmod 700 {state}" in finding.message
    os.chmod(state, 0o700)
    found, code = await run(config(tmp_path), env(), tmp_path)
    assert found[(None, "state dir")].status == OK


async def test_doctor_says_in_one_line_whether_kernel_sight_works():
    """Where the kernel's counters cannot be read (no sock_diag in a container, no nettop), the
    daemon falls back to the probe's rules: doctor says so, with what it costs; where they can,
    it says what it sees; `kernel: off` is a skip."""
    import time as _time
    from dataclasses import replace as _replace

    from mlxwatch.config import InstanceConfig
    from mlxwatch.doctor import SKIP, WARN, Env, kernel_finding
    from mlxwatch.host.sockets import Reading

    inst = InstanceConfig("lab", "http://127.0.0.1:8080")
    refused = Env(kernel=lambda port: Reading(_time.monotonic(), error="sock_diag unavailable: PermissionError"))
    f = await kernel_finding(inst, refused)
    assert (f.status, f.message) == (WARN, "unavailable: sock_diag unavailable: PermissionError")
    assert "probe's deadlines alone" in f.fix
    seen = Env(kernel=lambda port: Reading(_time.monotonic(), ()))
    assert (await kernel_finding(inst, seen)).message == "reads the bytes sent on port 8080's 0 client connection(s) now"
    assert (await kernel_finding(_replace(inst, kernel="off"), seen)).status == SKIP


def test_doctor_says_whether_the_door_records_requests():
    """The recorder keeps users' words: doctor says whether it is on, and its bounds (issue 35)."""
    from dataclasses import replace as _replace

    from mlxwatch.config import FrontConfig, InstanceConfig
    from mlxwatch.doctor import SKIP, recorder_finding

    inst = InstanceConfig("lab", "http://127.0.0.1:8080")
    assert recorder_finding(inst).status == SKIP
    off = recorder_finding(_replace(inst, front=FrontConfig()))
    assert (off.status, off.message.split(" (")[0]) == (OK, "off")
    on = recorder_finding(_replace(inst, front=FrontConfig(record=True)))
    assert on.message.startswith("on (front.record): the door keeps the last 10m of requests, at most 256 MiB")


def test_doctor_says_whether_the_launch_shim_records_requests_and_which_a_bundle_takes():
    """`mlxwatch launch --record`: read from the server's heartbeat; when the door records too,
    bundles take the door's; a recorder that stopped is a warning."""
    import asyncio
    from dataclasses import replace as _replace

    from mlxwatch.config import FrontConfig, InstanceConfig
    from mlxwatch.doctor import recorder_finding, shim_record
    from mlxwatch.shim.heartbeat import Heartbeat

    rec = {"state": "on", "detail": "", "max_age": 120.0, "max_bytes": 64 * 1024**2}
    inst = InstanceConfig("lab", "http://127.0.0.1:8080")
    on = recorder_finding(inst, rec, 4242)
    assert (on.status, on.message) == (OK, "on (launch --record): the launch shim in PID 4242 keeps the last 2m of "
                                           "requests, at most 64 MiB, on disk in the runtime dir, exact bodies "
                                           "(users' words) into each bundle's private requests/")
    both = recorder_finding(_replace(inst, front=FrontConfig(record=True)), rec, 4242)
    assert both.message.startswith("on twice (front.record and launch --record): the door keeps the last 10m")
    assert "bundles take the door's" in both.message
    stopped = recorder_finding(inst, {**rec, "state": "failed", "detail": "OSError: [Errno 28] No space left"}, 4242)
    assert stopped.status == WARN and "stopped recording requests: OSError" in stopped.message
    server = ProcessIdentity(4242, 1.0, ("mlx_lm.server",))
    hb = Heartbeat(4242, {"record": rec}, 0.0, "/run/4242.json")
    assert asyncio.run(shim_record(server, Env(heartbeat=lambda pid, start: (hb, None)))) == rec
    assert asyncio.run(shim_record(server, Env(heartbeat=lambda pid, start: (None, "no heartbeat")))) is None
    assert asyncio.run(shim_record(None, Env())) is None


# --- a distributed server (an mlx.launch group), given at the discovery seam


def _group(rank1_state: str = "running", errors: tuple[str, ...] = ()):
    launcher = ProcessIdentity(4100, 1.0, ("/v/bin/python", "/v/bin/mlx.launch", "--hosts", "127.0.0.1,mac2"))
    return Group(launcher, "ring", ("127.0.0.1", "mac2"), None, "hostfile:x",
                 (Rank(0, "127.0.0.1", 4242, "12.50", "running"),
                  Rank(1, "mac2", None if rank1_state == "unknown" else 811, "3.10", rank1_state)),
                 "/v/bin/python", errors)


async def _doctor(tmp_path, group):
    findings = await diagnose(config(tmp_path), tmp_path / "c.yaml", None, tmp_path / "state",
                              env=env(find_group=lambda pid: group))
    return [(f.check, f.status, f.message) for f in findings if f.instance == "gemma"]


async def test_doctor_reports_each_rank_and_each_remote_hosts_ssh(tmp_path):
    """Rank 0 of a group: the group, one finding per rank (host, PID, state), and ssh to each
    remote host; a stopped rank fails, an unreachable host fails with the ssh check to run."""
    found = await _doctor(tmp_path, _group())
    assert ("rank 0", "ok", "on 127.0.0.1, PID 4242: running") in found
    assert ("rank 1", "ok", "on mac2, PID 811: running") in found
    assert ("ssh", "ok", "mac2: reached (its ranks listed over ssh)") in found
    assert any(c == "group" and "group of 2 ranks (ring), launcher PID 4100" in m for c, _, m in found)
    found = await _doctor(tmp_path, _group("stopped"))
    assert ("rank 1", "FAIL", "on mac2, PID 811: stopped: the group serves nothing") in found
    found = await _doctor(tmp_path, _group("unknown", ("mac2: ssh exit 255: Permission denied (publickey).",)))
    assert ("rank 1", "warn", "on mac2: unknown (its host could not be asked)") in found
    assert ("ssh", "FAIL", "mac2: ssh exit 255: Permission denied (publickey).") in found
    assert not [c for c, _, _ in await _doctor(tmp_path, None) if c in ("group", "ssh") or c.startswith("rank")]


def test_doctor_says_a_recorders_bound_in_words_at_any_size():
    """record_max_bytes: 1 read "at most 9.53674e-07 MiB", 1024GB "1.04858e+06 MiB"."""
    from dataclasses import replace as _replace

    from mlxwatch.config import FrontConfig, InstanceConfig
    from mlxwatch.doctor import recorder_finding

    inst = InstanceConfig("lab", "http://127.0.0.1:8080")
    for size, words in ((1, "1 B"), (1536, "1.5 KiB"), (256 * 1024**2, "256 MiB"), (1024**4, "1024 GiB")):
        front = FrontConfig(record=True, record_max_bytes=size)
        assert f"at most {words}," in recorder_finding(_replace(inst, front=front)).message
    for max_bytes in (float("inf"), "lots", None):
        rec = {"state": "on", "detail": "", "max_age": 120.0, "max_bytes": max_bytes}
        assert "at most ?" in recorder_finding(inst, rec, 4242).message
