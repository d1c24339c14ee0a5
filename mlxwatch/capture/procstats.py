"""Process statistics over the capture window (psutil).

One description (cmdline, cwd, environment, open files, connections: as read, the capture's
redaction pass removes secrets when it writes them, see ``redact``) and a
series of CPU samples, including per-thread CPU times: "is the generation thread burning CPU or
parked?" is the question that separates a livelock from a block.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import psutil


@dataclass
class CpuSample:
    t: float  # seconds since the window started
    status: str
    user: float
    system: float
    rss: int
    num_threads: int
    threads: dict[int, float]  # thread id -> user+system seconds


@dataclass
class ProcessWindow:
    """Samples over the window, and what could not be read (recorded, never raised)."""

    samples: list[CpuSample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    gone_at: float | None = None

    def cpu_percent(self) -> float | None:
        """Process CPU over the window, percent of one core."""
        if len(self.samples) < 2:
            return None
        a, b = self.samples[0], self.samples[-1]
        span = b.t - a.t
        return 100.0 * ((b.user + b.system) - (a.user + a.system)) / span if span > 0 else None

    def thread_cpu_percent(self, tid: int | None) -> float | None:
        """One thread's CPU over the window, percent of one core; None if it cannot be told."""
        if tid is None or len(self.samples) < 2:
            return None
        a, b = self.samples[0], self.samples[-1]
        if tid not in a.threads or tid not in b.threads or b.t <= a.t:
            return None
        return 100.0 * (b.threads[tid] - a.threads[tid]) / (b.t - a.t)

    def statuses(self) -> list[str]:
        return sorted({s.status for s in self.samples})

    def to_dict(self) -> dict:
        return {
            "cpu_percent": self.cpu_percent(),
            "statuses": self.statuses(),
            "gone_at": self.gone_at,
            "errors": self.errors,
            "samples": [
                {"t": round(s.t, 3), "status": s.status, "cpu_user": s.user, "cpu_system": s.system,
                 "rss": s.rss, "num_threads": s.num_threads,
                 "threads": {str(k): round(v, 4) for k, v in s.threads.items()}}
                for s in self.samples
            ],
        }


def describe_process(pid: int) -> dict:
    """Identity and surroundings of the process; each unreadable field is recorded as an error."""
    info: dict = {"pid": pid, "errors": {}}
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        info["errors"]["process"] = "no such process"
        return info
    readers = {
        "status": proc.status,
        "create_time": proc.create_time,
        "cmdline": proc.cmdline,
        "exe": proc.exe,
        "cwd": proc.cwd,
        "ppid": proc.ppid,
        "username": proc.username,
        "num_threads": proc.num_threads,
        "memory": lambda: proc.memory_info()._asdict(),
        "cpu_times": lambda: proc.cpu_times()._asdict(),
        "open_files": lambda: len(proc.open_files()),
        "connections": lambda: len(proc.net_connections("inet")),
        "environment": proc.environ,
    }
    for key, read in readers.items():
        try:
            info[key] = read()
        except psutil.AccessDenied:
            info["errors"][key] = "access denied"
        except psutil.NoSuchProcess:
            info["errors"][key] = "process exited"
            break
        except (psutil.Error, OSError) as exc:
            info["errors"][key] = str(exc)
    return info


def _sample(proc: psutil.Process, t: float) -> CpuSample:
    with proc.oneshot():
        times = proc.cpu_times()
        try:
            threads = {th.id: th.user_time + th.system_time for th in proc.threads()}
        except psutil.AccessDenied:
            threads = {}
        return CpuSample(t, proc.status(), times.user, times.system, proc.memory_info().rss,
                         proc.num_threads(), threads)


def _sample_now(proc: psutil.Process, started: float) -> CpuSample:
    """One sample, timed when it is read (in a worker thread: the time is the reading's own)."""
    return _sample(proc, time.monotonic() - started)


async def sample_process(pid: int, duration: float, interval: float = 0.5) -> ProcessWindow:
    """Sample ``pid`` every ``interval`` s for ``duration`` s (cancellation keeps what was read).

    Every psutil read runs in a worker thread: the capture shares the daemon's event loop with
    other instances' probes, and reading a process's threads is file I/O under /proc (or a
    Mach call on macOS) that can be slow on a loaded machine."""
    window = ProcessWindow()
    started = time.monotonic()
    try:
        proc = await asyncio.to_thread(psutil.Process, pid)
    except psutil.NoSuchProcess:
        window.gone_at = 0.0
        window.errors.append("no such process")
        return window
    except asyncio.CancelledError:
        return window
    try:
        while True:
            t = time.monotonic() - started
            try:
                sample = await asyncio.to_thread(_sample_now, proc, started)
                window.samples.append(sample)
                t = sample.t
            except psutil.NoSuchProcess:
                window.gone_at = t
                window.errors.append(f"process exited {t:.1f}s into the window")
                return window
            except psutil.Error as exc:
                window.errors.append(f"{type(exc).__name__}: {exc}")
            if t >= duration:
                return window
            await asyncio.sleep(min(interval, max(0.0, duration - t)))
    except asyncio.CancelledError:
        return window
