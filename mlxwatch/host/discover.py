"""Find the mlx-lm servers running on this machine, for ``mlxwatch config init``.

A server is a process whose command line is an mlx-lm server (``process.is_mlx_server``: the
same rule the daemon uses to prove a server). For each one: the address it listens on (or, while
it loads, the ``--host``/``--port`` its command line asks for), the file its stderr (else
stdout) goes to, and how it could be restarted: the launchd job that runs it (``launchctl
list``; then its StandardErrorPath is the log when stderr was not found) or the systemd unit
whose cgroup holds it. A wrapper (``uv run mlx_lm.server``) and the Python it starts count as
one server: the one that listens is kept::

    servers = find_servers()
    text = starter_config(servers)   # YAML that validates, with comments saying what was found

Nothing here changes anything; every function blocks (psutil, /proc, launchctl).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable

import psutil
import yaml

from mlxwatch.config import parse_config, url_port
from mlxwatch.host import launchctl
from mlxwatch.host.group import Group, find_group
from mlxwatch.host.process import is_mlx_server, own_listeners, server_port


@dataclass
class FoundServer:
    pid: int
    cmdline: tuple[str, ...]
    url: str
    listening: bool
    log: Path | None = None
    log_from: str = ""  # how the log was found: "stderr of PID N", "launchd job LABEL"
    launchd_label: str | None = None
    systemd_unit: str | None = None
    systemd_user: bool = False
    model: str | None = None
    name: str = ""
    group: Group | None = None  # rank 0 of an mlx.launch group: the group, watched as one instance

    @property
    def group_text(self) -> str:
        """``rank 0 of an mlx.launch group of 2 ranks (ring): 127.0.0.1, mac2``, or empty."""
        g = self.group
        if g is None:
            return ""
        return f"rank 0 of an mlx.launch group of {g.size} ranks ({g.backend}): " + ", ".join(dict.fromkeys(g.hosts))


def find_servers(processes: Iterable[psutil.Process] | None = None,
                 launchd_jobs: Callable[[], dict[int, str]] | None = None,
                 groups: Callable[[int], Group | None] = find_group) -> list[FoundServer]:
    """Every mlx-lm server running now, one per address, ordered by port. A distributed server
    (an ``mlx.launch`` group) is one server: its rank 0, with ``group`` set; its other ranks
    are not listed."""
    candidates: list[tuple[int, tuple[str, ...], int]] = []  # pid, cmdline, ppid
    for proc in processes if processes is not None else psutil.process_iter(["pid", "cmdline", "status", "ppid"]):
        try:
            info = proc.info  # process_iter's attrs: pid, cmdline, status, ppid
            cmdline = tuple(info.get("cmdline") or ())
            if info.get("status") == psutil.STATUS_ZOMBIE or not is_mlx_server(cmdline):
                continue
            candidates.append((info["pid"], cmdline, info.get("ppid") or 0))
        except (psutil.Error, TypeError, KeyError, AttributeError):
            continue
    by_address: dict[str, FoundServer] = {}
    for pid, cmdline, _ in candidates:
        server = _describe(pid, cmdline)
        kept = by_address.get(server.url)
        if kept is None or (server.listening and not kept.listening):
            by_address[server.url] = server  # the listening one of a wrapper and its child
    servers = []
    for server in sorted(by_address.values(), key=lambda s: (url_port(s.url), s.url)):
        try:
            server.group = groups(server.pid)
        except Exception:  # discovery of one group must not cost the other servers
            server.group = None
        mine = next((r for r in server.group.ranks if r.pid == server.pid and r.local), None) if server.group else None
        if mine is not None and mine.rank != 0:
            continue  # another rank of a group: rank 0 stands for it
        servers.append(server)
    labels = (launchd_jobs or launchd_pids)()
    for server in servers:
        _restart_hints(server, labels)
    _name_all(servers)
    return servers


def _describe(pid: int, cmdline: tuple[str, ...]) -> FoundServer:
    listeners = own_listeners(pid)
    wanted = server_port(cmdline)
    if listeners:
        on_port = [a for a in listeners if a[1] == wanted] or listeners
        url, listening = _url(on_port), True
    else:
        host = _arg(cmdline, "--host") or "127.0.0.1"
        url, listening = _url([(host, wanted)]), False
    server = FoundServer(pid, cmdline, url, listening, model=_arg(cmdline, "--model"))
    log = stdio_file(pid)
    if log is not None:
        server.log, server.log_from = log, f"PID {pid}'s stderr or stdout"
    return server


def _url(addresses: list[tuple[str, int]]) -> str:
    """The URL a local client would use: a loopback for a wildcard or loopback listener (IPv4 first)."""
    def rank(addr: tuple[str, int]) -> int:
        ip = addr[0]
        return 0 if ip in ("127.0.0.1", "0.0.0.0", "localhost") else 1 if ip in ("::1", "::") else 2
    ip, port = sorted(addresses, key=rank)[0]
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "localhost": "127.0.0.1"}.get(ip)
    if host is None:
        host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}"


def listening_url(pid: int, cmdline: tuple[str, ...]) -> str | None:
    """Where a server process listens, as a URL a local client would use (None: nowhere yet)."""
    listeners = own_listeners(pid)
    if not listeners:
        return None
    wanted = server_port(cmdline)
    return _url([a for a in listeners if a[1] == wanted] or listeners)


def _arg(cmdline: tuple[str, ...], option: str) -> str | None:
    for i, arg in enumerate(cmdline):
        if arg == option and i + 1 < len(cmdline):
            return cmdline[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


def stdio_file(pid: int) -> Path | None:
    """The regular file the process's stderr (fd 2), else stdout (fd 1), goes to."""
    try:
        files = psutil.Process(pid).open_files()
    except psutil.Error:
        return None
    by_fd = {f.fd: f.path for f in files if getattr(f, "fd", -1) in (1, 2)}
    path = by_fd.get(2) or by_fd.get(1)
    return Path(path) if path else None


def launchd_pids() -> dict[int, str]:
    """PID -> label of the running jobs in this user's launchd domain (``launchctl list``)."""
    if not launchctl.available():
        return {}
    try:
        result = launchctl.run([launchctl.LAUNCHCTL, "list"])
    except launchctl.LaunchctlMissing:
        return {}
    jobs = {}
    for line in result.stdout.splitlines()[1:]:  # "PID\tStatus\tLabel"
        parts = line.split("\t")
        if len(parts) == 3 and parts[0].strip().isdigit():
            jobs[int(parts[0])] = parts[2].strip()
    return jobs


_SERVICE = re.compile(r"/([^/]+\.service)(?=/|$)")


def systemd_unit(pid: int) -> tuple[str, bool] | None:
    """(unit, user unit?) of the systemd service whose cgroup holds ``pid`` (Linux), or None."""
    try:
        return unit_from_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return None


def unit_from_cgroup(text: str) -> tuple[str, bool] | None:
    """Read ``/proc/PID/cgroup``: the innermost ``*.service`` (not the user manager ``user@N``)."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        units = [u for u in _SERVICE.findall(path) if not u.startswith("user@")]
        if units:
            return units[-1], "/user@" in path
    return None


def _restart_hints(server: FoundServer, labels: dict[int, str]) -> None:
    family = [server.pid]
    try:
        family += [p.pid for p in psutil.Process(server.pid).parents()[:3]]
    except psutil.Error:
        pass
    label = next((labels[p] for p in family if p in labels), None)
    if label is not None:
        server.launchd_label = label
        if server.log is None:
            try:
                job = launchctl.job_status(label, "gui", launchctl.launchd_uid("gui", None, server.pid))
            except launchctl.UidUnknown:
                job = None
            if job is not None and job.log is not None:
                server.log, server.log_from = job.log, f"launchd job {label}"
        return
    if sys.platform.startswith("linux"):
        unit = systemd_unit(server.pid)
        if unit is not None:
            server.systemd_unit, server.systemd_user = unit


_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def _name_all(servers: list[FoundServer]) -> None:
    """Instance names from the model (``mlx-community/gemma-3-27b-it-4bit`` -> ``gemma-3-27b-it-4bit``),
    else ``mlx-PORT``; unique, and valid as the config requires."""
    used: set[str] = set()
    for server in servers:
        base = ""
        if server.model:
            base = _NAME_CHARS.sub("-", server.model.rstrip("/").rsplit("/", 1)[-1]).strip("-._")[:56]
        if not base or not base[0].isalnum():
            base = f"mlx-{url_port(server.url)}"
        name, n = base, 2
        while name in used:
            name, n = f"{base}-{n}", n + 1
        used.add(name)
        server.name = name


def _q(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid YAML double-quoted scalar


def starter_config(servers: list[FoundServer], now: datetime | None = None) -> str:
    """A config watching ``servers``, with comments saying what was found and what to check.
    It is validated before it is returned (ValueError would be a bug here)."""
    stamp = (now or datetime.now()).strftime("%Y-%m-%d %H:%M")
    out = [
        f"# Written by `mlxwatch config init` on {stamp}: the mlx-lm servers",
        "# running then. Check it with `mlxwatch doctor`, then start the watchdog with",
        "# `mlxwatch run` (on macOS `mlxwatch launchd install` keeps it running).",
        "# Every setting, with its default: `mlxwatch config example`.",
        "# Durations: 30, 30s, 5m, 1h.",
        "",
        "instances:",
    ]
    for s in servers:
        out.append(f"  - name: {s.name}")
        out.append(f"    url: {s.url}" + ("" if s.listening else "  # from its command line: not listening yet"))
        out.append(f"    # found: PID {s.pid}: {_short(s.cmdline)}")
        if s.group is not None:
            out.append(f"    # {s.group_text};")
            out.append("    #   watched, captured and restarted as one (docs/distributed.md)")
        if s.log is not None:
            out.append(f"    log: {_q(str(s.log))}  # {s.log_from}")
        else:
            out.append("    # log: \"/path/to/server.log\"  # not found: its output goes to a")
            out.append("    #   terminal or a pipe; redirect it to a file and name it here")
            out.append("    #   (log evidence, progress grace)")
        if s.launchd_label:
            out.append(f"    restart: {{launchd: {_q(s.launchd_label)}}}  # the job that runs it")
        elif s.systemd_unit:
            user = ", user: true" if s.systemd_user else ""
            out.append(f"    restart: {{systemd: {_q(s.systemd_unit)}{user}}}  # the unit that runs it")
        else:
            out += [
                "    restart: none  # capture and notify only; to restart it, one of:",
                "    #   restart: {launchd: LABEL}                   # a launchd job",
                "    #   restart: {systemd: UNIT, user: true}        # a systemd unit",
                "    #   restart: {command: [\"/path/to/restart\", \"{pid}\"]}   # any argv, no shell",
                "    #   restart: {signal: SIGTERM}                  # a supervisor restarts it",
            ]
    text = "\n".join(out) + "\n"
    parse_config(yaml.safe_load(text), "<config init>")  # what we write must validate
    return text


def _short(cmdline: tuple[str, ...], limit: int = 100) -> str:
    text = " ".join(cmdline).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"
