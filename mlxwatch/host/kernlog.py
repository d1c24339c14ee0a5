"""The Linux kernel's log: what it said about one process (the OOM killer, a segfault, a trap).

Read from ``/dev/kmsg`` (what ``dmesg`` reads): one record per ``read``, each
``PRIORITY,SEQ,MICROSECONDS,FLAGS;MESSAGE`` (Documentation/ABI/testing/dev-kmsg), the time in
microseconds since boot on the monotonic clock. Opened non-blocking, it is read from the oldest
record still in the ring to its end (``EAGAIN``); a record overwritten while reading gives
``EPIPE`` once and the read goes on. Root or ``CAP_SYSLOG`` can read it; with
``kernel.dmesg_restrict`` = 0 anyone can. ::

    log = read_kernel_log()                     # KernelLog(records=[...]) or KernelLog(error=...)
    lines = log.about(pid, since_boot=start)     # the OOM report and crash lines naming that PID

The lines for a PID: the OOM killer's ``oom-kill:...,pid=PID,...`` and ``Killed process PID``
(with the report lines just before them: who invoked the killer, the cgroup's usage and limit);
``NAME[PID]: segfault at ...`` and ``traps: NAME[PID] ...`` (an unhandled SIGSEGV, SIGBUS or
trap: the native crash's own line).
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field

KMSG = "/dev/kmsg"
MAX_RECORDS = 200_000  # far more than a ring holds; a bound on a read that would never end
OOM_REPORT_LINES = 60  # lines kept before the kill: the report from "invoked oom-killer" on


@dataclass(frozen=True)
class KernelRecord:
    seconds: float  # since boot (monotonic)
    text: str

    def line(self) -> str:
        """As ``dmesg`` prints it: ``[  198.349695] Memory cgroup out of memory: ...``."""
        return f"[{self.seconds:12.6f}] {self.text}"


@dataclass(frozen=True)
class KernelLog:
    records: tuple[KernelRecord, ...] = ()
    error: str | None = None  # why it could not be read (None: read)

    def about(self, pid: int, since_boot: float = 0.0) -> list[KernelRecord]:
        """The records about ``pid`` written at or after ``since_boot``: its OOM kill (with the
        report before it) and its crash lines. A PID is reused over an uptime: ``since_boot``
        (the process's start) keeps another process's lines out."""
        found: list[KernelRecord] = []
        report_start = None
        for i, rec in enumerate(self.records):
            if rec.seconds < since_boot:
                continue
            text = rec.text
            if "invoked oom-killer" in text:
                report_start = i
            if _names_kill(text, pid):
                if report_start is not None and not found:
                    found += [r for r in self.records[max(report_start, i - OOM_REPORT_LINES):i] if r not in found]
                if rec not in found:
                    found.append(rec)
            elif _names_crash(text, pid):
                found.append(rec)
        return found


def _names_kill(text: str, pid: int) -> bool:
    return bool(re.search(rf"\bKilled process {pid} \(", text) or
                (text.startswith("oom-kill:") and re.search(rf",pid={pid}(,|$)", text)))


def _names_crash(text: str, pid: int) -> bool:
    return bool(re.search(rf"\[{pid}\]: (segfault|general protection|trap)", text) or
                re.match(rf"traps: \S+\[{pid}\] ", text))


_RECORD = re.compile(r"^(\d+),(\d+),(\d+),[^;]*;(.*)$", re.S)


def parse_record(raw: str) -> KernelRecord | None:
    """One ``/dev/kmsg`` record (its continuation lines, `` KEY=value``, dropped)."""
    m = _RECORD.match(raw)
    if m is None:
        return None
    text = m.group(4).split("\n", 1)[0]
    return KernelRecord(int(m.group(3)) / 1e6, text.replace("\\x0a", " "))


def read_kernel_log(path: str = KMSG, max_records: int = MAX_RECORDS) -> KernelLog:
    """Every record still in the kernel's ring (blocking: call it from a worker thread)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return KernelLog(error=f"{path}: {exc.strerror or exc}")
    records: list[KernelRecord] = []
    try:
        while len(records) < max_records:
            try:
                raw = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # overwritten under us: read on from the next
                    continue
                return KernelLog(tuple(records), f"{path}: {exc.strerror or exc}")
            if not raw:
                break
            rec = parse_record(raw.decode("utf-8", errors="replace"))
            if rec is not None:
                records.append(rec)
    finally:
        os.close(fd)
    return KernelLog(tuple(records))


def readable(path: str = KMSG) -> str | None:
    """None when the kernel's log can be read here, else why not (for ``doctor``)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    os.close(fd)
    return None


@dataclass(frozen=True)
class OomKill:
    """What the OOM killer's lines say about the kill."""

    memcg: str | None = None  # task_memcg=/path: the cgroup the victim ran in
    constraint: str | None = None  # CONSTRAINT_MEMCG (a cgroup's limit) or CONSTRAINT_NONE (the machine)
    anon_rss_kb: int | None = None
    extra: dict[str, str] = field(default_factory=dict)


def oom_kill(lines: list[KernelRecord]) -> OomKill | None:
    """The kill's cgroup, constraint and resident size, from its lines; None: no OOM kill."""
    memcg = constraint = None
    rss = None
    killed = False
    for rec in lines:
        if rec.text.startswith("oom-kill:"):
            fields = dict(kv.split("=", 1) for kv in rec.text[len("oom-kill:"):].split(",") if "=" in kv)
            memcg, constraint = fields.get("task_memcg"), fields.get("constraint")
            killed = True
        elif "Killed process" in rec.text:
            killed = True
            if m := re.search(r"anon-rss:(\d+)kB", rec.text):
                rss = int(m.group(1))
    return OomKill(memcg, constraint, rss) if killed else None
