"""The daemon's state file (``<state_dir>/state.json``): tracked in memory, written on change.

``mlxwatch status`` reads it whether or not the daemon runs; the daemon reloads each instance's
restart history, gave-up time and recorded server identity from it at start, so restarting the
daemon does not reset the restart budget. Watchers change the in-memory copy only; one writer
task (``StateFile.run_writer``) writes it atomically, off the event loop, at most every
``min_gap`` seconds and only when something changed, so the cost does not grow with the number
of probes. A write that fails (a full disk) is logged once and retried; it never stops a watcher.

If ``state.json`` cannot be read, the restart history and gave-up times are rebuilt from the
journal, with a warning: a budget is never silently reset.

Observers (``StateFile.observers``, callables ``(name, fields)``) are told of each change after
it is made: ``update`` passes the instance's name and the fields it changed, ``set_daemon``
passes ``None`` and the daemon's fields. The metrics follow the tracked state this way, so they
show what ``status`` shows. An observer that raises is logged and ignored. Resume requests are files
``<state_dir>/resume/<instance>`` so they work without IPC.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable

from mlxwatch.errors import StateError
from mlxwatch.journal.incidents import has_records, journal_summary
from mlxwatch.storage import open_regular, private_dir, replace_atomically

log = logging.getLogger("mlxwatch.watchdog")

STATE_NAME = "state.json"
MAX_STATE_BYTES = 64 * 1024 * 1024


class StateFile:
    def __init__(self, state_dir: Path, journal_path: Path | None = None) -> None:
        self.dir = private_dir(state_dir)
        self.path = state_dir / STATE_NAME
        self.data, self.problem = load_state(state_dir)
        if self.problem is None and not self.data["instances"] and journal_path is not None \
                and has_records(journal_path):
            self.problem = "is missing while the journal is not"  # deleted: never a silent reset
        if self.problem is not None and journal_path is not None:
            self.data = rebuild_from_journal(journal_path)
            log.warning("%s %s; restart history and gave-up times rebuilt from the journal (%d instance(s))",
                        self.path, self.problem, len(self.data["instances"]))
        self.dirty = asyncio.Event()
        self.writes = 0  # how many times the file was written (tests and bench read it)
        self.write_error: str | None = None
        self.observers: list[Callable[[str | None, dict[str, Any]], None]] = []
        self._observer_errors: set[str] = set()

    def set_daemon(self, **fields: Any) -> None:
        self.data["daemon"] = {**self.data.get("daemon", {}), **fields, "updated_at": time.time()}
        self.dirty.set()
        self._tell(None, fields)

    def instance(self, name: str) -> dict[str, Any]:
        instances: dict[str, dict[str, Any]] = self.data["instances"]
        return instances.setdefault(name, {})

    def update(self, name: str, *, quiet: bool = False, **fields: Any) -> None:
        """Change an instance's record; ``quiet`` changes (probe times) ride on the next write."""
        self.instance(name).update(fields, updated_at=time.time())
        if not quiet:
            self.dirty.set()
        self._tell(name, fields)

    def _tell(self, name: str | None, fields: dict[str, Any]) -> None:
        for observer in list(self.observers):
            try:
                observer(name, fields)
            except Exception as exc:  # an observer must never break the daemon
                error = f"{type(exc).__name__}: {exc}"
                if error not in self._observer_errors:
                    self._observer_errors.add(error)
                    log.error("state observer %r failed; ignored", observer, exc_info=exc)

    def flush(self) -> None:
        """Write now (blocking; the writer task calls it from a thread, shutdown calls it last)."""
        data = json.dumps(self.data, indent=1, sort_keys=True, default=str).encode()
        replace_atomically(self.path, data)
        self.writes += 1

    async def run_writer(self, min_gap: float = 0.5) -> None:
        """Write whenever something changed, coalescing changes within ``min_gap``."""
        while True:
            await self.dirty.wait()
            await asyncio.sleep(min_gap)
            self.dirty.clear()
            try:
                await asyncio.to_thread(self.flush)
                if self.write_error is not None:
                    log.warning("state file written again after: %s", self.write_error)
                    self.write_error = None
            except OSError as exc:
                if self.write_error is None:
                    log.error("cannot write %s: %s; will retry", self.path, exc.strerror or exc)
                self.write_error = str(exc)
                self.dirty.set()
                await asyncio.sleep(5.0)


def _no_constant(name: str) -> float:
    """``NaN`` and ``Infinity`` are not JSON: a state file holding them is damaged."""
    raise ValueError(f"{name} is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: no count or time the daemon writes
        raise ValueError(f"{text} is out of range")
    return value


def unusable_state_dir(state_dir: Path, exc: OSError) -> StateError:
    """The state dir cannot be used, in the one line `run` and `status` share: the file that
    failed, why, and what to do. `status --state-dir FILE` said only "cannot read: Not a
    directory" and an unreadable dir "cannot read: Permission denied", exit 2 without a fix."""
    where = Path(exc.filename) if exc.filename else state_dir
    head = f"cannot use the state dir {state_dir}"
    if exc.errno == errno.ENOTDIR:
        culprit = next((p for p in (state_dir, *state_dir.parents) if p.exists() and not p.is_dir()), where)
        return StateError(f"{head}: {culprit} is not a directory; give --state-dir the daemon's state dir "
                          "(a directory; state_dir in its config)")
    why = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM):
        owner = _owner(where)
        fix = (f"run mlxwatch as the user the daemon runs as{f' ({owner})' if owner else ''}, "
               "or give --state-dir a directory of yours")
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free some space there, or give --state-dir another directory"
    else:
        fix = "give --state-dir another directory"
    return StateError(f"{head}: {where}: {why}; {fix}")


def _owner(path: Path) -> str | None:
    """The user who owns ``path`` or its nearest existing parent, by name if known."""
    import pwd

    for candidate in (path, *path.parents):
        try:
            uid = os.lstat(candidate).st_uid
        except OSError:
            continue
        if uid == os.geteuid():
            return None  # ours: the mode, not the owner, is the problem
        try:
            return pwd.getpwuid(uid).pw_name
        except KeyError:
            return f"uid {uid}"
    return None


def load_state(state_dir: Path) -> tuple[dict[str, Any], str | None]:
    """The state as saved, and what was wrong with it (None: read fine, or none saved yet).

    Raises ``StateError`` when ``state.json`` is something that cannot be replaced by a file.
    """
    path = state_dir / STATE_NAME
    empty: dict[str, Any] = {"instances": {}}
    try:
        st = os.lstat(path)  # never through a link: a planted one would choose what we read
    except FileNotFoundError:
        return empty, None
    except OSError as exc:
        raise unusable_state_dir(state_dir, exc) from None
    if stat.S_ISLNK(st.st_mode):
        raise StateError(f"{path} is a symbolic link; mlxwatch never reads or writes through one: "
                         "remove it (and check who made it)")
    if stat.S_ISDIR(st.st_mode):
        raise StateError(f"{path} is a directory, not the state file: move it away")
    if not stat.S_ISREG(st.st_mode):
        raise StateError(f"{path} is not a regular file: move it away")
    if st.st_size > MAX_STATE_BYTES:
        return empty, f"is larger than {MAX_STATE_BYTES} bytes"
    try:
        with open_regular(path) as fh:
            data = json.loads(fh.read(MAX_STATE_BYTES).decode("utf-8"), parse_constant=_no_constant,
                              parse_float=_finite)
    except PermissionError as exc:  # not damaged: someone else's (a daemon run by another user)
        raise unusable_state_dir(state_dir, exc) from None
    except (OSError, ValueError) as exc:
        return empty, f"is unreadable ({type(exc).__name__})"
    if not isinstance(data, dict) or not isinstance(data.get("instances", {}), dict) \
            or not isinstance(data.get("daemon", {}), dict):
        return empty, "does not hold a state object"
    data.setdefault("instances", {})
    for name, record in list(data["instances"].items()):
        if not isinstance(record, dict):
            return empty, f"holds a malformed record for {name!r}"
    return data, None


def rebuild_from_journal(journal_path: Path) -> dict[str, Any]:
    """Restart times and gave-up times per instance, from the incident records: the journal's
    index of its closed segments plus the live segment (bounded bytes, however old the journal)."""
    history = journal_summary(journal_path).history
    instances = {name: {"restarts": sorted(h["restarts"]), "gave_up_at": h["gave_up_at"]}
                 for name, h in history.items()}
    return {"instances": instances, "rebuilt_from_journal": True}


def resume_dir(state_dir: Path) -> Path:
    return state_dir / "resume"


def request_resume(state_dir: Path, name: str) -> Path:
    path = private_dir(resume_dir(state_dir)) / name
    replace_atomically(path, f"{time.time()}\n".encode())
    return path


def take_resume(state_dir: Path, name: str) -> bool:
    """True (and the request consumed) if someone asked to resume ``name``."""
    path = resume_dir(state_dir) / name
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
