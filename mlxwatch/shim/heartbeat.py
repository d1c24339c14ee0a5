"""Read the launch shim's heartbeat for a server PID, and ask the shim for stacks.

A server started with ``mlxwatch launch`` publishes ``<runtime dir>/<pid>.json`` about once a
second (see ``mlxwatch.shim``). Capture, the daemon and ``status`` find it by PID alone; no
config is needed. A heartbeat counts only if it is this process's: its ``pid`` matches and the
shim started (``started_at``) within ``START_SLACK`` after the process was created (a PID reused
by a process without the shim is never mistaken for the shimmed one, and never signalled)::

    hb, problem = find(pid, create_time)
    if hb and hb.seam_ok:
        print(hb.tokens_per_s, hb.since_last_token, hb.stalled_for)
    dump = request_stacks(hb, ProcessIdentity.of(pid))   # dump.text: every thread, faulthandler's format

Reads are bounded (a regular file of at most ``MAX_BYTES``) and blocking: call them from a
worker thread in async code.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from typing import Any

import psutil

from mlxwatch.host.process import ProcessIdentity
from mlxwatch.shim import dumps, layout

MAX_BYTES = 1024 * 1024
STALE_AFTER = 5.0  # seconds without a new heartbeat (interval 1 s): GIL held, stopped, or gone
START_SLACK = (-2.0, 120.0)  # shim start minus process create time (exec by launch, slow start, clock rounding)
DUMP_TIMEOUT = 3.0  # a dump takes milliseconds; none within this: the process cannot run its signal handler
DUMP_SETTLE = 0.1  # the dump is complete when the file stopped growing for this long
ANSWER_QUIET = STALE_AFTER  # no answer, no heartbeat for this long: no Python thread runs (the GIL is held).
# Not shorter: busy threads delay a heartbeat past 2.5 s (48 of them, measured).
ANSWER_FIRST = 0.25  # the dump thread gets this long even when the heartbeat is quiet already
ANSWER_LIMIT = 10.0  # heartbeats come (Python runs) but no answer for this long: give up, without the signal
_HEADER = re.compile(rf"^{re.escape(dumps.HEADER)} ([0-9a-f ]+)\n", re.M)
_FOOTER = re.compile(rf"^{re.escape(dumps.FOOTER)}", re.M)


@dataclass(frozen=True)
class StackDump:
    """One all-thread dump in faulthandler's text format, and who took it: ``thread`` (the
    shim's dump thread, under the GIL) or ``signal`` (faulthandler, while the GIL was held)."""

    text: str
    by: str


class ShimError(Exception):
    """The shim could not do what was asked (no heartbeat, no stack signal, no dump in time)."""


@dataclass(frozen=True)
class Heartbeat:
    pid: int
    data: dict[str, Any]
    read_at: float
    path: str
    read_mono: float | None = None  # time.monotonic() at reading: ages are timed on it when the shim published one

    # --- what was published

    @property
    def loop(self) -> dict[str, Any]:
        return self.data.get("loop") or {}

    @property
    def published_at(self) -> float:
        return float(self.data.get("published_at") or 0.0)

    @property
    def seq(self) -> int:
        """How many heartbeats the shim published before this one."""
        return int(self.data.get("seq") or 0)

    @property
    def started_at(self) -> float:
        return float(self.data.get("started_at") or 0.0)

    @property
    def seam_state(self) -> str:
        return str((self.data.get("seam") or {}).get("state") or "unknown")

    @property
    def seam_ok(self) -> bool:
        return self.seam_state == "ok"

    @property
    def seam_detail(self) -> str:
        return str((self.data.get("seam") or {}).get("detail") or "")

    @property
    def record(self) -> dict[str, Any] | None:
        """The shim's request recorder (``launch --record``): state, bounds, counts and the
        requests in flight; None when it does not record."""
        rec = self.data.get("record")
        return rec if isinstance(rec, dict) else None

    @property
    def directory(self) -> str:
        """The runtime dir this heartbeat was read from (its other files are beside it)."""
        return os.path.dirname(self.path)

    def _num(self, key: str) -> float | None:
        value = self.loop.get(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    @property
    def steps(self) -> int:
        return int(self._num("steps") or 0)

    @property
    def tokens(self) -> int:
        return int(self._num("tokens") or 0)

    @property
    def prompt_tokens(self) -> int:
        return int(self._num("prompt_tokens") or 0)

    @property
    def in_flight(self) -> int:
        return int(self._num("in_flight") or 0)

    @property
    def queued(self) -> int | None:
        q = self._num("queued")
        return int(q) if q is not None else None

    @property
    def tokens_per_s(self) -> float | None:
        return self._num("tokens_per_s")

    @property
    def last_token_at(self) -> float | None:
        return self._num("last_token_at")

    @property
    def in_step_since(self) -> float | None:
        return self._num("in_step_since")

    # --- what it means when read

    @property
    def age(self) -> float:
        """Seconds since the shim last published: on the monotonic clock when both sides read
        it (system-wide on Linux and macOS, so a wall-clock step makes no heartbeat stale, and
        time asleep does not count), else on the wall clock."""
        mono = self.data.get("published_mono")
        if isinstance(mono, (int, float)) and not isinstance(mono, bool) and self.read_mono is not None:
            return max(0.0, self.read_mono - mono)
        return max(0.0, self.read_at - self.published_at)

    def _since(self, at: float) -> float:
        """Seconds from the shim's wall time ``at`` to this reading: the part before publishing
        on the shim's own clock, the rest as ``age``."""
        return max(0.0, self.published_at - at) + self.age

    @property
    def stale(self) -> bool:
        return self.age > max(STALE_AFTER, 5 * float(self.data.get("interval") or 1.0))

    @property
    def since_last_token(self) -> float | None:
        return None if self.last_token_at is None else self._since(self.last_token_at)

    @property
    def stalled_for(self) -> float:
        """Requests in flight and neither a token nor prompt progress for this long (0: none in
        flight), as of reading: a stale heartbeat's stall keeps growing."""
        quiet = self._num("quiet_since")
        if not self.in_flight or quiet is None:
            return 0.0
        return self._since(quiet)

    @property
    def in_step_for(self) -> float | None:
        """How long the batch loop has been inside one ``BatchGenerator.next`` call."""
        return None if self.in_step_since is None else self._since(self.in_step_since)

    @property
    def thread(self) -> dict[str, Any] | None:
        t = self.data.get("generation_thread")
        return t if isinstance(t, dict) else None

    @property
    def thread_died(self) -> bool:
        t = self.thread
        return t is not None and t.get("end") == "died"

    @property
    def thread_exception(self) -> dict[str, Any] | None:
        t = self.thread or {}
        exc = t.get("exception")
        return exc if isinstance(exc, dict) else None

    @property
    def stack_signal(self) -> int | None:
        s = self.data.get("stacks")
        if isinstance(s, dict) and isinstance(s.get("signum"), int) and isinstance(s.get("file"), str):
            return int(s["signum"])
        return None

    @property
    def stacks_file(self) -> str | None:
        return self._stacks_path("file")

    @property
    def ask_path(self) -> str | None:
        """The shim's dump thread's FIFO (``mlxwatch.shim.dumps``); None from a shim without one."""
        return self._stacks_path("ask") if self._stacks_path("answers") else None

    @property
    def answers_path(self) -> str | None:
        return self._stacks_path("answers") if self._stacks_path("ask") else None

    @property
    def dump_thread_down(self) -> bool:
        """The shim has a dump thread but it does not serve now (it is being started again): its
        heartbeat says ``ask: null``, where an older shim's has no ``ask`` at all."""
        s = self.data.get("stacks")
        return isinstance(s, dict) and "ask" in s and self.ask_path is None

    @property
    def dumps_offered(self) -> bool:
        """Can this shim dump its threads by either way?"""
        return self.stack_signal is not None or self.ask_path is not None

    def _stacks_path(self, key: str) -> str | None:
        s = self.data.get("stacks")
        return s.get(key) if isinstance(s, dict) and isinstance(s.get(key), str) else None

    def thread_names(self) -> dict[int, tuple[str, int | None]]:
        """Thread ident (as faulthandler prints it) -> (name, native id)."""
        out: dict[int, tuple[str, int | None]] = {}
        for key, value in (self.data.get("threads") or {}).items():
            try:
                ident = int(key)
            except ValueError:
                continue
            if isinstance(value, dict):
                native = value.get("native_id")
                out[ident] = (str(value.get("name") or "?"), native if isinstance(native, int) else None)
        return out

    def summary(self) -> dict[str, Any]:
        """What ``status`` and the journal show."""
        exc = self.thread_exception
        return {
            "pid": self.pid, "name": self.data.get("name"), "seam": self.seam_state, "age": round(self.age, 1),
            "stale": self.stale, "tokens_per_s": self.tokens_per_s, "since_last_token": _r(self.since_last_token),
            "tokens": self.tokens, "steps": self.steps, "in_flight": self.in_flight, "queued": self.queued,
            "stalled_for": round(self.stalled_for, 1), "in_step_for": _r(self.in_step_for),
            "thread": "died" if self.thread_died else ("running" if self.thread else "not seen yet"),
            "exception": f"{exc.get('type')}: {exc.get('message')}" if exc else None,
        }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def candidate_dirs(pid: int | None = None) -> list[str]:
    """Where to look: this process's runtime dir, then the one the server was told (its
    environment's ``MLXWATCH_RUNTIME_DIR``, when this user may read it)."""
    dirs = [layout.runtime_dir()]
    if pid is not None:
        try:
            theirs = psutil.Process(pid).environ().get(layout.RUNTIME_ENV)
        except (psutil.Error, OSError):
            theirs = None
        if theirs:
            path = layout.runtime_dir({layout.RUNTIME_ENV: theirs})
            if path not in dirs:
                dirs.append(path)
    return dirs


def _read_bounded(path: str) -> bytes:
    """A heartbeat's bytes: a regular file (never a link, never a FIFO to block on), at most MAX_BYTES."""
    fd = dumps.open_regular(path, os.O_RDONLY)
    try:
        if os.fstat(fd).st_size > MAX_BYTES:
            raise ShimError(f"{path} is larger than {MAX_BYTES} bytes")
        chunks, left = [], MAX_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(65536, left))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read(pid: int, create_time: float | None = None, directory: str | None = None) -> tuple[Heartbeat | None, str | None]:
    """The heartbeat of ``pid`` in ``directory`` (default: the runtime dir), or (None, why not)."""
    directory = directory or layout.runtime_dir()
    problem = layout.check_private_dir(directory)
    if problem:
        return None, f"no shim runtime dir: {problem}"
    path = layout.heartbeat_path(directory, pid)
    try:
        raw = _read_bounded(path)
    except FileNotFoundError:
        return None, f"no heartbeat for PID {pid} in {directory}"
    except (OSError, ShimError) as exc:
        return None, f"heartbeat unreadable: {exc}"
    now, now_mono = time.time(), time.monotonic()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return None, f"heartbeat {path} is not JSON: {exc}"
    if not isinstance(data, dict) or data.get("format") != layout.FORMAT:
        return None, f"heartbeat {path} has an unknown format ({data.get('format') if isinstance(data, dict) else '?'})"
    if data.get("pid") != pid:
        return None, f"heartbeat {path} names PID {data.get('pid')}, not {pid}"
    if create_time is not None:
        started = data.get("started_at")
        if not isinstance(started, (int, float)) or not (
                START_SLACK[0] <= started - create_time <= START_SLACK[1]):
            return None, f"heartbeat {path} is from an earlier process with PID {pid}"
    return Heartbeat(pid, data, now, path, now_mono), None


def find(pid: int, create_time: float | None = None) -> tuple[Heartbeat | None, str | None]:
    """Look in every candidate dir; the first heartbeat that is this process's wins."""
    problems = []
    for directory in candidate_dirs(pid):
        hb, problem = read(pid, create_time, directory)
        if hb is not None:
            return hb, None
        problems.append(problem or "?")
    return None, "; ".join(dict.fromkeys(problems))


def _gone(pid: int) -> bool:
    """No such process, or one that has exited and waits to be reaped (it runs no handler)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def request_stacks(hb: Heartbeat, identity: ProcessIdentity, timeout: float = DUMP_TIMEOUT) -> StackDump:
    """Ask the shim for a dump of every thread and return it (faulthandler's format).

    First its dump thread, which dumps under the GIL (``mlxwatch.shim.dumps``: the stack signal's
    dump, taken without the GIL, can crash a busy server). It answers in milliseconds unless a
    native call holds the GIL. The stack signal is sent only on evidence of that: no answer and
    no heartbeat published for ``ANSWER_QUIET`` (no Python thread ran), when faulthandler's dump
    is safe. While heartbeats still come the thread is only slow to get the GIL: it is waited for
    up to ``ANSWER_LIMIT``, and never signalled; nor is a stopped process. Only the process the
    heartbeat belongs to is asked (``identity``, proven again right before by its kernel start,
    which no clock step moves), and the signal is sent only when the heartbeat names it: a
    process without the shim would be killed by it. Raises ShimError when no dump came (the
    signal's within ``timeout``)."""
    if identity.pid != hb.pid or not identity.alive():
        raise ShimError(f"PID {hb.pid} is " + ("gone" if _gone(hb.pid) else "another process now"))
    if hb.ask_path is not None or hb.dump_thread_down:
        text = _ask_dump_thread(hb, hb.ask_path, hb.answers_path, ANSWER_QUIET, ANSWER_LIMIT)
        if text is not None:
            return StackDump(text, "thread")
        if hb.stack_signal is None:
            raise ShimError(f"no Python thread ran for {ANSWER_QUIET:g}s (the GIL is held, or the process is "
                            "stopped) and the process offers no stack signal")
        if not identity.alive():
            raise ShimError(f"PID {hb.pid} is " + ("gone" if _gone(hb.pid) else "another process now"))
    if _stopped(hb.pid):
        raise ShimError(f"PID {hb.pid} is stopped: no stack dump while it is; the stack signal is not sent, as it "
                        "would be handled when the process resumes, with every thread running")
    return StackDump(_signal_dump(hb, timeout), "signal")


def _own_file(hb: Heartbeat, path: str) -> str:
    if os.path.dirname(os.path.abspath(path)) != os.path.dirname(os.path.abspath(hb.path)):
        raise ShimError(f"the heartbeat names a file outside its own dir: {path}")
    return path


def _ask_dump_thread(hb: Heartbeat, ask: str | None, answers: str | None, quiet: float, limit: float) -> str | None:
    """The dump thread's answer to a fresh token; None when no Python thread runs (no answer,
    and no heartbeat published for ``quiet``, counted from the last one): the signal's case.
    Raises ShimError when heartbeats come but no answer within ``limit``. A FIFO no thread
    reads, or none offered (``ask`` None: the thread is being started again), is asked again
    until then."""
    token = secrets.token_hex(8)
    asked = time.monotonic()
    ran = asked - min(hb.age, quiet)  # when the shim last published, as far as we know
    published = _published(hb.path)
    sent, pos, seen = False, 0, ""
    afd = -1
    try:
        while True:
            chunk = b""
            if not sent and ask is not None and answers is not None:
                if afd >= 0:
                    os.close(afd)
                afd, pos, seen = _open_answers(hb, answers), 0, ""
                if afd >= 0:
                    pos = os.fstat(afd).st_size
                    sent = _send_token(hb, ask, token)
            if sent:
                if os.fstat(afd).st_size < pos:  # emptied by the thread: read it again
                    pos, seen = 0, ""
                chunk = os.pread(afd, MAX_BYTES, pos)
                pos += len(chunk)
            if chunk:
                seen = (seen + chunk.decode("utf-8", "replace"))[-4 * MAX_BYTES:]
                text = _answer_in(seen, token)
                if text is not None:
                    return text
                continue
            now = time.monotonic()
            latest = _published(hb.path)
            if latest != published:
                published, ran = latest, now
            if now - ran > quiet and now - asked > ANSWER_FIRST:
                return None
            if now - asked > limit:
                raise ShimError(f"the shim's dump thread did not answer within {limit:g}s while the process ran "
                                "Python (heartbeats came); the stack signal is not sent, as its dump could crash "
                                "a busy process")
            time.sleep(0.002 if sent else 0.05)  # it answers in about 1 ms when it can run
    finally:
        if afd >= 0:
            os.close(afd)


def _open_answers(hb: Heartbeat, answers: str) -> int:
    """The answers file, read-only; -1 while it is missing (a cleaner removed it: the agent makes
    a new one within a heartbeat)."""
    try:
        return _open_own_regular(hb, answers)
    except FileNotFoundError:
        return -1


def _open_own_regular(hb: Heartbeat, path: str) -> int:
    """A file the heartbeat names, read-only: in its own dir, regular, not a link. Raises
    ShimError, or FileNotFoundError when it is missing."""
    try:
        return dumps.open_regular(_own_file(hb, path), os.O_RDONLY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ShimError(f"the shim's file {path}: {exc.strerror or exc}") from None


def _send_token(hb: Heartbeat, ask: str, token: str) -> bool:
    """Write the token to the FIFO; False while no thread reads it or its pipe is full."""
    try:
        qfd = os.open(_own_file(hb, ask), os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENOENT):  # no thread reads it, or it is being made again
            return False
        raise ShimError(f"the shim's FIFO {ask}: {exc.strerror or exc}") from None
    try:
        if not stat.S_ISFIFO(os.fstat(qfd).st_mode):
            raise ShimError(f"{ask} is not a FIFO")
        os.write(qfd, f"\n{token}\n".encode())  # the first newline ends a partial line someone left
        return True
    except BlockingIOError:  # its pipe is full: the thread has not read for a while
        return False
    finally:
        os.close(qfd)


def _answer_in(seen: str, token: str) -> str | None:
    """The dump under the header naming ``token``, if whole: its footer comes before any other
    header (a block cut by a full disk has none)."""
    for m in _HEADER.finditer(seen):
        if token not in m.group(1).split():
            continue
        footer = _FOOTER.search(seen, m.end())
        following = _HEADER.search(seen, m.end())
        if footer is not None and (following is None or footer.start() < following.start()):
            return seen[m.end():footer.start()]
        return None
    return None


def _stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def _published(path: str) -> tuple[int, int] | None:
    """Which heartbeat is on disk: each one replaces the file (a new inode, a new mtime)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _signal_dump(hb: Heartbeat, timeout: float) -> str:
    """Send the stack signal and return what faulthandler appends to the stacks file. Captures
    that ask at the same time take turns (a lock on the stacks file)."""
    signum, path = hb.stack_signal, hb.stacks_file
    if signum is None or path is None:
        raise ShimError("the shim offers no stack signal in this process")
    fd = _open_own_regular(hb, path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start = os.fstat(fd).st_size
        try:
            os.kill(hb.pid, signum)
        except ProcessLookupError:
            raise ShimError(f"PID {hb.pid} is gone") from None
        except PermissionError as exc:
            raise ShimError(f"cannot signal PID {hb.pid}: {exc.strerror}") from None
        deadline = time.monotonic() + timeout
        size, changed = start, time.monotonic()
        while True:
            now = time.monotonic()
            current = os.fstat(fd).st_size
            if current != size:
                size, changed = current, now
            elif size > start and now - changed >= DUMP_SETTLE:
                break
            if now > deadline:
                if size > start:
                    break
                raise ShimError(f"no stack dump within {timeout:g}s (is the process stopped?)")
            time.sleep(0.02)
        os.lseek(fd, start, os.SEEK_SET)
        data = b""
        while len(data) < size - start:
            chunk = os.read(fd, min(MAX_BYTES, size - start - len(data)))
            if not chunk:
                break
            data += chunk
        return data.decode("utf-8", "replace")
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise
        os.close(fd)


@dataclass(frozen=True)
class Change:
    """What the heartbeat moved between two readings of the same process."""

    seconds: float
    steps: int
    tokens: int
    prompt_tokens: int

    @classmethod
    def between(cls, before: Heartbeat, after: Heartbeat) -> "Change":
        return cls(max(0.0, after.published_at - before.published_at), after.steps - before.steps,
                   after.tokens - before.tokens, after.prompt_tokens - before.prompt_tokens)

