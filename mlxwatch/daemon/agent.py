"""The launchd agent that runs ``mlxwatch run`` beside the servers it watches.

``mlxwatch launchd plist`` prints the agent for this installation; ``mlxwatch launchd install``
writes it to ``~/Library/LaunchAgents/<label>.plist`` (with ``plistlib``) and loads it with
``launchctl bootstrap gui/<uid> <plist>`` (after ``bootout`` when that label is loaded);
``uninstall`` boots it out and removes the file, keeping the state dir and the bundles. Every
``launchctl`` call goes through ``mlxwatch.host.launchctl`` (one seam, replaced by tests).

The agent, key by key:

- ``ProgramArguments``: this environment's ``mlxwatch`` and the config, both absolute (launchd
  resolves nothing against a working directory or a shell).
- ``RunAtLoad`` and ``KeepAlive``: start at login, start again if it exits; ``ThrottleInterval``
  30 s between starts, so a crash loop costs little (launchd's own default is 10 s and it has no
  restart budget of its own).
- ``ProcessType`` **Interactive**: launchd.plist(5) says an unset ``ProcessType`` (and
  ``Standard``, "equivalent to no ProcessType being set") gets "light resource limits ...
  throttling its CPU usage and I/O bandwidth", and that only ``Interactive`` jobs "run with the
  same resource limitations as apps, that is to say, none". mlxwatch judges a server by how long
  it takes to answer; a throttled watchdog (and its py-spy, ``sample`` and probe children, which
  inherit the limits) would count its own delay against the server.
- ``EnvironmentVariables`` PATH: this environment's ``bin`` first (launchd's default PATH,
  ``/usr/bin:/bin:/usr/sbin:/sbin``, would not find ``py-spy``), Homebrew's, then the default,
  which holds ``sample`` (/usr/bin) and ``spindump`` (/usr/sbin).
- stdout and stderr in ``~/Library/Logs/mlxwatch/<label>.log``.

``launchd/com.mlxwatch.daemon.plist`` is the same agent as a template for editing by hand.
"""

from __future__ import annotations

import os
import plistlib
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlxwatch.errors import ConfigError, MlxwatchError, UsageError
from mlxwatch.host import launchctl

LABEL = "com.mlxwatch.daemon"
BASE_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"  # launchd's default PATH for a job
PROCESS_TYPE = "Interactive"
THROTTLE_INTERVAL = 30
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)


class LaunchdError(MlxwatchError):
    """launchctl refused or failed a bootstrap or bootout (the CLI exits 1)."""


def check_label(label: str) -> str:
    """A label becomes a file name and a launchctl target: letters, digits, ``.``, ``_``, ``-``."""
    if not _LABEL.fullmatch(label):
        raise UsageError(f"launchd label {label!r}: use letters, digits, '.', '_' and '-' (such as {LABEL})")
    return label


def agents_dir(home: Path | None = None) -> Path:
    return (home or Path.home()) / "Library" / "LaunchAgents"


def plist_path(label: str, home: Path | None = None) -> Path:
    return agents_dir(home) / f"{label}.plist"


def log_path(label: str, home: Path | None = None) -> Path:
    return (home or Path.home()) / "Library" / "Logs" / "mlxwatch" / f"{label}.log"


def default_bin_dir() -> Path:
    return Path(sys.executable).parent.absolute()


def agent(config: Path, label: str = LABEL, bin_dir: Path | None = None, log: Path | None = None) -> dict:
    bin_dir = bin_dir or default_bin_dir()
    log = log or log_path(label)
    return {
        "Label": label,
        "ProgramArguments": [str(bin_dir / "mlxwatch"), "--config", str(config), "run"],
        "EnvironmentVariables": {"PATH": f"{bin_dir}:/opt/homebrew/bin:/usr/local/bin:{BASE_PATH}",
                                 "PYTHONUNBUFFERED": "1"},
        "RunAtLoad": True,
        "KeepAlive": True,
        "ThrottleInterval": THROTTLE_INTERVAL,
        "ProcessType": PROCESS_TYPE,
        "StandardOutPath": str(log),
        "StandardErrorPath": str(log),
    }


def render(config: Path, label: str = LABEL, bin_dir: Path | None = None, log: Path | None = None) -> bytes:
    return plistlib.dumps(agent(config, label, bin_dir, log), sort_keys=False)


def written_by_mlxwatch(data: bytes, label: str) -> bool:
    """Is this plist an mlxwatch agent for ``label`` (one ``install`` may replace)? Its label, and
    a program named ``mlxwatch`` whose last argument is ``run``."""
    try:
        plist = plistlib.loads(data)
    except Exception:  # plistlib raises several kinds on a damaged or foreign file
        return False
    args = plist.get("ProgramArguments") if isinstance(plist, dict) else None
    return (isinstance(args, list) and len(args) >= 2 and all(isinstance(a, str) for a in args)
            and Path(args[0]).name == "mlxwatch" and args[-1] == "run" and plist.get("Label") == label)


@dataclass(frozen=True)
class Installed:
    label: str
    plist: Path
    domain: str  # gui/<uid>
    argv: list[str]
    log: Path
    replaced_loaded: bool  # a loaded job of that label was booted out first


@dataclass(frozen=True)
class Uninstalled:
    label: str
    plist: Path
    booted_out: bool
    removed: bool


def _own_uid(action: str) -> int:
    if launchctl.effective_uid() == 0:
        raise UsageError(f"run `mlxwatch launchd {action}` as the user whose agent it is, not as root: "
                         "root's gui/0 domain is not that user's login session")
    return launchctl.real_uid()


def _loaded(label: str, uid: int, path: Path, force: bool) -> bool:
    """Is ``label`` loaded in the gui domain? One loaded from another file is not ours to boot out."""
    result = launchctl.run(launchctl.print_argv("gui", uid, label))
    if result.returncode != 0:
        return False
    origin = launchctl.parse_print(result.stdout).plist
    if origin is not None and origin != path and not force:
        raise UsageError(f"{launchctl.service_target('gui', uid, label)} is loaded from {origin}, not from {path}; "
                         "--force boots it out")
    return True


def _bootout(label: str, uid: int) -> None:
    result = launchctl.run(launchctl.bootout_argv("gui", uid, label))
    if result.returncode != 0:
        raise LaunchdError(f"launchctl bootout {launchctl.service_target('gui', uid, label)}: {result.message}")


def _refuse_foreign(path: Path, label: str, force: bool) -> None:
    if force or not path.exists():
        return
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not written_by_mlxwatch(data, label):
        raise UsageError(f"{path} exists and is not an mlxwatch agent; --force replaces it")


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # launchd reads agents as the user; group/other write is refused
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _require_launchctl() -> None:
    if not launchctl.available():
        raise UsageError("launchctl not found: launchd agents exist only on macOS")


def install(config: Path, label: str = LABEL, force: bool = False, home: Path | None = None,
            bin_dir: Path | None = None, validate: Callable[[Path], object] | None = None) -> Installed:
    """Write the agent and load it in this user's gui domain. The config is validated first: an
    agent whose config does not load would exit 2 at every start, every ThrottleInterval."""
    from mlxwatch.config import load_runnable_config

    check_label(label)
    config = config.expanduser().resolve()
    if not config.is_file():
        raise UsageError(f"{config}: no such config file (the agent would exit 2 at every start); "
                         "write one first (see mlxwatch.example.yaml)")
    try:
        (validate or load_runnable_config)(config)  # the rule `run` applies: no agent that exits 2 at start
    except ConfigError as exc:
        raise UsageError(f"{exc} (agent not installed: it would exit 2 at every start)") from None
    _require_launchctl()
    uid = _own_uid("install")
    bin_dir = bin_dir or default_bin_dir()
    if not (bin_dir / "mlxwatch").exists():
        raise UsageError(f"{bin_dir / 'mlxwatch'}: not found; run install with the mlxwatch of the environment "
                         "the agent should run")
    path = plist_path(label, home)
    _refuse_foreign(path, label, force)
    log = log_path(label, home)
    try:
        loaded = _loaded(label, uid, path, force)
        if loaded:
            _bootout(label, uid)
        log.parent.mkdir(parents=True, exist_ok=True)
        _write(path, render(config, label, bin_dir, log))
        result = launchctl.run(launchctl.bootstrap_argv("gui", uid, path))
    except launchctl.LaunchctlMissing as exc:
        raise UsageError(str(exc)) from None
    if result.returncode != 0:
        raise LaunchdError(f"launchctl bootstrap gui/{uid} {path}: {result.message} (the agent file is written; "
                           "fix the cause and run install again)")
    return Installed(label, path, f"gui/{uid}", agent(config, label, bin_dir, log)["ProgramArguments"], log, loaded)


def uninstall(label: str = LABEL, force: bool = False, home: Path | None = None) -> Uninstalled:
    """Boot the agent out and remove its file; the state dir and the bundles stay."""
    check_label(label)
    _require_launchctl()
    uid = _own_uid("uninstall")
    path = plist_path(label, home)
    _refuse_foreign(path, label, force)
    try:
        loaded = _loaded(label, uid, path, force)
        if loaded:
            _bootout(label, uid)
    except launchctl.LaunchctlMissing as exc:
        raise UsageError(str(exc)) from None
    removed = False
    if path.exists():
        path.unlink()
        removed = True
    return Uninstalled(label, path, loaded, removed)
