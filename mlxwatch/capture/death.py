"""Why a server died: the cause, named from what the OS recorded, with that record copied.

Asked when the captured server is gone (or its generation thread died). Every source is read
in one place and the first that names the process decides; what each source said (or why it
could not be read) goes into the bundle's ``death.json``, the records themselves beside it::

    cause = why_gone(GoneProcess(pid, started), markers)      # Cause("oom_killer", ...)
    cause = why_thread_died(markers)                          # Cause("out_of_memory", ...) or None

The causes (the metrics' ``cause`` label, fixed):

    oom_killer     Linux's OOM killer killed it: its ``Killed process PID`` line, with the
                   cgroup's limit and counters (``host.cgroup``) when the kill names one
    jetsam         macOS's memory pressure killer: a ``JetsamEvent`` report names it
    out_of_memory  a Metal allocation failed: ``[metal::malloc] Resource limit`` or
                   ``Insufficient Memory`` in its log (a dead generation thread on mlx >= 0.32,
                   the whole process before) or in the unified log's line around its death
    native_crash   a native fault: the kernel's ``segfault``/``traps`` line, a crash report,
                   ``Fatal Python error`` in its log
    kernel_panic   the machine panicked and rebooted: a ``.panic`` report
    traceback      a Python exception ended it: the last traceback in its log
    unknown        nothing recorded names it; ``sources`` says what was read and what could not be

Linux is read here (the kernel's log, the memory cgroup, the server's log); on macOS
``macos_reports`` reads the JetsamEvent, panic and crash reports and one ``log show`` query
(parsed by ``capture.macos_memory`` and ``capture.macos``) and hands them to ``why_gone``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import psutil

from mlxwatch.capture import macos, macos_memory
from mlxwatch.host import cgroup, kernlog
from mlxwatch.serverlog.markers import LogMarkers

CAUSES = ("oom_killer", "jetsam", "out_of_memory", "native_crash", "kernel_panic", "traceback", "unknown")
MiB = 1024 * 1024
START_SLACK = 2.0  # seconds: a process's start against the kernel's clock (boot time is read to the second)


@dataclass(frozen=True)
class GoneProcess:
    pid: int
    started: float | None = None  # wall time it started (create_time), if recorded


@dataclass(frozen=True)
class Cause:
    cause: str  # one of CAUSES
    summary: str  # one line: what a person reads in status, the journal and an alert
    evidence: tuple[str, ...] = ()  # the recorded lines that name it, as the OS wrote them
    sources: dict[str, str] = field(default_factory=dict)  # source -> what it said ("read", "nothing", an error)
    cgroup: dict[str, int] | None = None  # the memory cgroup's counters (Linux), when known
    signal: str | None = None  # the signal that ended it, where the record says (the OOM killer's SIGKILL)
    files: dict[str, str] = field(default_factory=dict)  # bundle relname -> text copied in

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("files")
        out["evidence"] = list(self.evidence)
        return out


def why_thread_died(markers: LogMarkers | None) -> Cause | None:
    """A dead generation thread whose log shows a Metal memory error died of out-of-memory."""
    if markers is None:
        return None
    lines = [*markers.metal_malloc, *markers.insufficient_memory]
    if not lines:
        return None
    return Cause("out_of_memory", f"out of memory (Metal): {lines[-1]}", tuple(lines[-3:]), {"server log": "read"})


def why_gone(gone: GoneProcess | None, markers: LogMarkers | None, *,
             read_kernel_log: Callable[[], kernlog.KernelLog] = kernlog.read_kernel_log,
             boot_time: Callable[[], float] = psutil.boot_time,
             cgroup_root: cgroup.Path = cgroup.ROOT, linux: bool = True,
             reports: tuple[Cause, ...] = ()) -> Cause:
    """The cause of a gone process's death. ``reports``: what the macOS sources found (jetsam,
    crash, panic, unified log), already read; they are weighed with the rest, the kernel first."""
    sources: dict[str, str] = {}
    files: dict[str, str] = {}
    if gone is not None and linux:
        log = read_kernel_log()
        since = (gone.started - boot_time() - START_SLACK) if gone.started else 0.0
        lines = log.about(gone.pid, since_boot=since)
        sources["kernel log"] = log.error or (f"{len(lines)} line(s) about PID {gone.pid}" if lines else
                                              f"nothing about PID {gone.pid}")
        if lines:
            files["death/kernel.log"] = "".join(r.line() + "\n" for r in lines)
        kill = kernlog.oom_kill(lines)
        if kill is not None:
            return _oom_kill(gone, kill, lines, sources, files, cgroup_root)
        crash = [r for r in lines if "segfault" in r.text or "traps:" in r.text or "general protection" in r.text]
        if crash:
            return Cause("native_crash", f"native crash: {crash[-1].text}", tuple(r.line() for r in crash),
                         sources, files=files, signal=_trap_signal(crash[-1].text))
    elif gone is None:
        sources["kernel log"] = "not read: no PID of the server was recorded"
    for report in reports:  # macOS: jetsam, panic, crash report, unified log, in that order of weight
        sources.update(report.sources)
        files.update(report.files)
    decided = next((r for r in reports if r.cause != "unknown"), None)
    if decided is not None and decided.cause in ("jetsam", "kernel_panic", "out_of_memory"):
        return Cause(decided.cause, decided.summary, decided.evidence, sources, files=files)
    from_log = _from_log(markers)
    if markers is None:
        sources["server log"] = "not read (no log)"
    else:
        sources["server log"] = "read"
    if from_log is not None and (decided is None or from_log.cause == "out_of_memory"):
        return Cause(from_log.cause, from_log.summary, from_log.evidence, sources, files=files)
    if decided is not None:
        return Cause(decided.cause, decided.summary, decided.evidence, sources, files=files)
    if from_log is not None:
        return Cause(from_log.cause, from_log.summary, from_log.evidence, sources, files=files)
    return Cause("unknown", "nothing the OS recorded names the cause (" +
                 "; ".join(f"{k}: {v}" for k, v in sources.items()) + ")", (), sources, files=files)


def _oom_kill(gone: GoneProcess, kill: kernlog.OomKill, lines: list[kernlog.KernelRecord],
              sources: dict[str, str], files: dict[str, str], root: cgroup.Path) -> Cause:
    killed = next((r for r in reversed(lines) if "Killed process" in r.text), lines[-1])
    counters = None
    where = "the machine's memory" if kill.constraint == "CONSTRAINT_NONE" else "its memory cgroup"
    if kill.memcg:
        cg = cgroup.of_oom_kill(kill.memcg, root)
        counters = cg.read() if cg is not None else None
        sources["memory cgroup"] = f"{kill.memcg}: " + ("read" if counters else "gone (its counters went with it)")
        if counters and "limit" in counters:
            where = f"memory cgroup {kill.memcg}, limit {counters['limit'] / MiB:.0f} MiB"
        elif kill.constraint == "CONSTRAINT_MEMCG":
            where = f"memory cgroup {kill.memcg}"
    summary = f"killed by the kernel's OOM killer ({where})"
    if kill.anon_rss_kb is not None:
        summary += f" at {kill.anon_rss_kb / 1024:.0f} MiB resident"
    evidence = [killed.line()]
    if counters:
        evidence.append("cgroup: " + ", ".join(f"{k} {v}" for k, v in sorted(counters.items())))
    return Cause("oom_killer", summary, tuple(evidence), sources, cgroup=counters, files=files, signal="SIGKILL")


def _trap_signal(text: str) -> str:
    """The signal the kernel sends for the fault its line names (arch/x86/kernel/traps.c and
    mm/fault.c's messages): a divide error SIGFPE, an invalid opcode SIGILL, else SIGSEGV."""
    if "divide error" in text:
        return "SIGFPE"
    if "invalid opcode" in text:
        return "SIGILL"
    return "SIGSEGV"


def _from_log(markers: LogMarkers | None) -> Cause | None:
    """The server's own last words: a Metal memory error, a fatal native error, a traceback."""
    if markers is None:
        return None
    oom = why_thread_died(markers)
    if oom is not None:
        return oom
    fatal = markers.fatal_errors
    if fatal:
        return Cause("native_crash", f"native crash: {fatal[-1]}", tuple(fatal))
    if markers.last_traceback:
        last = markers.last_traceback[-1]
        return Cause("traceback", f"a Python exception: {last}", tuple(markers.last_traceback[-6:]))
    return None


def macos_reports(gone: GoneProcess, died_at: float) -> tuple[Cause, ...]:
    """What macOS recorded about ``gone``'s death (blocking; macOS only): a JetsamEvent report
    naming it, a Metal out-of-memory line in the unified log around ``died_at``, a panic report
    written since it started (the Mac rebooted), a crash report naming it. Each a Cause, with
    the report copied; the strongest first (``why_gone`` takes the first that names a cause)."""
    since = gone.started or (died_at - 24 * 3600)
    found: list[Cause] = []
    for path in macos_memory.recent_reports(since, (".ips",), prefix="JetsamEvent"):
        text = macos_memory.read_text(path)
        kill = macos_memory.parse_jetsam(text, gone.pid)
        if kill is not None:
            found.append(Cause("jetsam", kill.summary(), (f"{path.name}: pid {kill.pid} ({kill.name}), reason "
                                                           f"{kill.reason}, rpages {kill.rpages}",),
                               {"jetsam reports": f"{path.name} names PID {gone.pid}"},
                               files={f"death/{path.name}": text}))
            break
    else:
        found.append(Cause("unknown", "", (), {"jetsam reports": f"none names PID {gone.pid}"}))
    lines, error = macos_memory.run_log_show(gone.pid, died_at)
    if lines:
        found.append(Cause("out_of_memory", f"out of memory (Metal, unified log): {lines[-1]}", tuple(lines[-3:]),
                           {"unified log": f"{len(lines)} Metal memory line(s)"},
                           files={"death/unified-log.txt": "\n".join(lines) + "\n"}))
    else:
        found.append(Cause("unknown", "", (), {"unified log": error or "no Metal memory line for that PID"}))
    for path in macos_memory.recent_reports(since, (".panic",)):
        text = macos_memory.read_text(path)
        why = macos_memory.parse_panic(text)
        if why is not None:
            found.append(Cause("kernel_panic", f"the Mac panicked and rebooted: {why}", (f"{path.name}: {why}",),
                               {"panic reports": path.name}, files={f"death/{path.name}": text}))
            break
    for path in macos.recent_crash_reports(gone.pid, since, alive=False):
        report = macos.parse_crash_report(macos_memory.read_text(path))
        if report is not None:
            found.append(Cause("native_crash", f"native crash: {report.exception or 'a crash report'}"
                               + (f" on {report.crashed_queue}" if report.crashed_queue else ""),
                               (f"{path.name}: {report.exception}",), {"crash reports": path.name}))
            break
    order = {"jetsam": 0, "out_of_memory": 1, "kernel_panic": 2, "native_crash": 3, "unknown": 4}
    return tuple(sorted(found, key=lambda c: order.get(c.cause, 5)))
