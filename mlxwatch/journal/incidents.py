"""The incident journal: ``<state_dir>/incidents.jsonl``, append-only, one fsynced line per change.

Each record carries the incident's fields so far, so the last record of an incident is its
whole story: instance, incident id, first_failure_at, detected_at, kind, bundle, restart
method and result, recovered_at, seconds_to_recovery. An incident whose last record is not a
closing event is open: either a daemon is working on it, or a daemon stopped mid-incident
(``interrupted`` when it stopped cleanly; nothing when it was killed). The next start closes
each such incident with a ``closed`` record saying where it stopped, and ``mlxwatch status``
says which of the two it is.

Segments. ``incidents.jsonl`` is the live segment. Before an append finds it at
``SEGMENT_BYTES`` (1 MiB, about 200 incidents) or more, it is renamed to the next
``incidents-NNNNNN.jsonl`` (numbered from 1, oldest first; never deleted by mlxwatch) and
``incidents.index.json`` is rewritten: a ``Summary`` of every closed segment, i.e. what those
records still decide about the present (each instance's last incident record, the last record
of each incident still open, each instance's restart times and gave-up time). So ``status``,
a daemon start and the state rebuild read the index plus the live segment: bounded bytes,
however many months of incidents lie behind. A segment that no index covers yet (killed
between the rename and the index write; an index deleted or damaged) is folded in when read
and covered by the next index the daemon writes. ``records()`` is that bounded view; the whole
history is the segments in order, then the live one (``cat incidents-*.jsonl incidents.jsonl``).

A full disk. An append that fails part-way is cut back off the file (``append_record``), so
``incidents.jsonl`` stays whole JSON Lines (jq reads it); the record is kept in memory and
written first by the next append that can. Only a kill mid-write leaves a torn line, which
readers skip.

No file here is opened through a symbolic link: a link at the journal's name is refused
(``StateError``), appends use ``O_NOFOLLOW``.

Events are ``Event`` members, a ``str`` enum: a record on disk holds the same plain strings
as before (``"verdict"``), and a record read back compares equal to its member.

Writing off the event loop. ``Journal.start()`` (the daemon calls it) hands every append to one
writer thread, in order: ``record`` and ``note`` return at once and never wait on an fsync, the
records reach the disk in the order they were made, each fsynced as before, and ``stop()``
writes what is queued and ends the thread. Reads (``records``, ``summary``, ...) first wait
for the records this journal queued, so a journal reads its own writes. Without ``start`` (the
CLI, ``status``, tests) an append is written by the caller, at once.

Observers (``Journal.observers``, callables taking the record) are told of every ``record`` and
``note`` when it is made, on the caller's thread (the daemon's event loop) and in order, before
the writer thread has it on disk: the metrics follow incidents this way. An observer that raises
is logged and ignored; it never stops the journal or the watcher that wrote. Records written by
``close_left_open`` (incidents of an earlier daemon run) are not observed.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import stat
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable, Iterable

from mlxwatch.errors import StateError
from mlxwatch.storage import (
    append_record,
    fsync_dir,
    open_regular,
    private_dir,
    read_records,
    replace_atomically,
)

log = logging.getLogger("mlxwatch.watchdog")

JOURNAL_NAME = "incidents.jsonl"  # the live segment
INDEX_NAME = "incidents.index.json"
SEGMENT_BYTES = 1024 * 1024  # the live segment is rotated once it holds this much
MAX_INDEX_BYTES = 16 * 1024 * 1024  # an index is kilobytes; a bigger one is not ours and is ignored
MAX_RESTARTS_KEPT = 1000  # restart times per instance the index keeps (budgets look back one window)
INDEX_FORMAT = 1
_SEGMENT = re.compile(r"incidents-(\d{6,})\.jsonl")


class Event(StrEnum):
    """Every event the journal records (docs/journal.md lists them). A ``str``: on disk and in
    a record read back it is the plain string, so old journals and readers stay as they are."""

    # an incident's steps
    VERDICT = "verdict"
    CAPTURING = "capturing"
    CAPTURED = "captured"
    CAPTURE_FAILED = "capture_failed"
    AWAITING_RECOVERY = "awaiting_recovery"
    BACKOFF = "backoff"
    RESTARTING = "restarting"
    RESTART = "restart"
    RESTART_FAILED = "restart_failed"
    NOTHING_TO_RESTART = "nothing_to_restart"
    RECOVERING = "recovering"
    NOT_RECOVERED = "not_recovered"
    RECOVERED = "recovered"
    GAVE_UP = "gave_up"
    INTERRUPTED = "interrupted"
    CLOSED = "closed"
    # outside incidents
    DAEMON_START = "daemon_start"
    RESUMED = "resumed"
    SLOW = "slow"
    SLOW_ENDED = "slow_ended"
    SHIM_STALL = "shim_stall"
    WATCHER_ERROR = "watcher_error"
    WATCHER_STUCK = "watcher_stuck"
    CONFIG_RELOAD = "config_reload"
    MEMORY_LOW = "memory_low"
    MEMORY_RESTART = "memory_restart"
    MEMORY_HELD = "memory_held"
    # the front door (instances[].front)
    FRONT_STALL = "front_stall"
    GROUP_STALL = "group_stall"
    KERNEL_STALL = "kernel_stall"
    FRONT_REQUEST_STALLED = "front_request_stalled"
    FRONT_ERROR = "front_error"


CLOSING_EVENTS = (Event.RECOVERED, Event.GAVE_UP, Event.CLOSED)
RECORD_FIELDS = ("ts", "event")  # set by the journal itself, never copied from an older record
MAX_BACKLOG = 1000  # records kept in memory while the journal cannot be written
BACKLOG_RETRY = 5.0  # seconds between the writer thread's tries of a backlog when nothing new comes


@dataclass
class Incident:
    instance: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    first_failure_at: float | None = None
    detected_at: float | None = None
    failures: list[str] = field(default_factory=list)  # probe reasons that led to the verdict
    kind: str | None = None
    confidence: str | None = None
    cause: str | None = None  # crashed or dead_thread: why it died (capture.death.CAUSES)
    cause_summary: str | None = None  # ... as the OS recorded it, one line
    bundle: str | None = None
    pid: int | None = None  # the proven server process (None: none could be proven)
    stranger: str | None = None  # who held the port instead, if anyone: never acted on
    restart_method: str | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)  # {at, result, error}
    recovered_at: float | None = None
    seconds_to_recovery: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Summary:
    """What a run of journal records still decides about the present, folded record by record.

    ``latest`` and ``open`` hold ``(position, record)``: each instance's last incident record
    and the last record of each incident not closed, with the record's position in the whole
    journal, so the kept records can be replayed in their order. ``history`` is each instance's
    restart times and gave-up time, as the state rebuild needs them. Folding the same records
    twice changes nothing (a crash between a segment's rename and its index write is harmless)."""

    segments: list[str] = field(default_factory=list)  # the closed segments folded in, oldest first
    position: int = 0  # records folded so far
    latest: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    open: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    history: dict[str, dict[str, Any]] = field(default_factory=dict)

    def fold(self, records: Iterable[dict[str, Any]]) -> "Summary":
        for rec in records:
            self.position += 1
            name, incident_id = rec.get("instance"), rec.get("id")
            if isinstance(incident_id, str) and isinstance(name, str):
                self.latest[name] = (self.position, rec)
                if rec.get("event") in CLOSING_EVENTS:
                    self.open.pop(incident_id, None)
                else:
                    self.open[incident_id] = (self.position, rec)
            if isinstance(name, str):
                _fold_history(self.history.setdefault(name, {"restarts": [], "gave_up_at": None}), rec)
        return self

    def kept_records(self) -> list[dict[str, Any]]:
        """The records that still decide the present, in journal order."""
        kept = {pos: rec for pos, rec in (*self.latest.values(), *self.open.values())}
        return [kept[pos] for pos in sorted(kept)]

    def to_json(self) -> bytes:
        history = {name: {"restarts": sorted(h["restarts"])[-MAX_RESTARTS_KEPT:], "gave_up_at": h["gave_up_at"]}
                   for name, h in self.history.items()}
        return json.dumps({"format": INDEX_FORMAT, "segments": self.segments, "position": self.position,
                           "latest": self.latest, "open": self.open, "history": history},
                          sort_keys=True, default=str).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Summary":
        """Raises ValueError for anything that is not an index this module wrote."""
        try:
            raw = json.loads(data.decode("utf-8"))
            if raw.get("format") != INDEX_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}")
            summary = cls(segments=[str(n) for n in raw["segments"]], position=int(raw["position"]))
            for key in ("latest", "open"):
                getattr(summary, key).update({str(k): (int(pos), dict(rec)) for k, (pos, rec) in raw[key].items()})
            for name, h in raw["history"].items():
                summary.history[str(name)] = {"restarts": [float(t) for t in h["restarts"]],
                                              "gave_up_at": h["gave_up_at"]}
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a journal index ({type(exc).__name__}: {exc})") from None
        return summary


def _fold_history(inst: dict[str, Any], rec: dict[str, Any]) -> None:
    """Restart times (from the incident's ``restarts``) and the gave-up time of one instance."""
    restarts = rec.get("restarts")
    for restart in restarts if isinstance(restarts, list) else []:
        at = restart.get("at") if isinstance(restart, dict) else None
        if isinstance(at, (int, float)) and not isinstance(at, bool) and at not in inst["restarts"]:
            inst["restarts"].append(float(at))
    event = rec.get("event")
    if event == Event.GAVE_UP:
        inst["gave_up_at"] = rec.get("ts")
    elif event in (Event.RESUMED, Event.RECOVERED):
        inst["gave_up_at"] = None
        if event == Event.RESUMED:
            inst["restarts"] = []


def segment_paths(state_dir: Path) -> list[Path]:
    """The closed segments, oldest first."""
    found = []
    try:
        names = os.listdir(state_dir)
    except OSError:
        return []
    for name in names:
        m = _SEGMENT.fullmatch(name)
        if m:
            found.append((int(m.group(1)), state_dir / name))
    return [p for _, p in sorted(found)]


def load_summary(state_dir: Path) -> Summary:
    """The index of the closed segments plus any segment it does not cover yet (folded here).
    An index that is missing or damaged costs a read of every segment, never a wrong answer."""
    summary = Summary()
    try:
        with open_regular(state_dir / INDEX_NAME) as fh:
            data = fh.read(MAX_INDEX_BYTES + 1)
        if len(data) > MAX_INDEX_BYTES:
            raise ValueError(f"larger than {MAX_INDEX_BYTES} bytes")
        summary = Summary.from_json(data)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:
        log.warning("journal index %s is unusable (%s); reading every segment instead",
                    state_dir / INDEX_NAME, getattr(exc, "strerror", None) or exc)
    covered = set(summary.segments)
    for path in segment_paths(state_dir):
        if path.name not in covered:
            summary.fold(read_records(path))
            summary.segments.append(path.name)
    return summary


def journal_summary(journal_path: Path) -> Summary:
    """Everything the journal at ``journal_path`` (its live segment) says, as a ``Summary``:
    the index, uncovered segments and the live segment folded. Reads bounded bytes."""
    return load_summary(journal_path.parent).fold(read_records(journal_path))


def has_records(journal_path: Path) -> bool:
    """True when the journal holds anything: a non-empty live segment or a closed one."""
    try:
        if journal_path.stat().st_size > 0:
            return True
    except OSError:
        pass
    return bool(segment_paths(journal_path.parent))


class Journal:
    def __init__(self, state_dir: Path, segment_bytes: int = SEGMENT_BYTES, *, read_only: bool = False) -> None:
        """``read_only``: for readers (``status``), which must not create the state dir."""
        self.dir = state_dir if read_only else private_dir(state_dir)
        self.path = self.dir / JOURNAL_NAME
        self.segment_bytes = segment_bytes
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISLNK(st.st_mode):
                raise StateError(f"{self.path} is a symbolic link; mlxwatch never writes through one: "
                                 "remove it (and check who made it)")
            if not stat.S_ISREG(st.st_mode):
                raise StateError(f"{self.path} is not a regular file: move it away")
        self._index_checked = False  # the first append makes sure the index covers every segment
        self.observers: list[Callable[[dict[str, Any]], None]] = []
        self._observer_errors: set[str] = set()
        self.backlog: list[dict[str, Any]] = []  # records a full disk kept us from writing, oldest first
        self.write_error: str | None = None
        self._queue: queue.Queue[dict[str, Any] | None] | None = None  # set by start(): the writer's input
        self._writer: threading.Thread | None = None
        self._writing = threading.Lock()  # one writer at a time (the thread, or a caller without one)
        self._handing = threading.Lock()  # an append and the writer's exit never cross

    # --- the writer thread (the daemon's): appends in order, off the event loop

    def start(self) -> None:
        """From now on, appends go to one writer thread, in order; ``record`` and ``note``
        never wait on the disk. ``stop`` writes what is queued and ends the thread."""
        if self._writer is not None:
            return
        self._queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_queued, args=(self._queue,),
                                        name="journal-writer", daemon=True)
        self._writer.start()

    def flush(self) -> None:
        """Wait until every record queued so far is written (or, on a full disk, in the backlog)."""
        if self._queue is not None:
            self._queue.join()

    def stop(self) -> None:
        """Write what is queued, try the backlog once more, and end the writer thread (blocking:
        the daemon calls it from a thread at shutdown). Appends after this are written at once."""
        writer = self._writer
        if writer is None:
            return
        with self._handing:
            if self._queue is not None:
                self._queue.put(None)
        writer.join()
        self._writer = None
        if self.backlog:
            self._write([])

    def _write_queued(self, q: "queue.Queue[dict[str, Any] | None]") -> None:
        while True:
            try:  # a backlog is tried again by itself: freed space must not wait for the next event
                entry = q.get(timeout=BACKLOG_RETRY) if self.backlog else q.get()
            except queue.Empty:
                try:
                    self._write([])
                except Exception as exc:  # as below: the thread must live
                    log.error("journal writer failed on its backlog", exc_info=exc)
                continue
            try:
                if entry is None:
                    with self._handing:  # records queued after the stop request are written first
                        if q.empty():
                            self._queue = None  # from now on a caller writes: nothing is left to overtake
                            return
                        q.put(None)
                    continue
                self._write([entry])
            except Exception as exc:  # never let the thread die: the next record would wait forever
                log.error("journal writer failed on '%s'", entry.get("event") if entry else None, exc_info=exc)
            finally:
                q.task_done()

    # --- appending

    def record(self, event: Event, incident: Incident, **extra: Any) -> dict[str, Any]:
        entry = {"ts": time.time(), "event": event, **incident.to_dict(), **extra}
        self._append(entry)
        self._tell(entry)
        return entry

    def note(self, event: Event, **fields: Any) -> None:
        """A record that belongs to no incident (daemon start, resume requests)."""
        entry = {"ts": time.time(), "event": event, **fields}
        self._append(entry)
        self._tell(entry)

    def _append(self, entry: dict[str, Any]) -> None:
        """Queue ``entry`` for the writer thread, or, without one, write it now."""
        with self._handing:
            if self._queue is not None:
                self._queue.put(entry)
                return
        self._write([entry])

    def _write(self, entries: list[dict[str, Any]]) -> None:
        """Write ``entries`` after any backlog. A write that fails (a full disk) never stops the
        watcher that made it: the record waits in memory (bounded) and the next append (or the
        writer thread, every BACKLOG_RETRY seconds) writes it first, in order. Logged once per
        failing streak. A failed append leaves nothing of itself in the file (``append_record``
        cuts it back off): no torn line, no record twice."""
        with self._writing:
            self._write_locked(entries)

    def _write_locked(self, entries: list[dict[str, Any]]) -> None:
        self.backlog.extend(entries)
        try:
            self._keep_bounded()
            while self.backlog:
                append_record(self.path, self.backlog[0])
                self.backlog.pop(0)
        except OSError as exc:
            if self.write_error is None:
                log.error("cannot write the journal %s: %s; %d record(s) kept in memory until it can",
                          self.path, exc.strerror or exc, len(self.backlog))
            self.write_error = str(exc)
            del self.backlog[:-MAX_BACKLOG]
            return
        if self.write_error is not None:
            log.warning("journal written again (it had failed: %s)", self.write_error)
            self.write_error = None

    def _keep_bounded(self) -> None:
        """Rotate the live segment once it holds ``segment_bytes``, and keep the index covering
        every closed segment (the first append of a run repairs one a crash left behind)."""
        try:
            size = os.stat(self.path).st_size
        except FileNotFoundError:
            size = 0
        if size >= self.segment_bytes:
            segments = segment_paths(self.dir)
            newest = _SEGMENT.fullmatch(segments[-1].name) if segments else None  # segment_paths: all match
            last = int(newest.group(1)) if newest else 0
            target = self.dir / f"incidents-{last + 1:06d}.jsonl"
            if os.path.lexists(target):  # numbers only grow; this would be a bug, and we never overwrite
                raise FileExistsError(target)
            os.rename(self.path, target)
            fsync_dir(self.dir)
            log.info("journal segment %s closed (%d bytes)", target.name, size)
            self._index_checked = False
        if not self._index_checked:
            summary = load_summary(self.dir)
            if not _index_covers(self.dir, summary):
                replace_atomically(self.dir / INDEX_NAME, summary.to_json())
            self._index_checked = True

    def _tell(self, entry: dict[str, Any]) -> None:
        for observer in list(self.observers):
            try:
                observer(entry)
            except Exception as exc:  # an observer must never break the journal or its writer
                error = f"{type(exc).__name__}: {exc}"
                if error not in self._observer_errors:
                    self._observer_errors.add(error)
                    log.error("journal observer %r failed on '%s'; ignored", observer, entry.get("event"), exc_info=exc)

    def close_left_open(self, rec: dict[str, Any], reason: str) -> dict[str, Any]:
        """Close an incident a stopped daemon left open, keeping everything it had recorded.

        The old record's own ``reason`` (an ``interrupted`` record has one) is kept as
        ``stopped_reason``: keyword collisions here once crash-looped every later start."""
        entry = {k: v for k, v in rec.items() if k not in RECORD_FIELDS}
        if "reason" in entry:
            entry["stopped_reason"] = entry.pop("reason")
        stopped_at = rec.get("state") if rec.get("event") == "interrupted" and rec.get("state") else rec.get("event")
        entry.update(ts=time.time(), event=Event.CLOSED, reason=reason, stopped_at_event=stopped_at)
        self._append(entry)
        self._tell(entry)
        return entry

    def summary(self) -> Summary:
        self.flush()
        return journal_summary(self.path)

    def records(self) -> list[dict[str, Any]]:
        """The records that decide the present, in order: the closed segments' kept records
        (each instance's last incident record, each open incident's last record), then every
        record of the live segment. Folding these gives what folding the whole history gives."""
        self.flush()
        return load_summary(self.dir).kept_records() + read_records(self.path)

    def open_incidents(self) -> list[dict[str, Any]]:
        """The last record of each incident that never reached a closing event."""
        return [rec for _, rec in sorted(self.summary().open.values(), key=lambda kept: kept[0])]

    def latest_by_instance(self) -> dict[str, dict[str, Any]]:
        return {name: rec for name, (_, rec) in self.summary().latest.items()}


def _index_covers(state_dir: Path, summary: Summary) -> bool:
    """Does the index on disk already say what ``summary`` says about the closed segments?"""
    try:
        with open_regular(state_dir / INDEX_NAME) as fh:
            return Summary.from_json(fh.read(MAX_INDEX_BYTES + 1)).segments == summary.segments
    except (OSError, ValueError):
        return False
