"""Which process is the server? Found once, recorded, and proven again before every action.

A PID alone is not an identity: after a crash the number, or the port, can belong to anything.
mlxwatch acts on (captures, signals, hands to a hook as ``{pid}``) only

- the process it recorded when the instance was first seen healthy (same PID and create time),
  or
- a process whose command line is an mlx-lm server (or the one named by ``pid_file``) and
  which listens on the instance's exact address: the URL's IP and port, not the port alone.

Anything else on the port is a stranger: reported, never touched::

    found = lookup_server("http://127.0.0.1:8080")
    if found.identity: ...            # proven: safe to capture and signal
    elif found.stranger: print(found.stranger)

An instance restarted by launchd (``restart: {launchd: LABEL}``) may be found by its label:
launchd's PID for the job (``launchctl print``, see ``mlxwatch.host.launchctl``) is proven the same
way as a ``pid_file``'s, by it (or a process it started, such as the Python that ``uv run``
spawns) listening on the exact address; a label whose process does not listen there is reported
and counted as loading, never acted on. Without a PID from launchd the port lookup is used.

Every function here blocks (psutil, /proc): the daemon calls them through ``asyncio.to_thread``
and only when an instance's state changes, never on a healthy probe.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

import psutil

from mlxwatch.clock import boot_id
from mlxwatch.config import InstanceConfig, url_port
from mlxwatch.errors import ProcessGoneError

MLX_SERVER_DEFAULT_PORT = 8080  # mlx_lm.server's --port default
SAME_START = 0.01  # seconds: the precision of a process's start on Linux (one clock tick)


@lru_cache(maxsize=1)
def this_boot() -> str:
    """This boot of the machine (``clock.boot_id``), read once: it does not change under a process."""
    return boot_id()


def start_stamp(proc: psutil.Process) -> float:
    """When ``proc`` started, on a clock that no change of the system time moves: psutil's own
    identity key (``Process._get_ident``: seconds since boot on Linux, the kernel's start stamp
    on macOS). ``create_time()`` is that plus today's boot time, which a clock step or an NTP
    correction moves (psutil#2526, #2541): compared to a recorded value, a live server would
    look gone. ``create_time()`` itself where psutil keeps no such key."""
    try:
        return float(proc._proc.create_time(monotonic=True))  # psutil has no public spelling of it
    except (AttributeError, TypeError):
        return proc.create_time()


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as recorded: PID + start (PID reuse), its command line, and the
    ``(ip, port)`` it was seen listening on when it was proven to be the server.

    ``create_time`` is the wall time psutil gave when it was recorded (shown, and compared with
    files' times); ``started`` (``start_stamp``) in ``boot`` (``clock.boot_id``: on Linux the start
    counts from boot, so another boot's process may have the same) is what proves it is the same
    process later. Identities recorded without ``started`` (state from before it) compare by
    create time."""

    pid: int
    create_time: float
    cmdline: tuple[str, ...]
    address: tuple[str, int] | None = None
    started: float | None = None
    boot: str | None = None

    @classmethod
    def of(cls, pid: int, address: tuple[str, int] | None = None) -> "ProcessIdentity":
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                if proc.status() == psutil.STATUS_ZOMBIE:
                    raise ProcessGoneError(f"process {pid} has exited (zombie)")
                return cls(pid, proc.create_time(), tuple(_cmdline(proc)), address, start_stamp(proc), this_boot())
        except psutil.NoSuchProcess:
            raise ProcessGoneError(f"no process with PID {pid}") from None

    def alive(self) -> bool:
        """Still the very process recorded (same PID and start, not a zombie)."""
        try:
            proc = psutil.Process(self.pid)
            with proc.oneshot():
                if self.started is None:
                    same = abs(proc.create_time() - self.create_time) < SAME_START
                else:
                    same = self._same_start(start_stamp(proc), this_boot())
                return same and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def same_process(self, other: "ProcessIdentity | None") -> bool:
        """The same process as ``other`` (by start where both were recorded with one)."""
        if other is None or other.pid != self.pid:
            return False
        if self.started is not None and other.started is not None:
            return self._same_start(other.started, other.boot)
        return abs(self.create_time - other.create_time) < SAME_START

    def _same_start(self, started: float, boot: str | None) -> bool:
        """The recorded start again, in the same boot (a side that recorded no boot is not asked)."""
        assert self.started is not None
        return (None in (self.boot, boot) or self.boot == boot) and abs(started - self.started) < SAME_START

    def still_ours(self, url: str) -> bool:
        """The recorded process, and still listening on ``url``'s exact address."""
        return self.alive() and serves(own_listeners(self.pid, url_port(url)), url)

    def describe(self) -> str:
        return f"PID {self.pid}: {short_cmdline(self.cmdline)}"

    def to_dict(self) -> dict:
        return {"pid": self.pid, "create_time": self.create_time, "started": self.started, "boot": self.boot,
                "cmdline": list(self.cmdline), "address": list(self.address) if self.address else None}

    @classmethod
    def from_dict(cls, data: dict) -> "ProcessIdentity":
        address, started, boot = data.get("address"), data.get("started"), data.get("boot")
        return cls(int(data["pid"]), float(data["create_time"]), tuple(str(a) for a in data.get("cmdline") or ()),
                   (str(address[0]), int(address[1])) if address else None,
                   float(started) if isinstance(started, (int, float)) else None,
                   boot if isinstance(boot, str) else None)


@dataclass(frozen=True)
class ServerLookup:
    """What a search for an instance's server found; at most one of the first two is set."""

    identity: ProcessIdentity | None = None  # proven: an mlx-lm server listening on the exact address
    loading: ProcessIdentity | None = None  # an mlx-lm server for this port, not listening yet
    stranger: str | None = None  # "port 8082 taken by PID N: python3 -m http.server"
    detail: str = ""  # why nothing was proven, for logs
    log: Path | None = None  # the launchd job's StandardErrorPath, when found by label


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def short_cmdline(cmdline: tuple[str, ...] | list[str], limit: int = 80) -> str:
    text = " ".join([os.path.basename(cmdline[0]), *cmdline[1:]]) if cmdline else "(command line unreadable)"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def is_mlx_server(cmdline: tuple[str, ...] | list[str]) -> bool:
    """An mlx-lm server, however it was started: ``mlx_lm.server`` (console script or
    ``python -m``), ``mlx_lm server`` (the newer subcommand), or ``python .../mlx_lm/server.py``."""
    args = list(cmdline[:6])
    for i, arg in enumerate(args):
        base = os.path.basename(arg)
        following = args[i + 1] if i + 1 < len(args) else ""
        if base == "mlx_lm.server" or arg.replace("\\", "/").endswith("mlx_lm/server.py"):
            return True
        if arg == "-m" and following == "mlx_lm.server":
            return True
        if (base == "mlx_lm" or (arg == "-m" and following == "mlx_lm")) and "server" in args[i + 1: i + 3]:
            return True
    return False


def server_port(cmdline: tuple[str, ...] | list[str]) -> int:
    """The port an mlx-lm server command line asks for (``--port N``), else the default."""
    for i, arg in enumerate(cmdline):
        value = None
        if arg == "--port" and i + 1 < len(cmdline):
            value = cmdline[i + 1]
        elif arg.startswith("--port="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return -1
    return MLX_SERVER_DEFAULT_PORT


@lru_cache(maxsize=256)
def url_ips(url: str) -> frozenset[str]:
    """The IPs a client of ``url`` may connect to (``localhost`` is both loopbacks)."""
    host = urlsplit(url).hostname or ""
    try:
        return frozenset({str(ipaddress.ip_address(host))})
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return frozenset()
    return frozenset(str(ipaddress.ip_address(str(info[4][0]).split("%")[0])) for info in infos)


def serves(listeners: list[tuple[str, int]], url: str) -> bool:
    """Does one of the listening ``(ip, port)`` sockets accept connections made to ``url``?"""
    port = url_port(url)
    targets = [ipaddress.ip_address(ip) for ip in url_ips(url)]
    for ip_text, lport in listeners:
        if lport != port:
            continue
        ip = ipaddress.ip_address(ip_text.split("%")[0])
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        for target in targets:
            if ip == target or mapped == target:
                return True
            if ip.is_unspecified and (ip.version == target.version or ip.version == 6):
                return True  # 0.0.0.0 serves IPv4; :: serves IPv6 (and IPv4 where dual-stack)
    return False


def _listening(conns) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN and c.laddr]


def own_listeners(pid: int, port: int | None = None) -> list[tuple[str, int]]:
    """The TCP sockets one process listens on (asks that process only: cheap)."""
    try:
        found = _listening(psutil.Process(pid).net_connections("tcp"))
    except psutil.Error:
        return []
    return [a for a in found if port is None or a[1] == port]


SCAN_TTL = 2.0  # seconds a system-wide socket scan is reused: 300 instances starting at once scan once
_scan_lock = threading.Lock()
_scan: tuple[float, dict[int, dict[int, list[tuple[str, int]]]]] | None = None


def listeners_on(port: int) -> dict[int, list[tuple[str, int]]]:
    """Every process listening on ``port``: PID -> its listening addresses on that port.

    A system-wide socket scan is costly on a busy machine (16-400 ms), so it runs only on state
    changes, and a scan that found a listener on ``port`` serves lookups for ``SCAN_TTL``
    seconds. "Nothing there" is never taken from an older scan: a server may just have bound.
    """
    global _scan
    with _scan_lock:
        if _scan is None or time.monotonic() - _scan[0] > SCAN_TTL or port not in _scan[1]:
            _scan = (time.monotonic(), _scan_all())
        return {pid: list(addrs) for pid, addrs in _scan[1].get(port, {}).items()}


def _scan_all() -> dict[int, dict[int, list[tuple[str, int]]]]:
    """port -> PID -> listening addresses. ``net_connections`` needs root on macOS; then each
    process we may inspect is asked."""
    out: dict[int, dict[int, list[tuple[str, int]]]] = {}
    try:
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.pid:
                out.setdefault(c.laddr.port, {}).setdefault(c.pid, []).append((c.laddr.ip, c.laddr.port))
        return out
    except (psutil.AccessDenied, PermissionError):
        pass
    for proc in psutil.process_iter():
        for ip, lport in own_listeners(proc.pid):
            out.setdefault(lport, {}).setdefault(proc.pid, []).append((ip, lport))
    return out


def listening_pids(port: int) -> set[int]:
    """PIDs with a TCP socket listening on ``port`` (any address)."""
    return set(listeners_on(port))


def _read_pid_file(pid_file: Path) -> int:
    """The PID in ``pid_file``: a line, read without blocking (a FIFO there would hang every
    lookup, and the daemon's stop with it) and never more than 64 bytes of it."""
    try:
        fd = os.open(pid_file, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ProcessGoneError(f"cannot read a PID from {pid_file}: it is not a regular file")
            head = os.read(fd, 64)
        finally:
            os.close(fd)
    except OSError as exc:  # strerror: the path is named once, not again in "[Errno 2] ...: 'path'"
        raise ProcessGoneError(f"cannot read a PID from {pid_file}: {(exc.strerror or str(exc)).lower()}") from None
    try:
        pid = int(head.split()[0])
    except (ValueError, IndexError):
        raise ProcessGoneError(f"cannot read a PID from {pid_file}: it holds no PID") from None
    if pid <= 0:
        raise ProcessGoneError(f"cannot read a PID from {pid_file}: {pid} is no PID")
    return pid


def lookup_server(url: str, pid_file: Path | None = None, launchd_label: str | None = None,
                  launchd_domain: str = "gui", launchd_uid: int | None = None) -> ServerLookup:
    """Find this instance's server process, proven by command line (or ``pid_file``, or a
    launchd label's PID) and address. ``pid_file`` wins over a label."""
    port = url_port(url)
    if pid_file is None and launchd_label is not None:
        found, why, log = _lookup_by_label(url, launchd_label, launchd_domain, launchd_uid)
        if found is not None:
            return found
        by_port = lookup_server(url)
        return ServerLookup(by_port.identity, by_port.loading, by_port.stranger,
                            f"{why}; by port: {by_port.detail}" if by_port.detail else why, log)
    if pid_file is not None:
        try:
            ident = ProcessIdentity.of(_read_pid_file(pid_file))
            written = os.stat(pid_file).st_mtime
        except (ProcessGoneError, OSError) as exc:
            return ServerLookup(detail=str(exc))
        mine = own_listeners(ident.pid, port)
        if serves(mine, url):  # the address proves it, whatever the clocks say
            return ServerLookup(identity=_with_address(ident, mine, url))
        # Started after the file was written: a reused PID. Asked only of a PID that does not serve
        # the URL: create_time is boot time + ticks, and a step of the system clock since the start
        # moves it past the file's time (measured in CI: a server of 20 minutes called stale).
        if ident.create_time > written + 1.0:
            return ServerLookup(stranger=_stranger(url, exclude=-1),
                                detail=f"{pid_file} is stale: PID {ident.pid} is now {short_cmdline(ident.cmdline)}")
        stranger = _stranger(url, exclude=ident.pid)
        return ServerLookup(loading=ident, stranger=stranger,
                            detail=f"{ident.describe()} (from {pid_file}) does not listen on {url} yet")
    strangers = []
    for pid, addrs in sorted(listeners_on(port).items()):
        if not serves(addrs, url):
            continue
        try:
            ident = ProcessIdentity.of(pid)
        except ProcessGoneError:
            continue
        if is_mlx_server(ident.cmdline):
            return ServerLookup(identity=_with_address(ident, addrs, url))
        strangers.append(ident)
    stranger = _stranger_text(port, strangers[0]) if strangers else None
    loading = None if stranger else _loading_server(port)
    detail = stranger or (f"{loading.describe()} is starting" if loading else f"nothing listens on {url}")
    return ServerLookup(loading=loading, stranger=stranger, detail=detail)


def lookup_instance(inst: InstanceConfig, lookup: Callable[..., ServerLookup] | None = None) -> ServerLookup:
    """Which process serves this configured instance: ``lookup_server`` with the instance's URL,
    ``pid_file`` and, for an instance restarted by launchd, its label, domain and uid. The one
    answer doctor, the CLI and the watcher share; ``lookup`` replaces ``lookup_server`` in tests."""
    lookup = lookup or lookup_server
    r = inst.restart
    if r.method != "launchd":
        return lookup(inst.url, inst.pid_file)
    return lookup(inst.url, inst.pid_file, launchd_label=r.target, launchd_domain=r.domain, launchd_uid=r.uid)


def _lookup_by_label(url: str, label: str, domain: str,
                     uid: int | None) -> tuple[ServerLookup | None, str, Path | None]:
    """The label's process if launchd has one: proven when it or a process it started listens on
    the exact address, else loading (and who holds the address instead). (None, why, log) when
    launchd gives no PID: the caller falls back to the port lookup."""
    from mlxwatch.host import launchctl

    try:
        status = launchctl.job_status(label, domain, launchctl.launchd_uid(domain, uid))
    except launchctl.UidUnknown as exc:
        return None, f"launchd label {label}: {exc}", None
    if status.pid is None:
        return None, f"launchd label {label}: {status.detail}", status.log
    try:
        ident = ProcessIdentity.of(status.pid)
    except ProcessGoneError as exc:
        return None, f"launchd label {label}: {exc}", status.log
    port = url_port(url)
    family = [ident.pid]
    try:
        family += [c.pid for c in psutil.Process(ident.pid).children(recursive=True)]
    except psutil.Error:
        pass
    for pid in family:
        mine = own_listeners(pid, port)
        if serves(mine, url):
            try:
                server = ident if pid == ident.pid else ProcessIdentity.of(pid)
            except ProcessGoneError:
                continue
            return ServerLookup(identity=_with_address(server, mine, url), log=status.log,
                                detail=f"{server.describe()} from launchd label {label}"), "", status.log
    stranger = None
    for pid, addrs in sorted(listeners_on(port).items()):
        if pid not in family and serves(addrs, url):
            try:
                stranger = _stranger_text(port, ProcessIdentity.of(pid))
                break
            except ProcessGoneError:
                continue
    mismatch = (f"launchd label {label} runs {ident.describe()}, which does not listen on {url}"
                + (f"; {stranger}" if stranger else " (yet)"))
    return ServerLookup(loading=ident, stranger=stranger, detail=mismatch, log=status.log), "", status.log


def _with_address(ident: ProcessIdentity, addrs: list[tuple[str, int]], url: str) -> ProcessIdentity:
    address = next(a for a in addrs if serves([a], url))
    return dataclasses.replace(ident, address=address)


def _stranger_text(port: int, ident: ProcessIdentity) -> str:
    return f"port {port} taken by {ident.describe()}"


def _stranger(url: str, exclude: int) -> str | None:
    for pid, addrs in sorted(listeners_on(url_port(url)).items()):
        if pid != exclude and serves(addrs, url):
            try:
                return _stranger_text(url_port(url), ProcessIdentity.of(pid))
            except ProcessGoneError:
                continue
    return None


def _loading_server(port: int) -> ProcessIdentity | None:
    """An mlx-lm server process started for ``port`` that does not listen yet (loading weights)."""
    for proc in psutil.process_iter(["pid", "cmdline", "create_time", "status"]):
        try:
            cmdline = proc.info["cmdline"] or []
            if proc.info["status"] == psutil.STATUS_ZOMBIE or not is_mlx_server(cmdline):
                continue
            if server_port(cmdline) == port:
                return ProcessIdentity(proc.info["pid"], proc.info["create_time"], tuple(cmdline), None,
                                       start_stamp(proc), this_boot())
        except (psutil.Error, TypeError):
            continue
    return None


def find_server_pid(port: int, pid_file: Path | None = None) -> int:
    """The one process listening on ``port`` (or named by ``pid_file``); for the CLI and tools.

    The daemon uses ``lookup_server``, which also proves the process is an mlx-lm server.
    """
    if pid_file is not None:
        return _read_pid_file(pid_file)
    pids = listening_pids(port)
    if not pids:
        raise ProcessGoneError(f"no process is listening on port {port}")
    if len(pids) > 1:
        raise ProcessGoneError(f"several processes listen on port {port}: {sorted(pids)}; set pid_file")
    return pids.pop()


def not_the_server(pid: int, cmdline: tuple[str, ...], url: str | None, inst: InstanceConfig | None,
                   lookup: Callable[[InstanceConfig], ServerLookup] = lookup_instance) -> str | None:
    """Why ``pid`` is not the mlx-lm server at ``url`` (proven as the daemon proves it), or None.
    Without a URL: why it is not an mlx-lm server at all. ``inst``: the instance at ``url``, whose
    lookup (pid_file, launchd label) is the one to trust."""
    if url is None:
        if is_mlx_server(cmdline):
            return None
        return f"PID {pid} is not an mlx-lm server ({short_cmdline(cmdline)})"
    found = lookup(inst) if inst is not None and inst.url == url else lookup_server(url)
    if found.identity is not None and found.identity.pid == pid:
        return None
    what = f"PID {pid} ({short_cmdline(cmdline)}) is not the mlx-lm server listening at {url}"
    if found.identity is not None:
        return f"{what}: that is {found.identity.describe()}"
    return f"{what}: {found.stranger or found.detail or 'nothing listens there'}"


def instance_at(instances: tuple[InstanceConfig, ...] | list[InstanceConfig], pid: int, url: str | None,
                lookup: Callable[[InstanceConfig], ServerLookup] = lookup_instance,
                ) -> tuple[InstanceConfig | None, Path | None]:
    """The configured instance whose server ``pid`` is, and the log its lookup found (a launchd
    job's): the instance at ``url`` when given, else the one at an address ``pid`` listens on,
    proven as the daemon proves its server. (None, None): no instance is this process's."""
    if url is not None:
        return next((i for i in instances if i.url == url), None), None
    ports = {port for _, port in own_listeners(pid)}
    for inst in instances:
        if url_port(inst.url) in ports:
            found = lookup(inst)
            if found.identity is not None and found.identity.pid == pid:
                return inst, found.log
    return None, None
