"""``mlxwatch launch [--name NAME] [--exit-on-thread-death] -- COMMAND...``: run a server with
the launch shim loaded, as the same process.

The user's own command runs unchanged (``mlx_lm.server ...``, ``mlx_lm server ...``, ``python -m
mlx_lm.server ...``, a Python script; from any venv), by ``exec``: the server keeps the PID that
launchd (or a shell, or systemd) started, so ``launchctl kickstart``, KeepAlive and mlxwatch's
identity checks see the process they expect. The only change is the environment:
``mlxwatch/shim/boot`` goes first on ``PYTHONPATH`` and ``MLXWATCH_SHIM=1`` (plus ``--name``,
``--exit-on-thread-death``, and ``--record`` with its bounds) is set; the shim's
``sitecustomize`` takes these out again at start, so the server's children do not load it.
mlxwatch need not be installed in the server's venv: the shim is loaded by path and is stdlib
only.

Refused (exit 2, one line), because the shim could not load: a command that is not found, and a
Python started with ``-I``, ``-E`` or ``-S`` (on its command line or in a script's ``#!`` line),
which ignore ``PYTHONPATH`` or skip ``sitecustomize``. An unusable runtime dir is a warning
only: the server must start anyway (it then runs without heartbeat and stacks on demand).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NoReturn

import psutil

from mlxwatch.config import FrontConfig
from mlxwatch.errors import UsageError
from mlxwatch.shim import layout

BOOT_DIR = Path(__file__).resolve().parent / "boot"
_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)*)?[tw]?$")
_FILE = re.compile(r"^\.?(\d+)\.(json|stacks|fatal|ask|answers|json\.tmp|requests\.\d+)$")
_DISABLING = {"I": "-I (isolated mode ignores PYTHONPATH)", "E": "-E (ignores PYTHONPATH)",
              "S": "-S (skips sitecustomize)"}


@dataclass
class Plan:
    executable: str  # resolved path given to execve
    argv: list[str]  # the user's command, unchanged
    env: dict[str, str]
    warnings: list[str] = field(default_factory=list)


def _disabling_flags(args: list[str]) -> list[str]:
    """Python command-line options (before the script, -m or -c) that would keep the shim out."""
    found = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            break
        if arg.startswith("--"):  # --check-hash-based-pycs MODE and friends: take the value too
            i += 1 if "=" in arg else 2
            continue
        letters = arg[1:]
        for j, letter in enumerate(letters):
            if letter in _DISABLING:
                found.append(_DISABLING[letter])
            if letter in "cm":  # the rest is the program
                return found
            if letter in "XW":  # takes a value: the rest of this word, or the next word
                if j == len(letters) - 1:
                    i += 1
                break
        i += 1
    return found


def _shebang(path: str) -> list[str] | None:
    try:
        with open(path, "rb") as fh:
            head = fh.read(512)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    return head[2:].split(b"\n", 1)[0].decode("utf-8", "replace").split()


def check_python_flags(executable: str, argv: list[str]) -> list[str]:
    """Why the shim could not load in this command, if it could not (empty: it can)."""
    if _PYTHON_NAME.match(os.path.basename(executable)):
        return _disabling_flags(argv[1:])
    words = _shebang(executable)
    if not words:
        return []
    interpreter, rest = os.path.basename(words[0]), words[1:]
    if interpreter == "env":  # #!/usr/bin/env [-S] python3 [flags]
        while rest and rest[0].startswith("-"):
            rest = rest[1:]
        if not rest:
            return []
        interpreter, rest = os.path.basename(rest[0]), rest[1:]
    if _PYTHON_NAME.match(interpreter):
        return _disabling_flags(rest)
    return []


@dataclass(frozen=True)
class Record:
    """``--record``: the requests the server receives are kept this long, at most this many bytes."""

    max_age: float
    max_bytes: int


def plan(command: list[str], *, name: str | None = None, exit_on_thread_death: bool = False,
         record: Record | None = None, environ: dict[str, str] | None = None) -> Plan:
    """What ``launch`` will exec (raises UsageError for a command the shim cannot ride along)."""
    env = dict(os.environ if environ is None else environ)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("launch: give the server command after --, e.g. "
                         "mlxwatch launch -- mlx_lm.server --model MODEL --port 8080")
    first = command[0]
    if os.sep in first:
        executable = first if os.access(first, os.X_OK) and os.path.isfile(first) else None
    else:
        executable = shutil.which(first, path=env.get("PATH", os.defpath))
    if executable is None:  # the PATH itself is not printed: it can be hundreds of characters
        if os.sep not in first:
            raise UsageError(f"launch: {first}: command not found on PATH; give its full path, "
                             "e.g. ~/.local/bin/mlx_lm.server")
        why = "no such file" if not os.path.lexists(first) else "not an executable file"
        raise UsageError(f"launch: {first}: {why}; check the path (`command -v mlx_lm.server` prints it)")
    blocked = check_python_flags(executable, command)
    if blocked:
        raise UsageError(f"launch: the shim cannot load in {first}: its Python runs with {', '.join(blocked)}; "
                         "run the interpreter without it: mlxwatch launch -- /path/to/python /path/to/script ...")
    existing = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(BOOT_DIR) + (os.pathsep + existing if existing else "")
    env[layout.ACTIVE_ENV] = "1"
    env[layout.BOOT_ENV] = str(BOOT_DIR)
    if name:
        env[layout.NAME_ENV] = name
    else:
        env.pop(layout.NAME_ENV, None)
    if exit_on_thread_death:
        env[layout.EXIT_ENV] = "1"
    else:
        env.pop(layout.EXIT_ENV, None)
    if record is not None:
        env[layout.RECORD_ENV] = layout.record_setting(record.max_age, record.max_bytes)
    else:
        env.pop(layout.RECORD_ENV, None)
    warnings = []
    directory = layout.runtime_dir(env)
    problem = layout.ensure_private_dir(directory)
    if problem:
        warnings.append(f"runtime dir unusable ({problem}): the server starts without heartbeat or stacks on demand")
    else:
        clean_runtime_dir(directory, os.getpid(), keep_requests=record.max_age if record else None)
    if problem and record is not None:
        warnings.append("so no requests are recorded either (--record)")
    return Plan(executable, list(command), env, warnings)


def clean_runtime_dir(directory: str, own_pid: int, now: float | None = None, keep_requests: float | None = None) -> int:
    """Remove files of processes gone for more than ``layout.KEEP_DEAD_SECONDS``, and any left
    by an earlier process with the PID this one (about to become the server) has. Best effort.
    Recorded requests (users' words) of a process gone are kept only as long as a recorder keeps
    them (``keep_requests``, this launch's ``--record-max-age``; else the default's)."""
    keep_words = keep_requests if keep_requests is not None else FrontConfig.record_max_age
    now = time.time() if now is None else now
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for entry in names:
        m = _FILE.match(entry)
        if not m:
            continue
        pid = int(m.group(1))
        path = os.path.join(directory, entry)
        try:
            if pid != own_pid:
                keep = keep_words if m.group(2).startswith("requests.") else layout.KEEP_DEAD_SECONDS
                if psutil.pid_exists(pid) or now - os.lstat(path).st_mtime < keep:
                    continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    return removed


def launch(command: list[str], *, name: str | None = None, exit_on_thread_death: bool = False,
           record: Record | None = None, on_warning: Callable[[str], None] = lambda warning: None) -> NoReturn:
    """Exec the server command with the shim; returns only by raising (UsageError, OSError).
    ``on_warning`` hears what the plan found worth saying, before the exec (the CLI prints it)."""
    p = plan(command, name=name, exit_on_thread_death=exit_on_thread_death, record=record)
    for warning in p.warnings:
        on_warning(warning)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(p.executable, p.argv, p.env)
