"""launchd through ``launchctl``: the command lines, the one seam that runs them, and reading
``launchctl print`` for the few fields mlxwatch needs.

Command lines follow launchctl(1)'s synopsis (macOS 10.10+ "launchctl 2" subcommands)::

    bootstrap | bootout domain-target [service-path ...] | service-target
    kickstart [-kp] service-target        -k: kill the running instance before restarting it
    print domain-target | service-target

A domain target is ``system``, ``user/<uid>`` or ``gui/<uid>`` (``gui/`` exists only while that
user is logged in at the GUI); a service target is ``<domain-target>/<label>``. ``system/`` needs
root to change anything.

**The uid is never taken from a root daemon's own uid**: as root, ``gui/0/...`` names a domain
that does not exist and every call fails (``Could not find service ... in domain``, exit 113).
It comes from the config (``restart.uid``), else from the owner of the server process, else from
this process when it is not root; otherwise ``UidUnknown`` says what to set.

``launchctl print`` output is, in its man page's words, "NOT API in any sense at all": only the
service block's own top-level ``pid``, ``state``, ``path`` and ``stdout/stderr path`` lines are
read, nested blocks (whose own ``state`` and ``pid`` lines belong to coalitions and event
triggers) are skipped, and any of them may be absent. Paths are taken from the job's plist file
(``path``) when it can be read, and from ``print`` only as a fallback.

Every ``launchctl`` run goes through ``runner`` (module attribute, replaced by tests): nothing
here calls ``subprocess`` any other way.
"""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import psutil

LAUNCHCTL = "launchctl"
TIMEOUT = 15.0
DOMAINS = ("gui", "user", "system")
NOT_FOUND = 113  # "Could not find service ... in domain" (seen in public reports of kickstart and print)


class LaunchctlMissing(Exception):
    """``launchctl`` does not exist here (not macOS)."""


class UidUnknown(Exception):
    """Running as root with nothing that says whose gui/user domain the job lives in."""


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def message(self) -> str:
        """The line that says what happened ("Could not find service ..."), for one-line reports."""
        lines = [l.strip() for l in (self.stderr + "\n" + self.stdout).splitlines() if l.strip()]
        lines = [l for l in lines if l != "Bad request."] or lines  # print says this before the reason
        return lines[0] if lines else f"exit {self.returncode}"


Runner = Callable[[Sequence[str]], Result]


def system_runner(argv: Sequence[str]) -> Result:
    """Run launchctl for real (no shell, bounded time)."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise LaunchctlMissing(f"{argv[0]}: not found (launchd exists only on macOS)") from None
    except subprocess.TimeoutExpired:
        return Result(124, "", f"{argv[0]} {argv[1] if len(argv) > 1 else ''}: timed out after {TIMEOUT:g}s")
    return Result(proc.returncode, proc.stdout or "", proc.stderr or "")


runner: Runner = system_runner


def available() -> bool:
    """Is there a launchctl to run? (Part of the seam: tests replace it with the runner.)"""
    return shutil.which(LAUNCHCTL) is not None


def run(argv: Sequence[str]) -> Result:
    return runner(argv)


# --- targets and command lines (launchctl(1) synopsis above)


def domain_target(domain: str, uid: int | None) -> str:
    if domain not in DOMAINS:
        raise ValueError(f"launchd domain must be one of {', '.join(DOMAINS)} (got {domain!r})")
    if domain == "system":
        return "system"
    if uid is None:
        raise UidUnknown(f"the {domain}/ domain needs a uid")
    return f"{domain}/{uid}"


def service_target(domain: str, uid: int | None, label: str) -> str:
    return f"{domain_target(domain, uid)}/{label}"


def bootstrap_argv(domain: str, uid: int | None, plist: Path) -> list[str]:
    return [LAUNCHCTL, "bootstrap", domain_target(domain, uid), str(plist)]


def bootout_argv(domain: str, uid: int | None, label: str) -> list[str]:
    return [LAUNCHCTL, "bootout", service_target(domain, uid, label)]


def kickstart_argv(domain: str, uid: int | None, label: str) -> list[str]:
    return [LAUNCHCTL, "kickstart", "-k", service_target(domain, uid, label)]


def print_argv(domain: str, uid: int | None, label: str) -> list[str]:
    return [LAUNCHCTL, "print", service_target(domain, uid, label)]


# --- whose domain


def process_owner(pid: int | None) -> int | None:
    """The real uid of a process (the user whose agent runs it), or None."""
    if pid is None:
        return None
    try:
        return psutil.Process(pid).uids().real
    except (psutil.Error, AttributeError):
        return None


def effective_uid() -> int:
    return os.geteuid()


def real_uid() -> int:
    return os.getuid()


def launchd_uid(domain: str, configured: int | None = None, server_pid: int | None = None) -> int | None:
    """The uid for a gui/ or user/ target: config, else the server's owner, else ours unless we
    are root. None for ``system``. Raises UidUnknown as root when nothing else says."""
    if domain == "system":
        return None
    if configured is not None:
        return configured
    owner = process_owner(server_pid)
    if owner is not None and owner != 0:
        return owner
    if effective_uid() != 0:
        return real_uid()
    raise UidUnknown(f"running as root, the {domain}/ domain's uid is unknown: set restart.uid to the uid of "
                     "the user whose launchd agent runs the server (`id -u` as that user); root's own "
                     f"{domain}/0 domain is not where that agent lives")


# --- launchctl print


@dataclass(frozen=True)
class JobInfo:
    """The fields of ``launchctl print <service-target>`` mlxwatch reads; any may be None."""

    pid: int | None = None
    state: str | None = None
    plist: Path | None = None  # `path = ...`: the job's plist file
    stdout_path: Path | None = None
    stderr_path: Path | None = None


_LINE = re.compile(r"^\s*(?P<key>[A-Za-z][A-Za-z ]*?)\s+=\s+(?P<value>.*?)\s*$")


def parse_print(text: str) -> JobInfo:
    """Read the service block's own top-level fields, skipping every nested ``{ ... }`` block."""
    fields: dict[str, str] = {}
    depth = 0
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        opens = line.endswith("{")
        if line.startswith("}"):
            depth = max(0, depth - 1)
            continue
        if depth == 1 and not opens:
            m = _LINE.match(line)
            if m and m.group("key") not in fields:
                fields[m.group("key")] = m.group("value")
        if opens:
            depth += 1
    pid = fields.get("pid", "")
    return JobInfo(
        pid=int(pid) if pid.isdigit() and int(pid) > 0 else None,
        state=fields.get("state") or None,
        plist=_path(fields.get("path")),
        stdout_path=_path(fields.get("stdout path")),
        stderr_path=_path(fields.get("stderr path")),
    )


def _path(value: str | None) -> Path | None:
    return Path(value) if value and value.startswith("/") else None


@dataclass(frozen=True)
class JobStatus:
    """What launchd says of a label: loaded or not, its PID if running, and its log."""

    target: str
    loaded: bool
    pid: int | None = None
    state: str | None = None
    plist: Path | None = None
    log: Path | None = None  # StandardErrorPath (else StandardOutPath) of the job
    detail: str = ""


def job_status(label: str, domain: str = "gui", uid: int | None = None) -> JobStatus:
    """Ask launchd about ``label``. Never raises for launchd's answers: a missing launchctl, an
    unknown label or an unreadable answer are in ``detail``."""
    target = service_target(domain, uid, label)
    try:
        result = run(print_argv(domain, uid, label))
    except LaunchctlMissing as exc:
        return JobStatus(target, False, detail=str(exc))
    if result.returncode != 0:
        return JobStatus(target, False, detail=f"launchctl print {target}: {result.message}")
    info = parse_print(result.stdout)
    log = job_log(info)
    detail = f"{target} is loaded, state {info.state or 'unknown'}" + (f", PID {info.pid}" if info.pid else ", no PID")
    return JobStatus(target, True, info.pid, info.state, info.plist, log, detail)


def job_log(info: JobInfo) -> Path | None:
    """The job's log: StandardErrorPath (tracebacks go to stderr), else StandardOutPath, from
    its plist file when readable, else from ``print``."""
    if info.plist is not None:
        try:
            with open(info.plist, "rb") as fh:
                plist = plistlib.loads(fh.read(1024 * 1024))
        except (OSError, ValueError, plistlib.InvalidFileException):
            plist = None
        if isinstance(plist, dict):
            for key in ("StandardErrorPath", "StandardOutPath"):
                value = plist.get(key)
                if isinstance(value, str) and value.strip():
                    return Path(value).expanduser()
    return info.stderr_path or info.stdout_path
