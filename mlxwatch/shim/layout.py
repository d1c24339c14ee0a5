"""Where the shim's files live and what both sides call things. Stdlib only.

The runtime dir is per user and the same whatever the environment of the process asking (a
launchd agent has no ``TMPDIR`` or ``XDG_RUNTIME_DIR``; a terminal has both), so a daemon finds
a server's files knowing only its PID::

    $MLXWATCH_RUNTIME_DIR           if set (then set it for the daemon too), else
    /tmp/mlxwatch-<uid>             (macOS: /private/tmp/mlxwatch-<uid>)

The directory is made 0700 and is used only when it is a real directory (not a symlink) owned
by this user with no group or other permission bits; otherwise the shim publishes nothing and
says so once on stderr, and the reader refuses it. Per server process:

    <pid>.json      the heartbeat, replaced atomically about once a second
    <pid>.stacks    faulthandler's all-thread dumps, appended on each stack signal
    <pid>.fatal     faulthandler's dump on a fatal signal (SIGSEGV, SIGABRT, ...), if any
    <pid>.ask       a FIFO: dump requests to the shim's dump thread (``dumps``)
    <pid>.answers   that thread's all-thread dumps, appended per request
    <pid>.requests.<n>  the recorded requests (``launch --record`` only): a bounded spool of
                    segments (``spool``), n counting up, the oldest removed first

Files of a process that ended stay (its heartbeat holds the generation thread's traceback);
``mlxwatch launch`` removes those of processes gone for more than ``KEEP_DEAD_SECONDS``.
"""

from __future__ import annotations

import os
import re
import stat

FORMAT = 1  # the heartbeat's "format"; a reader refuses other values

RUNTIME_ENV = "MLXWATCH_RUNTIME_DIR"
ACTIVE_ENV = "MLXWATCH_SHIM"  # "1": set by `mlxwatch launch`; boot/sitecustomize does nothing without it
NAME_ENV = "MLXWATCH_SHIM_NAME"  # --name, shown in the heartbeat
EXIT_ENV = "MLXWATCH_SHIM_EXIT_ON_THREAD_DEATH"  # "1": --exit-on-thread-death
BOOT_ENV = "MLXWATCH_SHIM_BOOT"  # the boot dir launch put on PYTHONPATH (children inherit it: see boot)
RECORD_ENV = "MLXWATCH_SHIM_RECORD"  # "MAX_AGE_SECONDS:MAX_BYTES": --record; unset, the shim records nothing

INTERVAL = 1.0  # seconds between heartbeats
STACK_SIGNAL = "SIGUSR2"  # faulthandler dumps all threads on it (mlx-lm, mlx and http.server use none)
THREAD_DEATH_EXIT = 70  # EX_SOFTWARE: the exit status for --exit-on-thread-death
KEEP_DEAD_SECONDS = 7 * 24 * 3600
# Header names that carry credentials (RFC 9110 Authorization, cookies, the API-key headers
# OpenAI-style clients send): never recorded, by the front door or the shim; their names are kept.
CREDENTIAL = re.compile(r"(authorization|cookie|api[-_]?key|token|secret|password|session)", re.IGNORECASE)


def runtime_dir(env: "os._Environ[str] | dict[str, str] | None" = None) -> str:
    env = os.environ if env is None else env
    chosen = env.get(RUNTIME_ENV)
    if chosen:
        return os.path.abspath(os.path.expanduser(chosen))
    return os.path.join("/tmp", f"mlxwatch-{os.getuid()}")


def heartbeat_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}.json")


def stacks_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}.stacks")


def fatal_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}.fatal")


def ask_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}.ask")


def answers_path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"{pid}.answers")


def requests_path(directory: str, pid: int, n: int) -> str:
    return os.path.join(directory, f"{pid}.requests.{n}")


def record_setting(max_age: float, max_bytes: int) -> str:
    """``RECORD_ENV``'s value for these bounds."""
    return f"{max_age:g}:{max_bytes}"


def parse_record_setting(value: str | None) -> tuple[float, int] | None:
    """``RECORD_ENV``'s bounds (seconds, bytes); None when unset or not two positive numbers."""
    if not value:
        return None
    try:
        age, size = value.split(":")
        max_age, max_bytes = float(age), int(size)
    except ValueError:
        return None
    if not (0 < max_age < float("inf") and max_bytes > 0):
        return None
    return max_age, max_bytes


def check_private_dir(path: str) -> str | None:
    """None if ``path`` is a directory only this user can use; else what is wrong with it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} does not exist"
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (a symlink or a file is refused)"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o077:
        return f"{path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}; want 700)"
    return None


def ensure_private_dir(path: str) -> str | None:
    """Make ``path`` (0700) if it is missing; None when it is usable, else the problem."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        return f"cannot make {path}: {exc.strerror}"
    return check_private_dir(path)
