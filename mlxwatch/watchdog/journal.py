"""The incident journal: ``<state_dir>/incidents.jsonl``, append-only, one fsynced line per change.

Each record carries the incident's fields so far, so the last record of an incident is its
whole story: instance, incident id, first_failure_at, detected_at, kind, bundle, restart
method and result, recovered_at, seconds_to_recovery. An incident whose last record is not a
closing event is open: either a daemon is working on it, or a daemon stopped mid-incident
(``interrupted`` when it stopped cleanly; nothing when it was killed). The next start closes
each such incident with a ``closed`` record saying where it stopped, and ``mlxwatch status``
says which of the two it is.

Observers (``Journal.observers``, callables taking the record as written) are told of every
``record`` and ``note`` after it is appended: the metrics follow incidents this way. An observer
that raises is logged and ignored; it never stops the journal or the watcher that wrote. Records
written by ``close_left_open`` (incidents of an earlier daemon run) are not observed.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from mlxwatch.storage import append_record, private_dir, read_records

log = logging.getLogger("mlxwatch.watchdog")

JOURNAL_NAME = "incidents.jsonl"
CLOSING_EVENTS = ("recovered", "gave_up", "closed")
RECORD_FIELDS = ("ts", "event")
MAX_BACKLOG = 1000  # records kept in memory while the journal cannot be written  # set by the journal itself, never copied from an older record


@dataclass
class Incident:
    instance: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    first_failure_at: float | None = None
    detected_at: float | None = None
    failures: list[str] = field(default_factory=list)  # probe reasons that led to the verdict
    kind: str | None = None
    confidence: str | None = None
    bundle: str | None = None
    pid: int | None = None  # the proven server process (None: none could be proven)
    stranger: str | None = None  # who held the port instead, if anyone: never acted on
    restart_method: str | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)  # {at, result, error}
    recovered_at: float | None = None
    seconds_to_recovery: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Journal:
    def __init__(self, state_dir: Path) -> None:
        self.path = private_dir(state_dir) / JOURNAL_NAME
        self.observers: list[Callable[[dict[str, Any]], None]] = []
        self._observer_errors: set[str] = set()
        self.backlog: list[dict[str, Any]] = []  # records a full disk kept us from writing, oldest first
        self.write_error: str | None = None

    def record(self, event: str, incident: Incident, **extra: Any) -> dict[str, Any]:
        entry = {"ts": time.time(), "event": event, **incident.to_dict(), **extra}
        self._append(entry)
        self._tell(entry)
        return entry

    def note(self, event: str, **fields: Any) -> None:
        """A record that belongs to no incident (daemon start, resume requests)."""
        entry = {"ts": time.time(), "event": event, **fields}
        self._append(entry)
        self._tell(entry)

    def _append(self, entry: dict[str, Any]) -> None:
        """Write ``entry`` after any backlog. A write that fails (a full disk) never stops the
        watcher that made it: the record waits in memory (bounded) and the next append writes
        it first, in order. Logged once per failing streak."""
        self.backlog.append(entry)
        try:
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
        entry.update(ts=time.time(), event="closed", reason=reason, stopped_at_event=stopped_at)
        self._append(entry)
        self._tell(entry)
        return entry

    def records(self) -> list[dict[str, Any]]:
        return read_records(self.path)

    def open_incidents(self) -> list[dict[str, Any]]:
        """The last record of each incident that never reached a closing event."""
        last: dict[str, dict[str, Any]] = {}
        for rec in self.records():
            if "id" in rec and "instance" in rec:
                last[rec["id"]] = rec
        return [r for r in last.values() if r["event"] not in CLOSING_EVENTS]

    def latest_by_instance(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for rec in self.records():
            if "id" in rec and "instance" in rec:
                out[rec["instance"]] = rec
        return out
