"""The shim inside the server process: stacks on demand and a delivery heartbeat. Stdlib only.

Started by ``boot/sitecustomize.py`` before the server's own code runs (``start``). It

- answers stack dump requests on a FIFO from a thread of its own, under the GIL (``dumps``:
  the safe way, asked first), and registers ``faulthandler`` on ``SIGUSR2`` for all threads,
  writing into ``<pid>.stacks`` in the runtime dir (``layout``): the way that works while a
  native call holds the GIL, asked only on evidence that no Python thread runs (see
  ``mlxwatch.shim.heartbeat.request_stacks``). mlx-lm, mlx and
  ``http.server`` install no handler for the signal (checked in mlx-lm 0.31.3 and 0.32.2); if
  it already has a handler, or one is installed later, the heartbeat's ``stacks.signal`` is
  null and mlxwatch never sends it. ``faulthandler.enable`` (fatal signals)
  goes to ``<pid>.fatal`` unless faulthandler is already enabled (``-X faulthandler``): then
  it is left alone;
- counts, at the seam the server's batch loop calls once per step (``BatchGenerator.next``,
  patched in place on the class ``mlx_lm.server`` uses), the steps taken, the tokens emitted
  (generation responses), prompt progress, and the requests in flight (uids inserted with
  ``insert_segments``/``insert`` and not yet finished or removed); ``stream_generate`` as
  ``mlx_lm.server`` uses it for requests it serves one at a time (a seed, images, a draft
  model) is counted too. The wrappers only read what passes through (uids, ``finish_reason``,
  ``progress``) and return the server's own objects unchanged;
- publishes these about once a second (``layout.INTERVAL``) from a daemon thread to
  ``<pid>.json`` by atomic replace. A heartbeat that stops being replaced is evidence in itself
  (the GIL is held, or the process is stopped);
- records the generation thread's death with its traceback: ``ResponseGenerator._generate`` is
  wrapped (0.32 catches the exception in ``_run_generate`` and logs it; 0.31 lets it reach
  ``threading.excepthook``, which is chained too). With ``--exit-on-thread-death`` the process
  then exits with status 70 once the heartbeat holding the traceback is written and the
  server has logged its own traceback, so launchd's KeepAlive starts a fresh server;
- with ``--record`` (``layout.RECORD_ENV``), records each request the server's HTTP handler
  receives, exact body and what came back, into a bounded spool on disk (``recorder``,
  ``spool``); the heartbeat's ``record`` says it is on and what is in flight.

Version tolerance: if ``BatchGenerator`` or its ``next`` is missing, or ``next`` stops returning
``(prompt_responses, generation_responses)``, the shim writes one line to stderr (the server's
log), publishes ``seam.state`` ``unavailable`` or ``changed`` and stops counting; the server
runs unmodified and stacks on demand still work.

Patching in place (not by replacing the class) makes the order of imports irrelevant: whether
``mlx_lm.server`` is imported before the shim starts (the lab's fault injection does that),
imported later (the console script, ``mlx_lm server``), or run as ``__main__`` (``python -m
mlx_lm.server``: there the class comes from ``mlx_lm.generate``, patched when it is imported),
the server's calls go through the counting wrapper. A subclass whose ``next`` calls the base's
is counted once (a per-thread re-entry guard).
"""

from __future__ import annotations

import faulthandler
import functools
import io
import json
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from typing import Any

from . import layout
from .dumps import Dumper, open_regular
from .recorder import RequestRecorder, patch_handler
from .spool import SpoolWriter

MAX_TRACEBACK = 20000  # characters of a traceback kept in the heartbeat (the end)
GENERATE_MODULE, SERVER_MODULE = "mlx_lm.generate", "mlx_lm.server"
_CO_GENERATOR = 0x20
_MARK = "__mlxwatch_shim__"

_agent: "Agent | None" = None


def _say(message: str) -> None:
    """One line in the server's log (its stderr)."""
    try:
        sys.stderr.write(f"mlxwatch shim: {message}\n")
        sys.stderr.flush()
    except Exception:
        pass


def _exception_record(exc: BaseException) -> dict:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"type": type(exc).__name__, "message": str(exc)[:2000], "traceback": text[-MAX_TRACEBACK:],
            "at": time.time()}


class Agent:
    """All the shim's state in one process. Counters are written by the server's generation
    thread only and read by the publisher: plain attribute reads, no lock on the hot path."""

    def __init__(self, started_at: float, name: str | None, exit_on_thread_death: bool, directory: str) -> None:
        self.pid = os.getpid()
        self.started_at = started_at
        self.name = name
        self.exit_on_thread_death = exit_on_thread_death
        self.directory = directory
        self.dir_problem: str | None = None
        self.seq = 0
        self.wake = threading.Event()
        self.said: set[str] = set()
        # the seam
        self.seam_state = "waiting"  # waiting (mlx_lm not imported yet) | ok | unavailable | changed
        self.seam_detail = "mlx_lm is not imported yet"
        self.seam_where: list[str] = []
        self.counting = True
        self.guard = threading.local()
        # the batch loop
        self.steps = 0
        self.last_step_at: float | None = None
        self.in_step_since: float | None = None
        self.tokens = 0
        self.last_token_at: float | None = None
        self.prompt_advances = 0  # prompt responses whose processed count grew
        self.prompt_tokens = 0  # prompt tokens processed (sum of the growth)
        self.last_progress_at: float | None = None  # last token or prompt advance
        self.uids: dict = {}  # uid -> [inserted_at, last_event_at, processed, tokens]
        self.busy_since: float | None = None  # requests in flight without a break since
        self.finished = 0
        self.removed = 0
        self.single_active = 0  # requests served one at a time (stream_generate) in progress
        self.last_step_exception: dict | None = None
        self.rate: deque = deque(maxlen=11)  # (time, tokens) per heartbeat: tokens/s over ~10 s
        # the generation thread
        self.gen_thread: threading.Thread | None = None
        self.responder: weakref.ref[Any] | None = None  # weakref to the ResponseGenerator, when found
        self.death: dict | None = None  # its exception, when it raised one
        self.gen_ended_at: float | None = None
        self.gen_end: str | None = None  # "died" | "stopped"
        # stacks
        self.stack_signum: int | None = None
        self.stacks_file: io.FileIO | None = None
        self.stacks_ino: int | None = None
        self.fatal_file: io.FileIO | None = None
        self.dumper: Dumper | None = None
        self.dumps_wanted = False  # the platform has FIFOs: a dump thread is kept running
        # the requests the server's handler receives (launch --record), else None
        self.recorder: RequestRecorder | None = None

    # --- files

    def path(self, kind: str) -> str:
        return {"json": layout.heartbeat_path, "stacks": layout.stacks_path, "fatal": layout.fatal_path,
                "ask": layout.ask_path, "answers": layout.answers_path}[kind](self.directory, self.pid)

    def prepare_dir(self) -> bool:
        problem = layout.ensure_private_dir(self.directory)
        if problem and problem != self.dir_problem:
            _say(f"runtime dir refused: {problem}; no heartbeat and no stacks on demand")
        self.dir_problem = problem
        return problem is None

    def open_stacks(self) -> None:
        """(Re)open ``<pid>.stacks`` and register faulthandler on it for the stack signal."""
        signum = getattr(signal, layout.STACK_SIGNAL, None)
        if signum is None or not hasattr(faulthandler, "register"):
            self.note_once(f"no {layout.STACK_SIGNAL} on this platform: stacks only from the dump thread")
            return
        if signal.getsignal(signum) not in (signal.SIG_DFL, None):
            self.note_once(f"{layout.STACK_SIGNAL} already has a handler: stacks only from the dump thread "
                           "(none while the GIL is held)")
            return
        fh = os.fdopen(open_regular(self.path("stacks"), os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab", buffering=0)
        os.fchmod(fh.fileno(), 0o600)
        faulthandler.register(signum, file=fh, all_threads=True, chain=False)
        old, self.stacks_file = self.stacks_file, fh
        self.stacks_ino = os.fstat(fh.fileno()).st_ino
        self.stack_signum = signum
        if old is not None:
            old.close()

    def open_dumper(self) -> None:
        """(Re)open the dump thread's FIFO and answers file; a dumper they replace ends."""
        if not hasattr(os, "mkfifo") or not hasattr(sys, "_current_frames"):
            self.note_once("no FIFO or no sys._current_frames here: stacks only by the signal")
            return
        self.dumps_wanted = True
        fresh = Dumper(self.path("ask"), self.path("answers"), first=self.gen_thread_ident)
        try:
            fresh.open()
            dumper: Dumper | None = fresh
        except OSError as exc:  # tried again every heartbeat; meanwhile none is offered
            self.note_once(f"no dump thread ({exc}); trying again each second")
            dumper = None
        old, self.dumper = self.dumper, dumper
        if old is not None:
            old.retire()

    def check_dumper(self) -> None:
        """Its files may be removed under us (a /tmp cleaner), its thread may end (a full disk):
        open a new one then."""
        if self.dumps_wanted and (self.dumper is None or not self.dumper.serving()):
            self.open_dumper()

    def gen_thread_ident(self) -> int | None:
        thread = self.gen_thread
        return thread.ident if thread is not None else None

    def check_stacks_file(self) -> None:
        """The file may be removed under us (a /tmp cleaner): open a new one then."""
        if self.stack_signum is None:
            return
        if signal.getsignal(self.stack_signum) not in (signal.SIG_DFL, None):  # someone took the signal
            self.note_once(f"{layout.STACK_SIGNAL} was given another handler: stacks only from the dump thread "
                           "(none while the GIL is held)")
            self.stack_signum = None
            return
        try:
            same = os.stat(self.path("stacks")).st_ino == self.stacks_ino
        except OSError:
            same = False
        if not same:
            self.open_stacks()

    def enable_fatal(self) -> None:
        if faulthandler.is_enabled():  # the server asked for it (-X faulthandler): leave its choice
            return
        fh = os.fdopen(open_regular(self.path("fatal"), os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab", buffering=0)
        os.fchmod(fh.fileno(), 0o600)
        faulthandler.enable(file=fh, all_threads=True)
        self.fatal_file = fh

    def note_once(self, message: str) -> None:
        if message not in self.said:
            self.said.add(message)
            _say(message)

    # --- the seam: called from the server's generation thread

    def step_begin(self) -> bool:
        """True when this call is the outermost ``next`` on this thread (it is counted)."""
        if getattr(self.guard, "depth", 0):
            self.guard.depth += 1
            return False
        self.guard.depth = 1
        self.in_step_since = time.time()
        if self.gen_thread is None:
            self.found_generation_thread(None)
        return True

    def step_end(self, counted: bool, result, exc: BaseException | None = None) -> None:
        self.guard.depth -= 1
        if not counted:
            return
        now = time.time()
        self.in_step_since = None
        if exc is not None:
            self.last_step_exception = _exception_record(exc)
            return
        self.steps += 1
        self.last_step_at = now
        if not self.counting:
            return
        try:
            self._account(result, now)
        except Exception as err:  # a shape we do not know: stop counting, never disturb the server
            self.shape_changed(f"cannot read what BatchGenerator.next returned ({type(err).__name__}: {err})")

    def _account(self, result, now: float) -> None:
        if not (isinstance(result, tuple) and len(result) == 2):
            self.shape_changed(f"BatchGenerator.next returned {type(result).__name__}, "
                               "not (prompt_responses, generation_responses)")
            return
        prompt_responses, gen_responses = result
        uids = self.uids
        progressed = False
        for r in prompt_responses:
            progress = r.progress
            processed = progress[0] if isinstance(progress, (tuple, list)) and progress else None
            entry = uids.get(r.uid)
            if entry is None:
                entry = uids[r.uid] = [now, now, 0, 0]
                self._busy(now)
            if isinstance(processed, int) and processed > entry[2]:
                self.prompt_tokens += processed - entry[2]
                self.prompt_advances += 1
                entry[2], entry[1] = processed, now
                progressed = True
        n = 0
        for r in gen_responses:
            n += 1
            entry = uids.get(r.uid)
            if entry is not None:
                entry[1] = now
                entry[3] += 1
            if r.finish_reason is not None and uids.pop(r.uid, None) is not None:
                self.finished += 1
        if n:
            self.tokens += n
            self.last_token_at = now
            progressed = True
        if progressed:
            self.last_progress_at = now
        self._idle_check()

    def shape_changed(self, detail: str) -> None:
        self.counting = False
        self.seam_state, self.seam_detail = "changed", detail
        self.note_once(f"{detail}: the heartbeat stops counting (the server runs unchanged; stacks on demand still work)")
        self.wake.set()

    def _busy(self, now: float) -> None:
        if self.busy_since is None:
            self.busy_since = now

    def _idle_check(self) -> None:
        if not self.uids and not self.single_active:
            self.busy_since = None

    def inserted(self, uids) -> None:
        if not self.counting:
            return
        try:
            now = time.time()
            for uid in uids:
                if uid not in self.uids:
                    self.uids[uid] = [now, now, 0, 0]
                    self._busy(now)
        except Exception as err:
            self.shape_changed(f"cannot read the uids BatchGenerator.insert returned ({type(err).__name__}: {err})")

    def dropped(self, uids) -> None:
        if not self.counting:
            return
        try:
            for uid in list(uids):
                if self.uids.pop(uid, None) is not None:
                    self.removed += 1
            self._idle_check()
        except Exception as err:
            self.shape_changed(f"cannot read the uids given to BatchGenerator.remove ({type(err).__name__}: {err})")

    def closed(self) -> None:
        self.removed += len(self.uids)
        self.uids.clear()
        self._idle_check()

    def single_begin(self) -> None:
        self.single_active += 1
        self._busy(time.time())
        if self.gen_thread is None:
            self.found_generation_thread(None)

    def single_token(self) -> None:
        now = time.time()
        self.tokens += 1
        self.last_token_at = self.last_progress_at = now

    def single_end(self) -> None:
        self.single_active = max(0, self.single_active - 1)
        self._idle_check()

    def found_generation_thread(self, responder) -> None:
        self.gen_thread = threading.current_thread()
        if responder is None:  # called from the seam: the ResponseGenerator is up the stack
            responder = _find_responder()
        if responder is not None:
            try:
                self.responder = weakref.ref(responder)
            except TypeError:
                self.responder = None
        self.wake.set()

    def generation_raised(self, exc: BaseException) -> None:
        if threading.current_thread() is self.gen_thread and self.death is None:
            self.death = _exception_record(exc)
            self.wake.set()

    def excepthook_saw(self, args) -> None:
        if args.thread is not None and args.thread is self.gen_thread and self.death is None \
                and args.exc_value is not None:
            self.death = _exception_record(args.exc_value)
        self.wake.set()

    # --- the publisher thread

    def run(self) -> None:
        while True:
            self.wake.wait(layout.INTERVAL)
            self.wake.clear()
            try:
                self.tick()
            except Exception as exc:  # never let the publisher die silently
                self.note_once(f"heartbeat error: {type(exc).__name__}: {exc}")

    def tick(self) -> None:
        if self.seam_state == "waiting":
            _late_patch(self)
        if self.recorder is not None:
            if self.recorder.state == "waiting":
                _late_patch_handler(self)
            self.recorder.expire()
        self.check_thread()
        if self.dir_problem and not self.prepare_dir():
            return
        self.check_stacks_file()
        self.check_dumper()
        try:
            self.publish()
        except FileNotFoundError:  # the runtime dir was removed: make it again next time
            self.dir_problem = f"{self.directory} disappeared"
            return
        if self.gen_end == "died" and self.exit_on_thread_death:
            self.exit_for_thread_death()

    def check_thread(self) -> None:
        thread = self.gen_thread
        if thread is None or self.gen_ended_at is not None or thread.is_alive():
            return
        self.gen_ended_at = time.time()
        responder = self.responder() if self.responder is not None else None
        stopping = responder is not None and getattr(responder, "_stop", False) is True
        failed = responder is not None and getattr(responder, "_generation_failed", False) is True
        self.gen_end = "died" if (self.death is not None or failed or not stopping) else "stopped"
        last = self.last_step_exception
        if self.gen_end == "died" and self.death is None and last is not None and self.gen_ended_at - last["at"] < 10:
            # no wrapper saw it leave the thread (python -m mlx_lm.server): the seam saw it raised
            self.death = dict(last, where="raised in BatchGenerator.next")

    def snapshot(self) -> dict:
        now = time.time()
        uids = list(self.uids.values())
        in_flight = len(uids) + self.single_active
        self.rate.append((now, self.tokens))
        t0, n0 = self.rate[0]
        rate = (self.tokens - n0) / (now - t0) if now - t0 >= 1.0 else None
        quiet_since = max(self.last_progress_at or 0.0, self.busy_since or 0.0) if in_flight else None
        thread = self.gen_thread
        responder = self.responder() if self.responder is not None else None
        queue = getattr(responder, "requests", None)
        try:
            queued = queue.qsize() if queue is not None else None
        except Exception:
            queued = None
        mlx_lm = sys.modules.get("mlx_lm")
        # offered only while it answers; null (not absent) tells a reader the thread is down
        dumper = self.dumper if self.dumper is not None and self.dumper.serving() else None
        return {
            "format": layout.FORMAT,
            "pid": self.pid,
            "started_at": self.started_at,
            "published_at": now,
            "published_mono": time.monotonic(),  # the reader times the heartbeat's age on it (not the wall clock)
            "seq": self.seq,
            "interval": layout.INTERVAL,
            "name": self.name,
            "argv": list(getattr(sys, "orig_argv", sys.argv)),
            "python": sys.executable,
            "python_version": sys.version.split()[0],
            "mlx_lm": getattr(mlx_lm, "__version__", None),
            "seam": {"state": self.seam_state, "detail": self.seam_detail, "where": self.seam_where},
            "exit_on_thread_death": self.exit_on_thread_death,
            "loop": {
                "steps": self.steps,
                "last_step_at": self.last_step_at,
                "in_step_since": self.in_step_since,
                "tokens": self.tokens,
                "last_token_at": self.last_token_at,
                "prompt_advances": self.prompt_advances,
                "prompt_tokens": self.prompt_tokens,
                "last_progress_at": self.last_progress_at,
                "in_flight": in_flight,
                "single_active": self.single_active,
                "queued": queued,
                "busy_since": self.busy_since if in_flight else None,
                "quiet_since": quiet_since,
                "stalled_for": round(now - quiet_since, 3) if quiet_since else 0.0,
                "oldest_silence": round(max((now - e[1] for e in uids), default=0.0), 3),
                "finished": self.finished,
                "removed": self.removed,
                "tokens_per_s": round(rate, 3) if rate is not None else None,
                "last_step_exception": self.last_step_exception,
            },
            "generation_thread": None if thread is None else {
                "ident": thread.ident,
                "native_id": getattr(thread, "native_id", None),
                "name": thread.name,
                "alive": self.gen_ended_at is None,
                "ended_at": self.gen_ended_at,
                "end": self.gen_end,
                "exception": self.death,
                "responder_found": responder is not None,
            },
            "threads": {str(t.ident): {"name": t.name, "native_id": getattr(t, "native_id", None)}
                        for t in threading.enumerate() if t.ident is not None},
            "stacks": None if self.stack_signum is None and dumper is None else {
                "signal": layout.STACK_SIGNAL if self.stack_signum is not None else None,
                "signum": int(self.stack_signum) if self.stack_signum is not None else None,
                "file": self.path("stacks") if self.stack_signum is not None else None,
                "ask": dumper.ask_path if dumper is not None else None,
                "answers": dumper.answers_path if dumper is not None else None},
            "fatal_file": self.path("fatal") if self.fatal_file is not None else None,
            "record": self.recorder.snapshot() if self.recorder is not None else None,
        }

    def publish(self) -> None:
        data = json.dumps(self.snapshot(), default=str).encode()
        final = self.path("json")
        tmp = os.path.join(self.directory, f".{self.pid}.json.tmp")
        try:
            os.unlink(tmp)  # whatever is there (a FIFO would block the open): ours is made new
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        self.seq += 1

    def exit_for_thread_death(self) -> None:
        what = f"{self.death['type']}: {self.death['message']}" if self.death else "no exception recorded"
        _say(f"the generation thread died ({what}); exiting with status {layout.THREAD_DEATH_EXIT} "
             "(--exit-on-thread-death)")
        try:
            if "logging" in sys.modules:
                sys.modules["logging"].shutdown()  # flush the server's own log handlers
            for stream in (sys.stdout, sys.stderr):
                if stream is not None:
                    stream.flush()
        finally:
            os._exit(layout.THREAD_DEATH_EXIT)


def _find_responder():
    """The ``self`` of the ``_generate`` frame up the current stack (the ResponseGenerator)."""
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            return None
        if frame.f_code.co_name == "_generate" and "self" in frame.f_locals:
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


# --- patching


def _wrap_next(agent: Agent, original):
    @functools.wraps(original)
    def next(self, *args, **kwargs):  # the seam's own name
        counted = agent.step_begin()
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            agent.step_end(counted, None, exc)
            raise
        agent.step_end(counted, result)
        return result

    setattr(next, _MARK, True)
    return next


def _wrap_insert(agent: Agent, original):
    @functools.wraps(original)
    def insert(self, *args, **kwargs):
        uids = original(self, *args, **kwargs)
        agent.inserted(uids if uids is not None else ())
        return uids

    setattr(insert, _MARK, True)
    return insert


def _wrap_remove(agent: Agent, original):
    @functools.wraps(original)
    def remove(self, uids, *args, **kwargs):
        result = original(self, uids, *args, **kwargs)
        agent.dropped(uids)
        return result

    setattr(remove, _MARK, True)
    return remove


def _wrap_close(agent: Agent, original):
    @functools.wraps(original)
    def close(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        agent.closed()
        return result

    setattr(close, _MARK, True)
    return close


def _wrap_stream_generate(agent: Agent, original):
    @functools.wraps(original)
    def stream_generate(*args, **kwargs):
        inner = original(*args, **kwargs)
        agent.single_begin()
        try:
            for response in inner:
                agent.single_token()
                yield response
        finally:
            agent.single_end()
            inner.close()

    setattr(stream_generate, _MARK, True)
    return stream_generate


def _wrap_generate(agent: Agent, original):
    @functools.wraps(original)  # keeps __name__: the thread is still "Thread-1 (_generate)"
    def _generate(self, *args, **kwargs):
        agent.found_generation_thread(self)
        try:
            return original(self, *args, **kwargs)
        except BaseException as exc:
            agent.generation_raised(exc)
            raise

    setattr(_generate, _MARK, True)
    return _generate


def _patch_method(cls, name: str, wrap) -> bool:
    current = getattr(cls, name, None)
    if not callable(current):
        return False
    if getattr(current, _MARK, False):
        return True  # done already, on this class or on the base it inherits from
    setattr(cls, name, wrap(current))
    return True


def patch_batch_generator(agent: Agent, cls, where: str) -> bool:
    """Count at ``cls.next`` (and track uids); False when the seam is not there."""
    if not isinstance(cls, type):
        return False
    if not callable(getattr(cls, "next", None)):
        return False
    _patch_method(cls, "next", lambda f: _wrap_next(agent, f))
    tracked = [n for n in ("insert_segments", "insert") if _patch_method(cls, n, lambda f: _wrap_insert(agent, f))]
    _patch_method(cls, "remove", lambda f: _wrap_remove(agent, f))
    _patch_method(cls, "close", lambda f: _wrap_close(agent, f))
    if f"{where}.next" not in agent.seam_where:
        agent.seam_where.append(f"{where}.next")
    if not tracked:
        agent.note_once(f"{where} has no insert/insert_segments: requests in flight are not counted")
    return True


def patch_module(agent: Agent, module) -> None:
    """Patch what ``module`` (mlx_lm.generate, mlx_lm.server) offers of the seam."""
    name = getattr(module, "__name__", "?")
    try:
        found = patch_batch_generator(agent, getattr(module, "BatchGenerator", None), f"{name}.BatchGenerator")
        stream = getattr(module, "stream_generate", None)
        if callable(stream) and not getattr(stream, _MARK, False) \
                and getattr(getattr(stream, "__code__", None), "co_flags", 0) & _CO_GENERATOR:
            module.stream_generate = _wrap_stream_generate(agent, stream)
        responder = getattr(module, "ResponseGenerator", None)
        if isinstance(responder, type):
            _patch_method(responder, "_generate", lambda f: _wrap_generate(agent, f))
        _patch_handler(agent, module, name)
    except Exception as exc:  # never break the server's import
        agent.seam_state, agent.seam_detail = "unavailable", f"patching {name} failed: {type(exc).__name__}: {exc}"
        agent.counting = False
        agent.note_once(f"{agent.seam_detail}; heartbeat unavailable (the server runs unchanged)")
        return
    if found:
        if agent.seam_state in ("waiting", "unavailable"):
            agent.seam_state, agent.seam_detail = "ok", ""
    elif agent.seam_state == "waiting" and name == SERVER_MODULE:
        # The server module is the last word: no BatchGenerator here means no seam.
        version = getattr(sys.modules.get("mlx_lm"), "__version__", "?")
        agent.seam_state = "unavailable"
        agent.seam_detail = f"mlx_lm.server (mlx-lm {version}) has no BatchGenerator.next"
        agent.counting = False
        agent.note_once(f"{agent.seam_detail}: heartbeat unavailable; the server runs unmodified "
                        "and stacks on demand still work")
    agent.wake.set()


def _late_patch(agent: Agent) -> None:
    """The publisher's fallback when no import hook saw the modules load."""
    for name in (GENERATE_MODULE, SERVER_MODULE):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__mlxwatch_shim_patched__", False) is False:
            _mark_patched(module)
            patch_module(agent, module)


def _patch_handler(agent: Agent, module, name: str) -> None:
    """The server's HTTP handler, wrapped to record requests (launch --record only)."""
    rec = agent.recorder
    if rec is None or not rec.on or name == GENERATE_MODULE:
        return
    try:
        if not patch_handler(rec, getattr(module, "APIHandler", None), f"{name}.APIHandler") and rec.state == "waiting":
            rec.detail = f"{name} has no APIHandler (an http.server handler): no requests recorded"
            agent.note_once(rec.detail)
    except Exception as exc:  # the recorder's failure, never the server's
        rec.failed(exc)


def _late_patch_handler(agent: Agent) -> None:
    """``python -m mlx_lm.server`` defines its handler in ``__main__``, which no import hook
    sees: looked for there (and in a server module the hooks missed) once a heartbeat."""
    for name in (SERVER_MODULE, "__main__"):
        module = sys.modules.get(name)
        if module is None or (name == "__main__" and
                              getattr(getattr(module, "__spec__", None), "name", None) != SERVER_MODULE):
            continue
        if getattr(module, "APIHandler", None) is not None:
            _patch_handler(agent, module, name)


def _mark_patched(module) -> None:
    try:
        module.__mlxwatch_shim_patched__ = True
    except Exception:
        pass


def _patch_after_exec(loader, agent: Agent) -> bool:
    """Make this loader object (a fresh one per find_spec) patch its module once it has run.
    An instance attribute shadows the method: the loader keeps its type and every other method
    (runpy's get_code for ``python -m``, get_source for tracebacks, resource readers)."""
    original = getattr(loader, "exec_module", None)
    if original is None:
        return False

    def exec_module(module) -> None:
        original(module)
        _mark_patched(module)
        patch_module(agent, module)

    try:
        loader.exec_module = exec_module
    except (AttributeError, TypeError):
        return False  # the publisher's late patch still finds the module within a second
    return True


class _PostImportFinder:
    """On sys.meta_path: asks the other finders for ``mlx_lm.generate`` and ``mlx_lm.server``
    and has the loader they return patch the module after it ran (wrapt's post-import hook idea)."""

    names = (GENERATE_MODULE, SERVER_MODULE)

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            _patch_after_exec(spec.loader, self.agent)
        return spec


def _chain_excepthook(agent: Agent) -> None:
    previous = threading.excepthook

    def excepthook(args):
        try:
            previous(args)  # the server's traceback goes where it always went, first
        finally:
            agent.excepthook_saw(args)

    threading.excepthook = excepthook


def _start_recorder(agent: Agent, setting: str | None, dir_ready: bool) -> None:
    bounds = layout.parse_record_setting(setting)
    if bounds is None:
        _say(f"{layout.RECORD_ENV}={setting!r} is not MAX_AGE_SECONDS:MAX_BYTES: no requests recorded")
        return
    if not dir_ready:
        _say("no requests recorded: the runtime dir is refused (above)")
        return
    try:
        spool = SpoolWriter(agent.directory, agent.pid, *bounds)
        spool.remove_stale()
        agent.recorder = RequestRecorder(spool, agent.note_once)
    except Exception as exc:
        _say(f"no requests recorded: {type(exc).__name__}: {exc}")


def start(started_at: float | None = None, env=None) -> Agent | None:
    """Start the shim in this process (once). Never raises: a shim that cannot start says so
    on stderr and the server runs as if it were not there."""
    global _agent
    if _agent is not None:
        return _agent
    env = os.environ if env is None else env
    try:
        agent = Agent(started_at or time.time(), env.get(layout.NAME_ENV) or None,
                      env.get(layout.EXIT_ENV) == "1", layout.runtime_dir(env))
        _agent = agent
        ready = agent.prepare_dir()
        if env.get(layout.RECORD_ENV):
            _start_recorder(agent, env.get(layout.RECORD_ENV), ready)
        if ready:
            agent.open_dumper()
            try:
                agent.open_stacks()
                agent.enable_fatal()
            except OSError as exc:
                _say(f"stacks on demand by signal unavailable: {exc}")
        _chain_excepthook(agent)
        already = [sys.modules[n] for n in (GENERATE_MODULE, SERVER_MODULE) if n in sys.modules]
        sys.meta_path.insert(0, _PostImportFinder(agent))
        for module in already:  # imported before us (a sitecustomize earlier in the chain)
            _mark_patched(module)
            patch_module(agent, module)
        thread = threading.Thread(target=agent.run, name="mlxwatch-shim", daemon=True)
        thread.start()
        return agent
    except Exception as exc:
        _say(f"not started: {type(exc).__name__}: {exc}")
        return None
