"""Groups: a distributed ``mlx_lm.server`` started by ``mlx.launch``, found from its rank 0.

``mlx.launch --backend ring --hostfile hosts.json <venv>/bin/mlx_lm.server ...`` starts one
rank per host: ``127.0.0.1`` as a child of the launcher (a ``bash -c`` that ``exec``s the
server, so the rank's PID is the child's), every other host through ``ssh -tt HOST script``.
Each rank has ``MLX_RANK`` in its environment and, for the ring backend, ``MLX_HOSTFILE``
naming a temp file that holds the ring's addresses (the same text in every rank of one group,
with its ports: the group's **key**; JACCL's coordinator, NCCL's host and port likewise).

From the PID of the server at an instance's address (rank 0, the one that answers HTTP)::

    group = find_group(pid)            # None: not a rank of an mlx.launch group
    group.launcher, group.backend, group.hosts
    for rank in group.ranks: rank.rank, rank.host, rank.pid, rank.state
    group.same_group(find_group(pid))  # False when any rank was replaced behind our back
    group.orphaned                     # its launcher is gone and ranks still run
    instance_groups(port)              # every group that holds the port or waits for it

**Orphans.** A launcher that dies (SIGKILL, an OOM kill, ``launchctl kickstart -k``) leaves its
ranks running, reparented (measured: both ranks kept the HTTP port, every request closed with
no response). Such a rank has no launcher above it: its group is found by its key among every
local process (``launcher`` is then the one seen before, marked gone, or None when never seen),
and a supervisor's relaunch meanwhile cannot bind (``Address already in use``) and never exits.
``instance_groups`` finds both, so that a restart can end every one of them first.

Local ranks come from the launcher's process tree (psutil). Remote ranks are reached the way
``mlx.launch`` reaches them: ``ssh HOST`` with the hostfile's names (the user's keys and
``~/.ssh/config``), running a stdlib-only Python script (``REMOTE_SCRIPT``) with the rank's own
interpreter (the launcher assumes the same venv path on every host): mlxwatch need not be
installed there. A rank's identity is its PID and start (as ``process.ProcessIdentity``): a rank
replaced since is not the same group, and is never signalled.

Every function here blocks (psutil, ssh): the daemon calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal as signals
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import psutil

from mlxwatch import storage
from mlxwatch.errors import ProcessGoneError
from mlxwatch.host.process import ProcessIdentity, is_mlx_server, listening_pids, server_port, short_cmdline

LOCAL_HOST = "127.0.0.1"  # the one host mlx.launch runs without ssh
RUNNING, STOPPED, ZOMBIE, GONE = "running", "stopped", "zombie", "gone"
SSH_TIMEOUT = 15.0  # seconds for one ssh round trip (connect, run the script, answer)
SSH_OPTIONS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=5", "-o", "LogLevel=ERROR")

# Run on a remote host with the rank's interpreter, stdlib only. argv: ``list KEY`` prints one
# JSON line per process whose MLX_RANK is set and whose group key is KEY; ``signal NAME PID START
# ...`` sends NAME to each PID still started at START (never to a process that replaced it) and
# prints the ones it signalled. Linux reads /proc; macOS reads ``ps -E`` (not verified here).
REMOTE_SCRIPT = r'''
import json, os, re, signal, stat, subprocess, sys
def key_of(env):
    if env.get("MLX_HOSTFILE"):
        try:
            fd = os.open(env["MLX_HOSTFILE"], os.O_RDONLY | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                with os.fdopen(os.dup(fd), "rb") as fh:
                    data = fh.read(1048576 + 1)  # MAX_HOSTFILE
            finally:
                os.close(fd)
            return "hostfile:" + data.decode("utf-8").strip() if len(data) <= 1048576 else None
        except (OSError, ValueError):
            return None
    if env.get("MLX_JACCL_COORDINATOR"):
        return "jaccl:" + env["MLX_JACCL_COORDINATOR"]
    if env.get("NCCL_HOST_IP"):
        return "nccl:%s:%s" % (env["NCCL_HOST_IP"], env.get("NCCL_PORT", ""))
    return None
def procs():
    if os.path.isdir("/proc/self"):
        tick = os.sysconf("SC_CLK_TCK")
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open("/proc/%s/environ" % name, "rb") as fh:
                    raw = fh.read()
                if b"MLX_RANK=" not in raw:
                    continue
                env = dict(x.split("=", 1) for x in raw.decode("utf-8", "replace").split("\0") if "=" in x)
                with open("/proc/%s/stat" % name) as fh:
                    stat = fh.read().rsplit(")", 1)[1].split()
                with open("/proc/%s/cmdline" % name, "rb") as fh:
                    cmd = [a.decode("utf-8", "replace") for a in fh.read().split(b"\0") if a]
            except (OSError, ValueError):
                continue
            letter = stat[0]
            state = "stopped" if letter in "Tt" else "zombie" if letter == "Z" else "running"
            yield int(name), "%.2f" % (int(stat[19]) / tick), state, env, cmd
    else:
        out = subprocess.run(["ps", "-axww", "-E", "-o", "pid=,stat=,lstart=,command="],
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            if "MLX_RANK=" not in line:
                continue
            parts = line.split(None, 7)
            env = dict(m.groups() for m in re.finditer(r"(MLX_\w+|NCCL_\w+)=(\S*)", line))
            letter = parts[1][:1]
            state = "stopped" if letter == "T" else "zombie" if letter == "Z" else "running"
            yield int(parts[0]), " ".join(parts[2:7]), state, env, parts[7].split()
if sys.argv[1] == "list":
    for pid, start, state, env, cmd in procs():
        if key_of(env) == sys.argv[2]:
            print(json.dumps({"pid": pid, "start": start, "state": state, "rank": int(env["MLX_RANK"]),
                              "cmdline": cmd}))
elif sys.argv[1] == "signal":
    wanted = dict(zip(map(int, sys.argv[3::2]), sys.argv[4::2]))
    for pid, start, state, env, cmd in procs():
        if wanted.get(pid) == start:
            os.kill(pid, getattr(signal, sys.argv[2]))
            print(pid)
'''


@dataclass(frozen=True)
class Rank:
    """One rank of a group. ``start`` proves it (the kernel's start of the process, as text: on
    a remote host only that host's clock means anything); ``pid`` None: the rank is gone."""

    rank: int
    host: str
    pid: int | None
    start: str
    state: str  # running | stopped | zombie | gone
    cmdline: tuple[str, ...] = ()
    identity: ProcessIdentity | None = None  # a local rank's, for signals

    @property
    def local(self) -> bool:
        return self.host == LOCAL_HOST

    @property
    def where(self) -> str:
        return f"rank {self.rank} on {self.host}" + (f" (PID {self.pid})" if self.pid else "")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "start": self.start, "state": self.state}


@dataclass(frozen=True)
class Group:
    """An ``mlx.launch`` group as found: its launcher, how it was launched, every rank."""

    launcher: ProcessIdentity | None  # None: gone before it was ever seen (ranks found orphaned)
    backend: str
    hosts: tuple[str, ...]  # the ssh name of each rank's host, by rank
    hostfile: str | None
    key: str  # what every rank of this group shares (the ring's addresses, the coordinator)
    ranks: tuple[Rank, ...]
    python: str | None = None  # the interpreter the remote script runs with
    errors: tuple[str, ...] = ()  # hosts that could not be asked, and why
    launcher_gone: bool = False  # the launcher exited or was killed: its ranks are orphans

    @property
    def launcher_pid(self) -> int | None:
        return self.launcher.pid if self.launcher is not None else None

    @property
    def orphaned(self) -> list[Rank]:
        """Ranks still running (or stopped) whose launcher is gone: nothing will end them."""
        if not self.launcher_gone:
            return []
        return [r for r in self.ranks if r.pid and r.state in (RUNNING, STOPPED, "unknown")]

    def orphan_note(self) -> str | None:
        """"launcher PID N is gone; 2 ranks orphaned" (None: the launcher runs, or no rank does)."""
        left = self.orphaned
        if not left:
            return None
        who = f"launcher PID {self.launcher.pid}" if self.launcher is not None else "its launcher"
        return f"{who} is gone; {len(left)} rank{'s' if len(left) != 1 else ''} orphaned"

    @property
    def size(self) -> int:
        return len(self.hosts)

    @property
    def remote_hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h for h in self.hosts if h != LOCAL_HOST))

    def rank(self, number: int) -> Rank | None:
        return next((r for r in self.ranks if r.rank == number), None)

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(r.pid for r in self.ranks if r.pid)

    def missing(self) -> list[Rank]:
        """Ranks not running: stopped, zombie or gone."""
        return [r for r in self.ranks if r.state != RUNNING]

    def same_group(self, other: "Group | None") -> bool:
        """The same launcher and the very same rank processes (PID and start each)."""
        if other is None or (self.launcher is None) != (other.launcher is None) or (
                self.launcher is not None and not self.launcher.same_process(other.launcher)):
            return False
        mine = {(r.rank, r.host, r.pid, r.start) for r in self.ranks if r.pid}
        theirs = {(r.rank, r.host, r.pid, r.start) for r in other.ranks if r.pid}
        return mine == theirs

    def describe(self) -> str:
        by = f"launched by PID {self.launcher_pid}" if self.launcher is not None else "launcher unknown"
        return (f"mlx.launch group of {self.size} ({self.backend}) {by}"
                + (" (gone)" if self.launcher_gone else "") + ": "
                + ", ".join(f"rank {r.rank} {r.host} {r.state}" for r in self.ranks))

    def to_dict(self) -> dict:
        launcher = None if self.launcher is None else {
            "pid": self.launcher.pid, "create_time": self.launcher.create_time, "cmdline": list(self.launcher.cmdline)}
        out: dict = {"launcher": launcher, "backend": self.backend, "hosts": list(self.hosts), "hostfile": self.hostfile,
               "ranks": [r.to_dict() for r in self.ranks], "errors": list(self.errors)}
        if self.launcher_gone:
            out["launcher_gone"] = True
            out["orphaned"] = self.orphan_note()
        return out


SshRunner = Callable[[str, list[str], float], "subprocess.CompletedProcess[str]"]


def run_ssh(host: str, argv: list[str], timeout: float) -> "subprocess.CompletedProcess[str]":
    """``ssh HOST argv`` as mlx.launch runs it (the user's ssh config and keys), never prompting."""
    return subprocess.run(["ssh", *SSH_OPTIONS, host, shlex.join(argv)], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def is_launcher(cmdline: tuple[str, ...] | list[str]) -> bool:
    """``mlx.launch`` (console script) or ``python -m mlx._distributed_utils.launch``."""
    args = list(cmdline[:4])
    return any(os.path.basename(a) == "mlx.launch" or a == "mlx._distributed_utils.launch" for a in args)


@dataclass
class LaunchArgs:
    hosts: list[str] = field(default_factory=list)
    backend: str = ""
    hostfile: str | None = None
    python: str | None = None
    command: list[str] = field(default_factory=list)


_VALUED = {"--hosts", "--repeat-hosts", "-n", "--hostfile", "--backend", "--env", "--mpi-arg",
           "--connections-per-ip", "--starting-port", "-p", "--cwd", "--nccl-port", "--python"}


def parse_launcher(cmdline: tuple[str, ...] | list[str], cwd: str | None = None) -> LaunchArgs:
    """What ``mlx.launch``'s command line asks for: its hosts (repeated as ``-n`` says, or from
    the hostfile, relative to the launcher's directory), backend and the command it runs."""
    args = list(cmdline)
    start = next((i + 1 for i, a in enumerate(args[:4]) if os.path.basename(a) == "mlx.launch"
                  or a == "mlx._distributed_utils.launch"), len(args))
    opts: dict[str, str] = {}
    i = start
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        name, eq, value = a.partition("=")
        if name in _VALUED:
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
                i += 1
            opts[name] = value
            i += 1
            continue
        if a.startswith("-") and a not in ("-",):
            i += 1
            continue
        break
    out = LaunchArgs(command=args[i:], python=opts.get("--python"))
    backend = opts.get("--backend", "")
    if "--hostfile" in opts:
        path = Path(opts["--hostfile"])
        if not path.is_absolute() and cwd:
            path = Path(cwd) / path
        out.hostfile = str(path)
        try:
            data = json.loads(_read_small(path))
            hosts = data["hosts"] if isinstance(data, dict) else data
            out.hosts = [str(h["ssh"]) for h in hosts]
            if isinstance(data, dict) and not backend:
                backend = str(data.get("backend") or "")
        except (OSError, ValueError, KeyError, TypeError):
            out.hosts = []
    else:
        try:
            repeat = int(opts.get("--repeat-hosts", opts.get("-n", "1")))
        except ValueError:
            repeat = 1
        out.hosts = [h for h in opts.get("--hosts", LOCAL_HOST).split(",") for _ in range(repeat)]
    out.backend = backend or "ring"
    return out


MAX_HOSTFILE = 1024 * 1024


def _read_small(path: Path) -> str:
    """A file another process names (its ``--hostfile``, its ``MLX_HOSTFILE``), as text: a
    regular file of at most ``MAX_HOSTFILE`` bytes in UTF-8 (OSError or ValueError otherwise; a
    FIFO there would block the reader for ever)."""
    with storage.open_regular(path, follow_links=True) as fh:
        data = fh.read(MAX_HOSTFILE + 1)
    if len(data) > MAX_HOSTFILE:
        raise ValueError(f"{path} is larger than {MAX_HOSTFILE} bytes")
    return data.decode("utf-8")


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except psutil.Error:
        return {}


def group_key(env: dict[str, str]) -> str | None:
    """What every rank of one group shares (``REMOTE_SCRIPT``'s ``key_of``, the same rule)."""
    if env.get("MLX_HOSTFILE"):
        try:
            return "hostfile:" + _read_small(Path(env["MLX_HOSTFILE"])).strip()
        except (OSError, ValueError):
            return None
    if env.get("MLX_JACCL_COORDINATOR"):
        return "jaccl:" + env["MLX_JACCL_COORDINATOR"]
    if env.get("NCCL_HOST_IP"):
        return f"nccl:{env['NCCL_HOST_IP']}:{env.get('NCCL_PORT', '')}"
    return None


def _state(proc: psutil.Process) -> str:
    status = proc.status()
    return STOPPED if status in (psutil.STATUS_STOPPED, getattr(psutil, "STATUS_TRACING_STOP", "")) \
        else ZOMBIE if status == psutil.STATUS_ZOMBIE else RUNNING


def _local_rank(proc: psutil.Process, rank: int) -> Rank | None:
    try:
        with proc.oneshot():
            state = _state(proc)
            ident = None if state == ZOMBIE else ProcessIdentity.of(proc.pid)
            start = f"{ident.started:.2f}" if ident is not None and ident.started is not None else ""
            return Rank(rank, LOCAL_HOST, proc.pid, start, state, tuple(proc.cmdline()) if ident else (), ident)
    except (psutil.Error, ProcessGoneError):
        return None


def _interpreter(command: list[str], python: str | None) -> str:
    """The Python the ranks run (the same path on every host, as mlx.launch assumes)."""
    if python:
        return python
    if command:
        first = command[0]
        if os.path.basename(first).startswith("python"):
            return first
        try:
            with storage.open_regular(Path(first), follow_links=True) as fh:  # a FIFO there blocked for ever
                line = fh.readline(512).decode("utf-8", "replace")
            if line.startswith("#!"):
                words = line[2:].split()
                if words and os.path.basename(words[0]) == "env" and len(words) > 1:
                    return words[1]
                if words:
                    return words[0]
        except OSError:
            pass
    return "python3"


def find_group(pid: int, ssh: SshRunner = run_ssh, known: Group | None = None) -> Group | None:
    """The ``mlx.launch`` group whose rank ``pid`` is, or None (not a rank of one). A rank with no
    launcher above it is an orphan (``orphan_group``; ``known``: the group as seen before, whose
    launcher and hosts it keeps). Remote hosts that cannot be asked are named in
    ``Group.errors``; their ranks are ``gone`` only when the host answered without them."""
    try:
        proc = psutil.Process(pid)
        env = _environ(proc)
        if "MLX_RANK" not in env:
            return None
        launcher_proc = next((p for p in proc.parents() if is_launcher(_cmdline(p))), None)
    except psutil.Error:
        return None
    if launcher_proc is None:
        return orphan_group(env, known, ssh)
    try:
        launcher = ProcessIdentity.of(launcher_proc.pid)
        cwd = launcher_proc.cwd()
    except (ProcessGoneError, psutil.Error):
        return None
    key = group_key(env) or ""
    launch = parse_launcher(launcher.cmdline, cwd)
    ranks: dict[int, Rank] = {}
    try:
        children = launcher_proc.children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:
        child_env = _environ(child)
        if "MLX_RANK" in child_env:
            if group_key(child_env) != key:
                continue
            found = _local_rank(child, int(child_env["MLX_RANK"]))
            if found is not None:
                ranks.setdefault(found.rank, found)
    hosts = list(launch.hosts) or [LOCAL_HOST]
    python = _interpreter(launch.command, launch.python)
    errors = []
    for host in dict.fromkeys(h for h in hosts if h != LOCAL_HOST):
        found_remote, error = remote_ranks(host, key, python, ssh)
        if error:
            errors.append(f"{host}: {error}")
            for number, h in enumerate(hosts):
                if h == host and number not in ranks:
                    ranks[number] = Rank(number, host, None, "", "unknown")
            continue
        for r in found_remote:
            if r.rank < len(hosts) and hosts[r.rank] == host:
                ranks.setdefault(r.rank, r)
    for number, host in enumerate(hosts):
        if number not in ranks:
            ranks[number] = Rank(number, host, None, "", GONE)
    return Group(launcher, launch.backend, tuple(hosts), launch.hostfile, key,
                 tuple(ranks[n] for n in sorted(ranks)), python, tuple(errors))


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def _orphan(proc: psutil.Process) -> bool:
    """No ``mlx.launch`` above it. (A relaunch with the same ring ports has the same key: its
    ranks, under their live launcher, are another group.)"""
    try:
        return not any(is_launcher(_cmdline(p)) for p in proc.parents())
    except psutil.Error:
        return False


def _local_ranks_of(key: str) -> dict[int, Rank]:
    """Every local orphaned process of the group ``key``, by rank."""
    ranks: dict[int, Rank] = {}
    for proc in psutil.process_iter():
        env = _environ(proc)
        if "MLX_RANK" not in env or group_key(env) != key or not _orphan(proc):
            continue
        try:
            number = int(env["MLX_RANK"])
        except ValueError:
            continue
        found = _local_rank(proc, number)
        if found is not None and found.state != ZOMBIE:
            ranks.setdefault(number, found)
    return ranks


def _ring_size(hostfile_text: str) -> int | None:
    """How many ranks a ring's ``MLX_HOSTFILE`` names (a JSON list, one entry a rank)."""
    try:
        ring = json.loads(hostfile_text)
    except ValueError:
        return None
    return len(ring) if isinstance(ring, list) else None


def orphan_group(env: dict[str, str], known: Group | None = None, ssh: SshRunner = run_ssh) -> Group | None:
    """The group of a rank with no launcher above it (``env``: that rank's environment): its
    ranks found by the group's key among every local process. ``known``: the same group as seen
    before (same key), whose launcher, hosts and remote ranks it keeps; else the hosts are
    ``127.0.0.1`` as many times as the ring's hostfile names ranks (or as local ranks were
    found). None when the rank carries no group key."""
    key = group_key(env)
    if not key:
        return None
    local = _local_ranks_of(key)
    same = known if known is not None and known.key == key else None
    if same is not None:
        hosts = list(same.hosts)
    else:
        size = _ring_size(key.removeprefix("hostfile:")) if key.startswith("hostfile:") else None
        hosts = [LOCAL_HOST] * max(size or 0, max(local, default=-1) + 1, 1)
    ranks: dict[int, Rank] = {n: r for n, r in local.items() if n < len(hosts) and hosts[n] == LOCAL_HOST}
    errors = []
    python = same.python if same is not None else None
    for host in dict.fromkeys(h for h in hosts if h != LOCAL_HOST):
        found_remote, error = remote_ranks(host, key, python or "python3", ssh)
        if error:
            errors.append(f"{host}: {error}")
            ranks.update({n: Rank(n, host, None, "", "unknown") for n, h in enumerate(hosts) if h == host})
            continue
        for r in found_remote:
            if r.rank < len(hosts) and hosts[r.rank] == host:
                ranks.setdefault(r.rank, r)
    for number, host in enumerate(hosts):
        ranks.setdefault(number, Rank(number, host, None, "", GONE))
    launcher = same.launcher if same is not None else None
    return Group(launcher, same.backend if same is not None else _backend_of(key), tuple(hosts),
                 same.hostfile if same is not None else None, key, tuple(ranks[n] for n in sorted(ranks)),
                 python, tuple(errors), launcher_gone=True)


def _backend_of(key: str) -> str:
    return {"hostfile": "ring", "jaccl": "jaccl", "nccl": "nccl"}.get(key.partition(":")[0], "ring")


def instance_groups(port: int, ssh: SshRunner = run_ssh) -> list[Group]:
    """Every group with a rank that listens on ``port`` or was started for it (an mlx-lm server
    whose command line names the port, loading or unable to bind): the orphans of a dead
    launcher and a group a supervisor started meanwhile alike. Local processes only are searched
    for them (rank 0 serves HTTP on this host); each group's remote ranks are asked as usual."""
    listening = sorted(listening_pids(port))
    started_for = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if is_mlx_server(cmdline) and server_port(cmdline) == port and proc.info["pid"] not in listening:
                started_for.append(proc.info["pid"])
        except (psutil.Error, TypeError):
            continue
    groups: list[Group] = []
    for pid in [*listening, *sorted(started_for)]:  # rank 0 first: its group names its other ranks
        if any(pid in g.pids for g in groups):
            continue
        found = find_group(pid, ssh)
        # A rank already in a group found (a "remote" rank that runs on this host, under sshd
        # rather than the launcher) is that group's, not a group of its own.
        if found is not None and not any(set(found.pids) & set(g.pids) for g in groups):
            groups.append(found)
    return groups


def remote_ranks(host: str, key: str, python: str, ssh: SshRunner = run_ssh) -> tuple[list[Rank], str | None]:
    """The ranks of the group ``key`` running on ``host``, asked over ssh; (ranks, error)."""
    try:
        done = ssh(host, [python, "-c", REMOTE_SCRIPT, "list", key], SSH_TIMEOUT)
    except subprocess.TimeoutExpired:
        return [], f"ssh timed out after {SSH_TIMEOUT:g}s"
    except OSError as exc:
        return [], f"ssh: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return [], f"ssh exit {done.returncode}: {last[:200]}"
    found = []
    for line in done.stdout.splitlines():
        try:
            d = json.loads(line)
            found.append(Rank(int(d["rank"]), host, int(d["pid"]), str(d["start"]), str(d["state"]),
                              tuple(str(a) for a in d.get("cmdline") or ())))
        except (ValueError, KeyError, TypeError):
            continue
    return found, None


def signal_ranks(group: Group, ranks: list[Rank], signame: str, ssh: SshRunner = run_ssh) -> list[Rank]:
    """Send ``signame`` to each of ``ranks`` that is still the very process found (local: its
    identity; remote: PID and start checked on the host, in the same script run). The ranks
    signalled."""
    sent = []
    for rank in ranks:
        if rank.pid is None or not rank.local or rank.identity is None:
            continue
        if rank.identity.alive():
            try:
                os.kill(rank.pid, getattr(signals, signame))
                sent.append(rank)
            except ProcessLookupError:
                pass
    by_host: dict[str, list[Rank]] = {}
    for rank in ranks:
        if rank.pid is not None and not rank.local:
            by_host.setdefault(rank.host, []).append(rank)
    for host, mine in by_host.items():
        argv = [group.python or "python3", "-c", REMOTE_SCRIPT, "signal", signame]
        for rank in mine:
            argv += [str(rank.pid), rank.start]
        try:
            done = ssh(host, argv, SSH_TIMEOUT)
        except (subprocess.TimeoutExpired, OSError):
            continue
        signalled = {int(x) for x in done.stdout.split() if x.isdigit()}
        sent += [r for r in mine if r.pid in signalled]
    return sent


def alive_ranks(group: Group, ssh: SshRunner = run_ssh) -> list[Rank]:
    """The ranks of ``group`` still running as the very processes found (a zombie is gone)."""
    left = [r for r in group.ranks if r.local and r.identity is not None and r.identity.alive()]
    for host in group.remote_hosts:
        found, error = remote_ranks(host, group.key, group.python or "python3", ssh)
        if error:  # not proven gone: counted as alive, the caller says why
            left += [replace(r, state="unknown") for r in group.ranks if r.host == host and r.pid]
            continue
        now = {(r.pid, r.start) for r in found if r.state != ZOMBIE}
        left += [r for r in group.ranks if r.host == host and (r.pid, r.start) in now]
    return left


def wait_ranks_gone(group: Group, timeout: float, ssh: SshRunner = run_ssh, poll: float = 0.2) -> list[Rank]:
    """Until no rank of ``group`` runs, for at most ``timeout``; the ranks left."""
    deadline = time.monotonic() + timeout
    while True:
        left = alive_ranks(group, ssh)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(poll)


# mlx.launch's own lines when a rank's process ends (its thread for that rank logs them):
# "Node with rank 1 exited with code 1", "Node with rank 0 was killed".
_EXIT_LINE = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
_ENDED_BY_LAUNCHER = -signals.SIGTERM  # the launcher ends the other ranks with SIGTERM


def launcher_exits(text: str) -> list[int]:
    """The ranks the launcher's log says exited, in the order it logged them, those it ended
    itself last (``was killed``, or SIGTERM's code): the first is the rank that exited on its
    own, the others went with it."""
    own: list[int] = []
    ended: list[int] = []
    for match in _EXIT_LINE.finditer(text):
        rank, code = int(match.group(1)), match.group(2)
        (ended if code is None or int(code) == _ENDED_BY_LAUNCHER else own).append(rank)
    return list(dict.fromkeys(own + ended))


def read_exits(log: Path | None, start: int, limit: int = 256 * 1024) -> list[int]:
    """``launcher_exits`` of what ``log`` gained since byte ``start`` (all of it when it was
    truncated or rotated since; at most its last ``limit`` bytes)."""
    if log is None:
        return []
    try:
        with open(log, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(start if size >= start else 0, size - limit))
            return launcher_exits(fh.read().decode("utf-8", "replace"))
    except OSError:
        return []


def describe_rank(rank: Rank) -> str:
    return f"{rank.where}: {rank.state}" + (f" ({short_cmdline(rank.cmdline, 60)})" if rank.cmdline else "")


def refresh(group: Group, ssh: SshRunner = run_ssh) -> Group:
    """``group`` with each rank's state now: a rank whose process ended, or was replaced (another
    start), is ``gone``; a host that cannot be asked leaves its ranks ``unknown``."""
    ranks = []
    answers: dict[str, tuple[dict[tuple[int, str], Rank], str | None]] = {}
    for host in group.remote_hosts:
        found, error = remote_ranks(host, group.key, group.python or "python3", ssh)
        answers[host] = ({(r.pid or 0, r.start): r for r in found}, error)
    for r in group.ranks:
        if r.pid is None:
            ranks.append(r)
        elif r.local:
            state = GONE
            try:
                proc = psutil.Process(r.pid)
                if r.identity is not None and r.identity.alive():
                    state = _state(proc)
                elif proc.status() == psutil.STATUS_ZOMBIE and proc.ppid() == group.launcher_pid:
                    state = ZOMBIE  # ended, not yet reaped by its launcher
            except psutil.Error:
                state = GONE
            ranks.append(replace(r, state=state))
        else:
            now, error = answers[r.host]
            match = now.get((r.pid, r.start))
            ranks.append(replace(r, state="unknown" if error else match.state if match else GONE))
    gone = group.launcher_gone or (group.launcher is not None and not group.launcher.alive())
    return replace(group, ranks=tuple(ranks), launcher_gone=gone)
