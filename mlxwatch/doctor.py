"""``mlxwatch doctor``: can mlxwatch do its job on this machine, for these servers?

One finding per check, each with what was found and, when something is wrong, what to do::

    findings = await diagnose(config, config_path, config_error, state_dir)
    code = exit_code(findings)   # 1 if any finding is FAIL; mlxwatch.output.doctor renders them

Checks, in order: the config is valid; the state dir (and the bundles dir) can be written; a
daemon runs; py-spy is present; ``sample`` and ``spindump`` (macOS); the notify hook can run.
Then per instance: which process serves the URL (proven as the daemon proves it); one
generation probe; py-spy can read that process (a real ``py-spy dump``, so ptrace rights, root
on macOS and the sudoers rule are tested, not guessed); the log exists, is readable and is the
file that very process writes; the restart target exists (launchd label loaded, systemd unit
known, hook executable). A warning is worth knowing but does not stop the watchdog; a failure
does (or costs the bundle evidence), and makes ``doctor`` exit 1.

Every side effect comes through ``Env`` so tests can give the answers a Mac, a locked-down
Linux or a missing tool would give.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import psutil

from mlxwatch.capture import macos, pyspy
from mlxwatch.config import Config, InstanceConfig, default_bundles_dir
from mlxwatch.durations import format_duration, human_duration
from mlxwatch.errors import StateError
from mlxwatch.evidence.cadence import Speed
from mlxwatch.host import kernlog, launchctl
from mlxwatch.host.commands import CommandResult, Runner, run_command
from mlxwatch.host.group import RUNNING, Group, find_group
from mlxwatch.host.memuse import MemoryReading, read_memory
from mlxwatch.host.process import ProcessIdentity, ServerLookup, lookup_instance
from mlxwatch.host.sockets import KernelCounters, Reading
from mlxwatch.serverlog.markers import open_log
from mlxwatch.shim import heartbeat
from mlxwatch.storage import private_dir_problem

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"
DUMP_TIMEOUT = 10.0


@dataclass
class Finding:
    check: str
    status: str  # ok | warn | FAIL | skip
    message: str
    fix: str = ""
    instance: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _check_url(inst: InstanceConfig) -> Any:
    from mlxwatch.probes import make_client, run_check

    p = inst.probe
    async with make_client() as client:
        return await run_check(client, inst.url, first_token_timeout=p.first_token_timeout, timeout=p.timeout,
                               max_tokens=p.max_tokens, endpoint_timeout=p.endpoint_timeout)


@dataclass
class Env:
    """What the checks ask the machine (replaced in tests)."""

    platform: str = sys.platform
    euid: int = field(default_factory=os.geteuid)
    runner: Runner = run_command
    which: Callable[[str], str | None] = shutil.which
    find_py_spy: Callable[[], str | None] = pyspy.find_py_spy
    lookup: Callable[[InstanceConfig], ServerLookup] = lookup_instance  # blocking
    check: Callable[[InstanceConfig], Awaitable[Any]] = _check_url
    job_status: Callable[..., launchctl.JobStatus] = launchctl.job_status  # blocking
    launchctl_available: Callable[[], bool] = launchctl.available
    # Defined further down: looked up when an Env is made.
    open_files: Callable[[int], dict[tuple[int, int], str] | None] = field(default_factory=lambda: files_written_by)
    ptrace_scope: Callable[[], int | None] = field(default_factory=lambda: read_ptrace_scope)
    alive: Callable[[ProcessIdentity], bool] = ProcessIdentity.alive  # blocking
    kernel: Callable[[int], Reading] = field(default_factory=lambda: KernelCounters(max_age=0.0).read)  # blocking
    find_group: Callable[[int], Group | None] = find_group  # blocking (psutil, ssh)
    kernel_log: Callable[[], str | None] = kernlog.readable  # None: readable, else why not
    memory: Callable[[int], MemoryReading | None] = read_memory  # blocking
    heartbeat: Callable[[int, float | None], tuple[heartbeat.Heartbeat | None, str | None]] = heartbeat.find  # blocking

    @property
    def macos(self) -> bool:
        return self.platform.startswith("darwin")


async def diagnose(config: Config | None, config_path: Path, config_error: str | None, state_dir: Path,
                   bundles_dir: Path | None = None, only: str | None = None, env: Env | None = None) -> list[Finding]:
    """Run every check; never raises for what it finds."""
    env = env or Env()
    found: list[Finding] = []
    if config_error:
        found.append(Finding("config", FAIL, config_error, "fix that line (`mlxwatch config validate` checks it)"))
    elif config is None:
        found.append(Finding("config", FAIL, f"no config at {config_path}",
                             "write one: `mlxwatch config init` finds the mlx-lm servers running now"))
    elif not config.instances:
        found.append(Finding("config", FAIL, f"{config_path}: valid, but it watches no instances",
                             "add one (`mlxwatch config example` shows how) or run `mlxwatch config init`"))
    else:
        found.append(Finding("config", OK, f"{config_path}: valid, {len(config.instances)} instance(s)"))
    found.append(writable("state dir", state_dir))
    saved: dict[str, Any] = {}
    if found[-1].status == OK:
        try:
            from mlxwatch.journal.state import load_state

            state, problem = load_state(state_dir)
            instances = state.get("instances")
            saved = instances if isinstance(instances, dict) else {}
            if problem:
                found.append(Finding("state file", WARN, f"{state_dir / 'state.json'} {problem}",
                                     "the daemon rebuilds it from the journal at its next start"))
        except StateError as exc:
            found.append(Finding("state file", FAIL, str(exc)))
    if bundles_dir is not None and bundles_dir != default_bundles_dir(state_dir):
        found.append(writable("bundles dir", bundles_dir))
    found.append(daemon_finding(state_dir))
    exe = await asyncio.to_thread(env.find_py_spy)
    found.append(await py_spy_present(exe, env))
    found += macos_tools(config, env)
    found.append(death_finding(env))
    if config is not None and config.notify:
        found.append(executable("notify hook", config.notify[0], env, "fix notify: in the config"))
    if config is None:
        return found
    instances = [i for i in config.instances if only is None or i.name == only]
    per_instance = await asyncio.gather(*(check_instance(i, config, exe, env) for i in instances))
    for inst, findings in zip(instances, per_instance, strict=True):
        found += [*findings, pace_finding(inst, saved.get(inst.name))]
    return found


def exit_code(findings: list[Finding]) -> int:
    return 1 if any(f.status == FAIL for f in findings) else 0


# --- machine-wide checks


def writable(check: str, path: Path) -> Finding:
    """Can this user create files in ``path`` (or create ``path`` itself)? Nothing is created."""
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        return Finding(check, FAIL, f"{path}: {probe} is not a directory",
                       f"move {probe} away, or set another {check.replace(' ', '_')}")
    if not os.access(probe, os.W_OK | os.X_OK):
        return Finding(check, FAIL, f"{path}: {probe} is not writable by this user",
                       f"fix its permissions, or set another {check.replace(' ', '_')} (--state-dir)")
    if probe != path:
        return Finding(check, OK, f"{path} does not exist yet; it will be created")
    problem = private_dir_problem(path, path.stat())  # the daemon's own rule: it would refuse it
    if problem is not None:
        return Finding(check, FAIL, problem)
    return Finding(check, OK, f"{path} is writable")


def daemon_finding(state_dir: Path) -> Finding:
    from mlxwatch.journal.lock import lock_holder

    holder = lock_holder(state_dir)
    if holder is None:
        return Finding("daemon", WARN, f"no daemon runs on {state_dir}",
                       "start it: `mlxwatch run` (on macOS `mlxwatch launchd install` keeps it running)")
    return Finding("daemon", OK, f"running (PID {holder})" if holder > 0 else "running")


async def py_spy_present(exe: str | None, env: Env) -> Finding:
    if exe is None:
        return Finding("py-spy", FAIL, "not found on PATH or beside mlxwatch's Python: bundles will have no stacks",
                       f"install it into mlxwatch's venv: {sys.executable} -m pip install py-spy")
    result = await env.runner([exe, "--version"], DUMP_TIMEOUT)
    version = result.stdout.decode("utf-8", "replace").strip() if result.ok else ""
    if not result.ok:
        return Finding("py-spy", FAIL, f"{exe} does not run: {result.error}",
                       f"reinstall it: {sys.executable} -m pip install --force-reinstall py-spy")
    return Finding("py-spy", OK, f"{exe} ({version or 'version unknown'})")


def macos_tools(config: Config | None, env: Env) -> list[Finding]:
    if not env.macos:
        return [Finding("sample", SKIP, "macOS only (native stacks on a Mac)"),
                Finding("spindump", SKIP, "macOS only")]
    out = []
    sample = env.which(macos.SAMPLE)
    out.append(Finding("sample", OK, sample) if sample else
               Finding("sample", WARN, "not found: bundles will have no native stacks",
                       "it ships with macOS in /usr/bin; check PATH (launchd agents get a short PATH)"))
    sudo = bool(config and config.capture.sudo)
    if not Path(macos.SPINDUMP).exists():
        out.append(Finding("spindump", WARN, f"{macos.SPINDUMP} not found"))
    elif env.euid != 0 and not sudo:
        out.append(Finding("spindump", WARN, "needs root: bundles will have no spindump",
                           "run mlxwatch as root, or add the sudoers rule from the README and set capture.sudo: true"))
    else:
        out.append(Finding("spindump", OK, f"{macos.SPINDUMP}" + (" through sudo -n" if sudo and env.euid != 0 else "")))
    return out


def executable(check: str, program: str, env: Env, fix: str) -> Finding:
    """A hook's program: an absolute path that is an executable file, or a name on PATH."""
    if "/" in program:
        path = Path(program).expanduser()
        if not path.exists():
            return Finding(check, FAIL, f"{program} does not exist", fix)
        if not path.is_file() or not os.access(path, os.X_OK):
            return Finding(check, FAIL, f"{program} is not an executable file", f"chmod +x {program}, or {fix}")
        return Finding(check, OK, f"{program} is executable")
    found = env.which(program)
    if found is None:
        return Finding(check, FAIL, f"{program} is not on PATH", f"give its absolute path, or {fix}")
    return Finding(check, OK, f"{program} ({found})")


# --- per-instance checks


async def check_instance(inst: InstanceConfig, config: Config, exe: str | None, env: Env) -> list[Finding]:
    def f(check: str, status: str, message: str, fix: str = "") -> Finding:
        return Finding(check, status, message, fix, inst.name)

    out: list[Finding] = []
    try:
        found = await asyncio.to_thread(env.lookup, inst)
    except Exception as exc:  # a lookup must not cost the other checks
        found = ServerLookup(detail=f"lookup failed: {type(exc).__name__}: {exc}")
    server = found.identity
    if server is not None:
        where = f" on {server.address[0]}:{server.address[1]}" if server.address else ""
        out.append(f("server", OK, f"{server.describe()} listens{where}"))
    elif found.loading is not None:
        out.append(f("server", WARN, f"{found.loading.describe()} is starting: it does not listen on {inst.url} yet",
                     "let it load, then run `mlxwatch doctor` again"))
    elif found.stranger:
        out.append(f("server", FAIL, f"{found.stranger}: not an mlx-lm server, so mlxwatch will never touch it",
                     "fix the instance's url, or set pid_file if your server runs under a wrapper"))
    else:
        out.append(f("server", FAIL, found.detail or f"nothing listens on {inst.url}",
                     f"start the server, or fix the instance's url ({inst.url})"))
    if server is not None:
        out += await group_findings(inst, server, env)
    if server is None and found.stranger is None:
        out.append(f("probe", SKIP, "nothing to probe"))
    else:
        out.append(await probe_finding(inst, env))
    out.append(await py_spy_reads(inst, config, exe, server, env))
    out.append(await kernel_finding(inst, env))
    out.append(await memory_finding(inst, server, env))
    out.append(recorder_finding(inst, await shim_record(server, env), server.pid if server is not None else None))
    out.append(log_finding(inst, server, found.log, env))
    out.append(await restart_finding(inst, server, env))
    return out


def pace_finding(inst: InstanceConfig, saved: Any) -> Finding:
    """The pace the daemon learned for this server (docs/deciding.md#patience), from the state
    file: what a silence is held against."""
    cadence = saved.get("cadence") if isinstance(saved, dict) and saved.get("url") == inst.url else None
    speed = Speed.from_dict(cadence)
    chunk, basis = speed.chunk_time()
    step = f", a decode step ~{speed.step.mean:.2f} s" if speed.step is not None else ""
    message = (f"~{speed.chunk_typical():.0f} s a {speed.chunk_tokens:,}-token prompt chunk ({basis}){step}; "
               f"a silence may last up to {chunk:.0f} s while a prompt is read, "
               f"probe.quiet_window ({inst.probe.quiet_window:g} s) otherwise")
    return Finding("pace", OK if speed.chunk is not None or speed.probe_read is not None else SKIP, message,
                   instance=inst.name)


def death_finding(env: Env) -> Finding:
    """Can the daemon say why a server died (docs/bundles.md, "Why it died")?"""
    if env.macos:
        return Finding("why it died", OK, "macOS: JetsamEvent, panic and crash reports, one `log show` query and the "
                       "server's log name a dead server's cause (not yet run on a Mac: docs/verified.md)")
    problem = env.kernel_log()
    if problem is None:
        return Finding("why it died", OK, f"reads the kernel's log ({kernlog.KMSG}): the OOM killer's and crashes' "
                       "lines name a dead server's cause")
    return Finding("why it died", WARN, f"cannot read the kernel's log ({problem}): a server the OOM killer ends is "
                   "named from its own log only",
                   "run the daemon as root or with CAP_SYSLOG, or allow it: sudo sysctl kernel.dmesg_restrict=0")


async def memory_finding(inst: InstanceConfig, server: ProcessIdentity | None, env: Env) -> Finding:
    """Can the daemon read the server's memory and the bound it runs under (docs/deciding.md, "Memory")?"""
    if inst.memory.watch == "off":
        return Finding("memory", SKIP, "off (memory.watch): no warning before it runs out", instance=inst.name)
    if server is None:
        return Finding("memory", SKIP, "no server process to read", instance=inst.name)
    reading = await asyncio.to_thread(env.memory, server.pid)
    if reading is None:
        return Finding("memory", WARN, f"cannot read the memory of PID {server.pid}: no warning before it runs out",
                       "run mlxwatch as the user that runs the server", inst.name)
    mib = 1024 * 1024
    limit = f" of {reading.limit / mib:.0f} MiB ({reading.bound})" if reading.limit else f" ({reading.bound})"
    measure = "physical footprint" if reading.measure == "phys_footprint" else "resident"
    return Finding("memory", OK, f"{reading.used / mib:.0f} MiB {measure}{limit}", instance=inst.name)


async def shim_record(server: ProcessIdentity | None, env: Env) -> dict[str, Any] | None:
    """The server's launch shim's recorder (its heartbeat's ``record``), if it has one that records."""
    if server is None:
        return None
    try:
        hb, _ = await asyncio.to_thread(env.heartbeat, server.pid, server.create_time)
    except Exception:  # a heartbeat that cannot be read is the shim's findings' business, not this one's
        return None
    return hb.record if hb is not None else None


def _size_words(n: int) -> str:
    """A size as people write it: ``256 MiB``, ``1.5 KiB``, ``1 B`` (not ``9.53674e-07 MiB``)."""
    for unit, name in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if n >= unit:
            return f"{n // unit} {name}" if n % unit == 0 else f"{n / unit:.1f} {name}"
    return f"{n} B"


def recorder_finding(inst: InstanceConfig, shim: dict[str, Any] | None = None, pid: int | None = None) -> Finding:
    """Does anything keep the requests this server receives: the front door (``front.record``)
    or the launch shim in the server (``mlxwatch launch --record``)? Users' words, on disk in
    bundles: said either way, it is a privacy decision. When both record, bundles take the door's."""
    front = inst.front
    door = front is not None and front.record
    said = []
    if door:
        assert front is not None
        said.append(f"the door keeps the last {human_duration(front.record_max_age)} of requests, at most "
                    f"{_size_words(front.record_max_bytes)}")
    if shim is not None:
        try:
            age, size = human_duration(float(shim["max_age"])), _size_words(int(shim["max_bytes"]))
        except (KeyError, TypeError, ValueError, OverflowError):
            age, size = "?", "?"
        if shim.get("state") == "failed":
            return Finding("recorder", WARN, f"the launch shim in PID {pid} stopped recording requests: "
                           f"{shim.get('detail')}" + (f" ({said[0]})" if said else ""),
                           "see the server's log; a restart of the server records again", inst.name)
        state = "" if shim.get("state") == "on" else f", {shim.get('state')}: {shim.get('detail')}"
        said.append(f"the launch shim in PID {pid} keeps the last {age} of requests, at most {size}, "
                    f"on disk in the runtime dir{state}")
    if door and shim is not None:
        return Finding("recorder", OK, f"on twice (front.record and launch --record): {said[0]}; {said[1]}; "
                                       "bundles take the door's. Exact bodies (users' words) go into each bundle's "
                                       "private requests/", instance=inst.name)
    if door:
        return Finding("recorder", OK, f"on (front.record): {said[0]}, exact bodies (users' words) into each "
                                       "bundle's private requests/", instance=inst.name)
    if shim is not None:
        return Finding("recorder", OK, f"on (launch --record): {said[0]}, exact bodies (users' words) into each "
                                       "bundle's private requests/", instance=inst.name)
    if front is None:
        return Finding("recorder", SKIP, "no front door (instances[].front) and no `mlxwatch launch --record`: "
                                         "no requests recorded", instance=inst.name)
    return Finding("recorder", OK, "off (front.record, launch --record): a bundle holds no request bodies; "
                                   "`mlxwatch replay` has nothing to send", instance=inst.name)


async def kernel_finding(inst: InstanceConfig, env: Env) -> Finding:
    """Can the daemon read what the server sends each client (docs/deciding.md, kernel sight)?"""
    if inst.kernel == "off":
        return Finding("kernel", SKIP, "off (instances[].kernel): judged by the probe alone", instance=inst.name)
    reading = await asyncio.to_thread(env.kernel, inst.port)
    if reading.error:
        return Finding("kernel", WARN, f"unavailable: {reading.error}",
                       "without it a hang is called by the probe's deadlines alone (minutes at the defaults); "
                       "see docs/deciding.md#kernel-sight", inst.name)
    return Finding("kernel", OK, f"reads the bytes sent on port {inst.port}'s "
                   f"{sum(not c.closed for c in reading.connections)} client connection(s) now", instance=inst.name)


async def group_findings(inst: InstanceConfig, server: ProcessIdentity, env: Env) -> list[Finding]:
    """A server that is rank 0 of an ``mlx.launch`` group: the group, one finding per rank (its
    host, PID, state) and one per remote host (reached over ssh as mlx.launch reaches it, or
    why not). Nothing for a single server."""
    def f(check: str, status: str, message: str, fix: str = "") -> Finding:
        return Finding(check, status, message, fix, inst.name)

    try:
        group = await asyncio.to_thread(env.find_group, server.pid)
    except Exception as exc:  # the group's discovery must not cost the other checks
        return [f("group", WARN, f"could not look for an mlx.launch group: {type(exc).__name__}: {exc}")]
    if group is None:
        return []
    launcher = f"launcher PID {group.launcher_pid}" if not group.launcher_gone else group.orphan_note() or "launcher gone"
    out = [f("group", OK, f"rank 0 of an mlx.launch group of {group.size} ranks ({group.backend}), {launcher}")]
    for r in group.ranks:
        where = f"on {r.host}" + (f", PID {r.pid}" if r.pid else "")
        if r.state == RUNNING:
            out.append(f(f"rank {r.rank}", OK, f"{where}: running"))
        elif r.state == "unknown":
            out.append(f(f"rank {r.rank}", WARN, f"{where}: unknown (its host could not be asked)",
                         "see the ssh finding of that host"))
        else:
            out.append(f(f"rank {r.rank}", FAIL, f"{where}: {r.state}: the group serves nothing",
                         "mlxwatch restarts the group whole when it judges it hung (docs/distributed.md)"))
    failed = {e.split(": ", 1)[0]: e.split(": ", 1)[-1] for e in group.errors}
    for host in group.remote_hosts:
        if host in failed:
            out.append(f("ssh", FAIL, f"{host}: {failed[host]}",
                         f"key-based ssh without a prompt, as mlx.launch needs: `ssh -o BatchMode=yes {host} true`"))
        else:
            out.append(f("ssh", OK, f"{host}: reached (its ranks listed over ssh)"))
    return out


async def probe_finding(inst: InstanceConfig, env: Env) -> Finding:
    report = await env.check(inst)
    gen = report.generation
    if report.healthy:
        first = format_duration(gen.ttft) if gen.ttft is not None else "?"
        return Finding("probe", OK, f"{gen.tokens} tokens, first after {first}", instance=inst.name)
    return Finding("probe", FAIL, report.reason,
                   f"`mlxwatch check --instance {inst.name}` shows the details; a server still loading needs time",
                   inst.name)


async def py_spy_reads(inst: InstanceConfig, config: Config, exe: str | None, server: ProcessIdentity | None,
                       env: Env) -> Finding:
    def f(status: str, message: str, fix: str = "") -> Finding:
        return Finding("stacks", status, message, fix, inst.name)

    if exe is None:
        return f(SKIP, "py-spy not found (see above)")
    if server is None:
        return f(SKIP, "no proven server process to read")
    sudo = config.capture.sudo and env.euid != 0
    if env.macos and env.euid != 0 and not sudo:
        return f(FAIL, "py-spy needs root on macOS: bundles will have no Python stacks",
                 "run mlxwatch as root, or add the sudoers rule from the README and set capture.sudo: true")
    argv = pyspy.dump_command(exe, server.pid, as_json=False, native=False, sudo=sudo)
    result: CommandResult = await env.runner(argv, DUMP_TIMEOUT)
    if result.ok:
        return f(OK, f"py-spy read PID {server.pid}" + (" through sudo -n" if sudo else ""))
    if not await asyncio.to_thread(env.alive, server):  # py-spy's "check that the process is running" is no refusal
        return f(WARN, f"PID {server.pid} exited while py-spy read it (the server restarted?): not checked",
                 "run `mlxwatch doctor` again")
    output = (result.stderr + b"\n" + result.stdout).decode("utf-8", "replace")
    hint = pyspy_hint(f"{result.error}\n{output}", env.platform, env.euid, sudo, env.ptrace_scope(), exe)
    known = pyspy.explain(output)
    return f(FAIL, f"py-spy could not read PID {server.pid}: {result.error}" + (f" ({known})" if known else ""),
             hint or "see `py-spy dump --pid PID` run by hand")


DENIED_MARKS = ("permission denied", "operation not permitted", "os error 1)", "os error 13)",
                "elevated permissions", "failed to get process executable name", "a password is required",
                "no tty present")


def pyspy_hint(error: str, platform: str = sys.platform, euid: int | None = None, sudo: bool = False,
               ptrace_scope: int | None = None, exe: str = "py-spy") -> str | None:
    """What to do when py-spy was refused access to the server, or None if that is not the error."""
    text = error.lower()
    if not any(mark in text for mark in DENIED_MARKS):
        return None
    euid = os.geteuid() if euid is None else euid
    if platform.startswith("darwin"):
        if sudo:
            return ("`sudo -n` was refused: add the sudoers rule from the README "
                    "(sudo visudo -f /etc/sudoers.d/mlxwatch), naming this py-spy's path exactly")
        return "py-spy needs root on macOS: run mlxwatch as root, or add the README's sudoers rule and set capture.sudo: true"
    if euid == 0:
        return ("py-spy runs as root and was still refused: in a container, start it with --cap-add SYS_PTRACE "
                "(and a seccomp profile that allows ptrace)")
    if ptrace_scope is not None and ptrace_scope >= 1:
        return (f"kernel.yama.ptrace_scope is {ptrace_scope}, so only root or a program with CAP_SYS_PTRACE may read "
                f"another process: run mlxwatch as root, or `sudo setcap cap_sys_ptrace+ep {exe}`, or "
                "`sudo sysctl kernel.yama.ptrace_scope=0`")
    return "py-spy may read only processes of its own user: run mlxwatch as the server's user, or as root"


def read_ptrace_scope() -> int | None:
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return None


def stacks_hint(manifest: dict[str, Any], sudo: bool) -> str | None:
    """What to do when a capture's py-spy was refused the server (ptrace rights, root on macOS),
    read from the bundle's manifest; None when its stacks step did not fail so."""
    step = next((s for s in manifest.get("steps") or [] if s.get("name") == "stacks"), None)
    if not step or not step.get("error"):
        return None
    return pyspy_hint(step["error"], sys.platform, os.geteuid(), sudo, read_ptrace_scope())


def files_written_by(pid: int) -> dict[tuple[int, int], str] | None:
    """(device, inode) -> path of every regular file ``pid`` has open (its stdout and stderr
    included), or None when this user may not look."""
    try:
        files = psutil.Process(pid).open_files()
    except psutil.AccessDenied:
        return None
    except psutil.Error:
        return {}
    out = {}
    for f in files:
        try:
            st = os.stat(f.path)
        except OSError:
            continue
        out[(st.st_dev, st.st_ino)] = f.path
    return out


def log_finding(inst: InstanceConfig, server: ProcessIdentity | None, launchd_log: Path | None, env: Env) -> Finding:
    def f(status: str, message: str, fix: str = "") -> Finding:
        return Finding("log", status, message, fix, inst.name)

    path = inst.log or launchd_log
    if path is None:
        return f(WARN, "no log configured: bundles lack the log tail and markers, and a busy server's prompt "
                       "progress cannot hold back a verdict",
                 "set the instance's log: to the file the server's stdout and stderr go to")
    source = "" if inst.log else " (the launchd job's StandardErrorPath)"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f(FAIL, f"{path}{source} does not exist",
                 "point log: at the server's stdout/stderr file (launchd: its StandardErrorPath)")
    except OSError as exc:
        return f(FAIL, f"{path}: cannot look at it: {exc.strerror or exc}", "fix the folder's permissions")
    if not stat.S_ISREG(st.st_mode):
        return f(FAIL, f"{path} is not a regular file", "point log: at the file the server writes")
    try:
        with open_log(path) as fh:
            fh.read(1)
    except OSError as exc:
        return f(FAIL, f"{path}: cannot read: {exc.strerror or exc}", f"make it readable by this user (uid {os.getuid()})")
    age = format_duration(max(0.0, time.time() - st.st_mtime))
    if server is None:
        return f(OK, f"{path}{source} is readable (last written {age} ago); no server process to check that it writes it")
    writes = env.open_files(server.pid)
    if writes is None:
        return f(OK, f"{path}{source} is readable (last written {age} ago); not allowed to see which files "
                     f"PID {server.pid} writes")
    if (st.st_dev, st.st_ino) in writes:
        return f(OK, f"{path}{source}: written by PID {server.pid} (last written {age} ago)")
    others = ", ".join(sorted(writes.values())[:3]) or "no file (a terminal or a pipe)"
    return f(WARN, f"PID {server.pid} does not write {path}{source}; its open files: {others}",
             "set log: to the file the server's stdout and stderr go to")


async def restart_finding(inst: InstanceConfig, server: ProcessIdentity | None, env: Env) -> Finding:
    r = inst.restart

    def f(status: str, message: str, fix: str = "") -> Finding:
        return Finding("restart", status, message, fix, inst.name)

    if r.method == "none":
        return f(OK, "none: capture and notify only, never restarted")
    if r.method == "launchd":
        if not env.launchctl_available():
            return f(FAIL, f"launchd {r.target}: launchctl not found (launchd exists only on macOS)",
                     "use restart: systemd, command or signal on this system")
        try:
            uid = launchctl.launchd_uid(r.domain, r.uid, server.pid if server else None)
        except launchctl.UidUnknown as exc:
            return f(FAIL, f"launchd {r.target}: {exc}")
        job = await asyncio.to_thread(env.job_status, r.target, r.domain, uid)
        if job.loaded:
            return f(OK, f"launchd {job.detail}")
        domain = launchctl.domain_target(r.domain, uid)
        return f(FAIL, f"launchd {r.target}: {job.detail}",
                 f"load it: launchctl bootstrap {domain} ~/Library/LaunchAgents/{r.target}.plist "
                 "(or fix restart.launchd)")
    if r.method == "systemd":
        argv = ["systemctl", *(["--user"] if r.user else []), "show", "--property=LoadState", "--value", r.target]
        result = await env.runner(argv, 15.0)
        state = result.stdout.decode("utf-8", "replace").strip()
        if result.returncode is None:
            return f(FAIL, f"systemd {r.target}: {result.error}", "systemctl is needed for restart: systemd")
        if result.ok and state == "loaded":
            return f(OK, f"systemd {r.target}{' (--user)' if r.user else ''} is loaded")
        return f(FAIL, f"systemd {r.target}: {state or result.error or 'unknown'}",
                 f"check the unit name: systemctl{' --user' if r.user else ''} list-unit-files")
    if r.method == "command":
        finding = executable("restart", r.argv[0], env, "fix restart.command")
        finding.instance = inst.name
        return finding
    if server is None:
        return f(WARN, f"signal {r.signal_name}: no proven server process now, so a restart would find nothing "
                       "to signal", "start the server; its supervisor must start it again after the signal")
    return f(OK, f"signal {r.signal_name} to {server.describe()}; its supervisor must start it again")

