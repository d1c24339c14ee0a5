"""Shared pieces of the benchmarks: statistics, the machine, configs, the daemon as a process."""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import psutil
import yaml

ROOT = Path(os.environ.get("MLXWATCH_BENCH_REPO") or Path(__file__).resolve().parent.parent)  # the repository
# Where the code under test is imported from: a snapshot of the repository's HEAD made by
# bench/run.py (so that edits to the working tree during a run do not change what is measured),
# or the repository itself.
SRC = Path(os.environ.get("MLXWATCH_BENCH_SRC") or ROOT)
# The test lab (lab servers with faults, the stand-in) lives in tests/lab, outside the package:
# benchmarks import it as `lab`, as the tests do.
sys.path.insert(0, str(SRC / "tests"))
# The daemons, shims and servers a benchmark starts keep their runtime files (shim heartbeats,
# one-daemon-per-server locks: thousands at 300 stand-ins on fresh ports) in a directory of this
# run, removed at its end, never in the user's shared /tmp/mlxwatch-<uid> (as tests/conftest.py).
if "MLXWATCH_RUNTIME_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _RUNTIME = tempfile.mkdtemp(prefix="mlxwatch-bench-runtime-")
    os.environ["MLXWATCH_RUNTIME_DIR"] = _RUNTIME
    atexit.register(shutil.rmtree, _RUNTIME, True)
VENVS = Path(os.environ.get("MLXWATCH_VENVS") or ROOT / ".venvs")
TEST_PYTHON = VENVS / "test" / "bin" / "python"  # mlxwatch + the newest mlx-lm 0.32.x
OLD_PYTHON = VENVS / "mlx-lm-0.31.3" / "bin" / "python"  # the server of the public report


# --- statistics


def quantile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Iterable[float | None]) -> dict[str, Any]:
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"n": 0, "min": None, "median": None, "max": None}
    return {"n": len(xs), "min": min(xs), "median": statistics.median(xs), "max": max(xs),
            "mean": statistics.fmean(xs)}


def fmt_s(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def fmt_mmm(s: dict[str, Any], digits: int = 1, unit: str = "") -> str:
    """``median (min–max)``."""
    if not s or s.get("n", 1) == 0 or s.get("median") is None:
        return "–"
    return f"{s['median']:.{digits}f}{unit} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


# --- the machine


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor()
    return {
        "host": socket.gethostname(), "system": platform.system(), "release": platform.release(),
        "machine": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1024**3, 1),
        "python": platform.python_version(),
    }


def versions() -> dict[str, str]:
    out = {}
    for name, py in (("test venv", TEST_PYTHON), ("0.31.3 venv", OLD_PYTHON)):
        code = ("import importlib.metadata as m, json\nout = {}\n"
                "for p in ('mlx-lm', 'mlx', 'mlxwatch', 'py-spy', 'httpx', 'psutil'):\n"
                "    try:\n        out[p] = m.version(p)\n    except m.PackageNotFoundError:\n        pass\n"
                "print(json.dumps(out))")
        try:
            text = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60).stdout
            out[name] = json.loads(text)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            out[name] = {"error": str(exc)}
    return out


def git_commit() -> str:
    if os.environ.get("MLXWATCH_BENCH_COMMIT"):
        return os.environ["MLXWATCH_BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "mlxwatch"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head + (" (+ uncommitted changes in mlxwatch/)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class LoadSampler:
    """Samples the 1-minute load average and other processes' CPU while a part runs (to tell a
    disturbed measurement)."""

    def __init__(self) -> None:
        self.samples: list[float] = []

    def sample(self) -> None:
        self.samples.append(os.getloadavg()[0])

    def to_dict(self) -> dict[str, Any]:
        return summary(self.samples)


# --- configs


def probe_yaml(p: dict[str, float]) -> dict[str, Any]:
    return {k: (f"{v}s" if isinstance(v, float) else v) for k, v in p.items()}


def write_config(path: Path, instances: list[dict[str, Any]], state_dir: Path, capture: dict | None = None) -> Path:
    doc: dict[str, Any] = {"state_dir": str(state_dir), "instances": instances}
    if capture:
        doc["capture"] = capture
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# --- the daemon as its own process (`mlxwatch run`), so its CPU and RSS are its own


@dataclass
class DaemonProcess:
    config: Path
    state_dir: Path
    log_path: Path
    log_level: str = "INFO"
    python: Path = TEST_PYTHON
    proc: subprocess.Popen | None = None
    ps: psutil.Process | None = None
    rss_samples: list[int] = field(default_factory=list)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(self.python), "-m", "mlxwatch", "--config", str(self.config), "run", "--log-level", self.log_level],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=SRC,
                env={**os.environ, "PATH": f"{self.python.parent}:{os.environ.get('PATH', '')}"},
            )
        self.ps = psutil.Process(self.proc.pid)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def cpu_seconds(self) -> float:
        assert self.ps is not None
        t = self.ps.cpu_times()
        return t.user + t.system

    def rss(self) -> int:
        assert self.ps is not None
        rss = self.ps.memory_info().rss
        self.rss_samples.append(rss)
        return rss

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        code = self.proc.returncode
        self.proc = None
        return code

    def state(self) -> dict[str, Any]:
        try:
            return json.loads((self.state_dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def instance_state(self, name: str) -> dict[str, Any]:
        return (self.state().get("instances") or {}).get(name) or {}

    def journal(self) -> list[dict[str, Any]]:
        path = self.state_dir / "incidents.jsonl"
        out = []
        try:
            for line in path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        except OSError:
            pass
        return out

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_until(self, predicate, timeout: float, what: str, poll: float = 0.1) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if not self.alive():
                raise RuntimeError(f"daemon exited ({what}); see {self.log_path}:\n{self.log_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}; see {self.log_path}")
            time.sleep(poll)


def paths_option(parser: Any, option: str, value: str | None, known: Iterable[str]) -> list[str]:
    """A comma-separated list of bench paths from ``option``, each one of ``known`` (else the
    parser's one-line usage error)."""
    known = tuple(known)
    wanted = [k for k in (value or "").split(",") if k]
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        parser.error(f"{option}: unknown path(s) {', '.join(unknown)} (known: {', '.join(known)})")
    return wanted


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def splice_section(md: str, heading: str, section: str) -> str:
    """``md`` with the section under ``heading`` replaced (from the heading to the next ``## ``),
    or appended: a benchmark that writes its own part of RESULTS.md leaves the others alone."""
    start = md.find(heading)
    if start < 0:
        return md.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
    end = md.find("\n## ", start + len(heading))
    rest = "" if end < 0 else md[end:]
    return md[:start] + section.rstrip("\n") + "\n" + rest


def write_section(name: str, data: Any, heading: str, section: str) -> Path:
    """A benchmark's own run: ``bench/<name>.json`` and its section of RESULTS.md (replaced
    atomically); the RESULTS.md path."""
    write_json(ROOT / "bench" / f"{name}.json", data)
    md = ROOT / "bench" / "RESULTS.md"
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text(splice_section(md.read_text(), heading, section))
    os.replace(tmp, md)
    return md


def run_header(**fields: Any) -> dict[str, Any]:
    """What every recorded run starts with: when, from which commit, on what machine and load."""
    import datetime

    return {"started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "machine": machine(), "load_average": load_average(), **fields}


def add_record_options(parser: Any) -> None:
    """``--no-write`` and ``--render JSON``, as every recording benchmark has them."""
    parser.add_argument("--no-write", action="store_true", help="print the JSON; write neither JSON nor RESULTS.md")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the RESULTS.md section from this saved run")


def record(name: str, args: Any, run: Callable[[], dict[str, Any]], heading: str,
           render: Callable[[dict[str, Any]], str]) -> int:
    """A benchmark's ending: ``run()`` (or the saved run ``args.render``), printed
    (``--no-write``) or written to ``bench/<name>.json`` and its section of RESULTS.md; exit 0
    when the run says it met its goals (``pass``)."""
    data = json.loads(Path(args.render).read_text()) if args.render else run()
    if args.no_write:
        print(json.dumps(data, indent=1, default=str))
    elif args.render:
        md = ROOT / "bench" / "RESULTS.md"
        md.write_text(splice_section(md.read_text(), heading, render(data)))
    else:
        write_section(name, data, heading, render(data))
        log(f"wrote bench/{name}.json and its section of bench/RESULTS.md")
    return 0 if data.get("pass") else 1


def keep_other_sections(old_md: str, new_md: str) -> str:
    """``new_md`` plus every ``## `` section of ``old_md`` it does not have: the sections other
    benchmarks write into RESULTS.md by themselves (front_perf, front_detection, the slow soak)
    survive a run of ``bench/run.py``, which renders only its own."""
    parts = old_md.split("\n## ")[1:]
    kept = [p for p in parts if f"\n## {p.splitlines()[0]}\n" not in f"\n{new_md}\n"]
    return new_md.rstrip("\n") + "".join(f"\n\n## {p.rstrip()}" for p in kept) + "\n"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
