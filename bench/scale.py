"""Scale: the daemon (`mlxwatch run`, its own process) watching 1 to 300 stand-in servers.

The stand-in (``bench/standin.py`` around ``tests/lab/standin.py``: one process, one port per
instance, 4 streamed tokens) records when each generation probe arrives on each port; gaps are
measured there, outside the daemon. Instances use ``restart: none`` and no log, the probe
defaults except ``interval``. The daemon is started, every instance is let reach ``healthy``
(the warm-up: one identity lookup per instance), then a window of whole intervals is measured:

- daemon CPU (user + system of its process and threads, % of one core) and RSS (max of 1 s samples);
- probes per instance per minute, done vs planned (60 / interval);
- gaps between consecutive probes of the same instance, pooled over all instances: p99 and max,
  and the p99 beyond the designed jitter (the daemon sleeps ``interval`` x U(0.9, 1.1) after each
  probe, so up to +10 % is by design); a gap over 1.8 x interval (two short jittered gaps) is a
  skipped probe; an instance with no probe in the window is skipped too.
"""

from __future__ import annotations

import itertools
import json
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import (
    SRC,
    TEST_PYTHON,
    DaemonProcess,
    log,
    quantile,
    summary,
    write_config,
)

JITTER = 0.10  # the daemon's designed jitter: interval x U(0.9, 1.1)
SKIP_FACTOR = 1.8
TARGET_BEYOND_JITTER = 0.10  # p99 gap at most interval x (1 + JITTER + 0.10)

# The three schedule targets, the CPU target (10 @ 30 s), RSS at 300, one instance, and the issue's
# worst row (100 @ 1 s) beyond the targets. Windows are whole intervals: 2-3 at 30 s, 6 at 5 s, 15-30 at 1 s.
# Only 10 @ 30 s runs in phase A (beside the soak): its CPU time is the process's own; RSS at 300
# depends on the warm-up burst, which a busy machine inflates, so 300 runs in phase B.
RUNS = [
    {"instances": 1, "interval": 1.0, "window": 20.0},
    {"instances": 10, "interval": 1.0, "window": 30.0, "target": "schedule"},
    {"instances": 10, "interval": 30.0, "window": 90.0, "target": "cpu", "phase": "A"},
    {"instances": 100, "interval": 5.0, "window": 30.0, "target": "schedule"},
    {"instances": 300, "interval": 30.0, "window": 60.0, "target": "schedule+rss"},
    {"instances": 100, "interval": 1.0, "window": 15.0},  # beyond the targets: the worst row
]
QUICK_RUNS = [
    {"instances": 1, "interval": 1.0, "window": 5.0},
    {"instances": 10, "interval": 1.0, "window": 5.0, "target": "schedule"},
    {"instances": 30, "interval": 2.0, "window": 6.0},
    {"instances": 20, "interval": 30.0, "window": 31.0, "target": "cpu", "phase": "A"},
]


def free_port_block(n: int) -> int:
    """A first port such that first..first+n-1 are all free on 127.0.0.1 now."""
    for _ in range(200):
        first = random.randrange(20000, 60000 - n)
        socks = []
        try:
            for port in range(first, first + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports")


def run_one(instances: int, interval: float, window: float, workdir: Path, target: str | None = None,
            kernel: str = "auto") -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    first = free_port_block(instances)
    ports = list(range(first, first + instances))
    record = workdir / "standin-posts.json"
    standin = subprocess.Popen([str(TEST_PYTHON), "-m", "bench.standin", "--ports", f"{ports[0]}-{ports[-1]}",
                                "--record", str(record)], cwd=SRC, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    daemon = None
    try:
        line = standin.stdout.readline() if standin.stdout else ""
        if line.strip() != "ready":
            raise RuntimeError(f"stand-in did not start: {line!r} {standin.stderr.read() if standin.stderr else ''}")
        state_dir = workdir / "state"
        config = write_config(workdir / "config.yaml", [
            {"name": f"i{i:03d}", "url": f"http://127.0.0.1:{port}", "probe": {"interval": f"{interval:g}s"},
             "restart": "none", "kernel": kernel} for i, port in enumerate(ports)], state_dir)
        daemon = DaemonProcess(config, state_dir, workdir / "daemon.log")
        started = time.time()
        daemon.start()

        def all_healthy() -> bool:
            insts = daemon.state().get("instances") or {}
            return sum(1 for v in insts.values() if v.get("state") == "healthy") >= instances

        daemon.wait_until(all_healthy, timeout=120 + instances * 0.5, what=f"{instances} instances healthy", poll=0.25)
        # One more interval: every instance's schedule is past its first probe and startup work.
        time.sleep(min(interval, 5.0) + 1.0)
        warm_cpu = daemon.cpu_seconds()
        warm_s = time.time() - started
        w0, c0 = time.time(), daemon.cpu_seconds()
        rss = []
        while time.time() < w0 + window:
            rss.append(daemon.rss())
            time.sleep(min(1.0, max(0.0, w0 + window - time.time())))
        w1, c1 = time.time(), daemon.cpu_seconds()
        rss.append(daemon.rss())
        alive = daemon.alive()
        code = daemon.stop()
        daemon_log = daemon.log_text()
    finally:
        if daemon is not None and daemon.alive():
            daemon.stop()
        standin_cpu = None
        try:
            import psutil
            t = psutil.Process(standin.pid).cpu_times()
            standin_cpu = t.user + t.system
        except Exception:
            pass
        standin.terminate()
        try:
            standin.wait(30)
        except subprocess.TimeoutExpired:
            standin.kill()
            standin.wait(10)
    recorded = json.loads(record.read_text())
    out = analyse(instances, interval, ports, recorded["posts"], w0, w1, c1 - c0, max(rss), rss[-1], warm_s, warm_cpu,
                  alive and code == 0, daemon_log, standin_cpu, target)
    out["split"] = split_gaps(interval, recorded.get("requests") or [], w0, w1)
    return out


def split_gaps(interval: float, requests: list, w0: float, w1: float) -> dict[str, Any]:
    """Where a gap's excess comes from. A check is the generation request and its two endpoint
    requests, sent together: its server-side span is from the first arrival to the last answer
    finished; its turnaround is from that last answer to the next check's generation request
    (the daemon's sleep of interval x U(0.9, 1.1), plus whatever the daemon itself took)."""
    by_port: dict[int, list[tuple[str, float, float]]] = {}
    for port, kind, arrival, done in requests:
        by_port.setdefault(port, []).append((kind, arrival, done))
    spans, turnarounds = [], []
    for reqs in by_port.values():
        posts = sorted(a for k, a, _ in reqs if k == "post")
        if not posts:
            continue
        checks: dict[float, list[tuple[float, float]]] = {p: [] for p in posts}
        for _kind, arrival, done in reqs:
            nearest = min(posts, key=lambda p: abs(p - arrival))
            if abs(nearest - arrival) < 0.45 * interval:
                checks[nearest].append((arrival, done))
        ordered = sorted(checks.items())
        for (_, rs), (p_next, _) in itertools.pairwise(ordered):
            if not rs or not (w0 <= p_next <= w1):
                continue
            start, end = min(a for a, _ in rs), max(d for _, d in rs)
            spans.append(end - start)
            turnarounds.append(p_next - end)
    return {
        "checks": len(spans),
        "server_span_s": {"p50": quantile(spans, 0.5), "p99": quantile(spans, 0.99), "max": max(spans) if spans else None},
        "turnaround_over_interval": {"p50": (quantile(turnarounds, 0.5) or 0) / interval if turnarounds else None,
                                     "p99": (quantile(turnarounds, 0.99) or 0) / interval if turnarounds else None,
                                     "max": max(turnarounds) / interval if turnarounds else None},
    }


def analyse(instances: int, interval: float, ports: list[int], posts: list, w0: float, w1: float, cpu: float,
            rss_max: int, rss_end: int, warm_s: float, warm_cpu: float, clean: bool, daemon_log: str,
            standin_cpu: float | None, target: str | None) -> dict[str, Any]:
    by_port: dict[int, list[float]] = {p: [] for p in ports}
    for port, at in posts:
        by_port.setdefault(port, []).append(at)
    gaps: list[float] = []
    counts = []
    skipped_gaps = 0
    instances_without_probe = 0
    worst_instance_gap = 0.0
    for port in ports:
        times = sorted(by_port.get(port, []))
        inside = [t for t in times if w0 <= t <= w1]
        counts.append(len(inside))
        if not inside:
            instances_without_probe += 1
        before = [t for t in times if t < w0]
        seq = ([before[-1]] if before else []) + inside
        for a, b in itertools.pairwise(seq):
            gaps.append(b - a)
            worst_instance_gap = max(worst_instance_gap, b - a)
            if b - a > SKIP_FACTOR * interval:
                skipped_gaps += 1
        # a silence from the last probe to the window's end counts too
        if seq and w1 - seq[-1] > SKIP_FACTOR * interval:
            skipped_gaps += 1
    minutes = (w1 - w0) / 60.0
    per_min = [c / minutes for c in counts]
    p99 = quantile(gaps, 0.99)
    p50 = quantile(gaps, 0.5)
    beyond = (p99 / interval - (1 + JITTER)) if p99 is not None else None
    cpu_pct = 100.0 * cpu / (w1 - w0)
    out = {
        "instances": instances, "interval_s": interval, "window_s": round(w1 - w0, 2), "target": target,
        "daemon_cpu_pct": round(cpu_pct, 3), "daemon_cpu_s": round(cpu, 3),
        "rss_mb_max": round(rss_max / 1024**2, 1), "rss_mb_end": round(rss_end / 1024**2, 1),
        "warmup_s": round(warm_s, 1), "warmup_cpu_s": round(warm_cpu, 2),
        "standin_cpu_s_total": round(standin_cpu, 2) if standin_cpu is not None else None,
        "probes_per_instance_per_min": {"planned": round(60.0 / interval, 2), **summary(per_min)},
        "gaps": {"n": len(gaps), "p50_s": p50, "p99_s": p99, "max_s": max(gaps) if gaps else None,
                 "p99_over_interval": p99 / interval if p99 else None,
                 "p99_beyond_jitter_pct": round(100 * beyond, 2) if beyond is not None else None},
        "skipped_gaps": skipped_gaps, "instances_without_probe": instances_without_probe,
        "daemon_exit_clean": clean,
        "daemon_log_errors": [l for l in daemon_log.splitlines() if " ERROR " in l or "Traceback" in l][:20],
    }
    on_schedule = (beyond is not None and beyond <= TARGET_BEYOND_JITTER and skipped_gaps == 0
                   and instances_without_probe == 0)
    out["on_schedule"] = on_schedule
    return out


def run(workdir: Path, quick: bool = False, only: set[int] | None = None) -> list[dict[str, Any]]:
    results = []
    for i, spec in enumerate(QUICK_RUNS if quick else RUNS):
        if only is not None and i not in only:
            continue
        log(f"scale: {spec['instances']} instance(s) @ {spec['interval']:g}s, window {spec['window']:g}s")
        res = run_one(spec["instances"], spec["interval"], spec["window"],
                      workdir / f"scale-{spec['instances']}x{spec['interval']:g}s", spec.get("target"))
        log(f"scale: {spec['instances']} @ {spec['interval']:g}s: cpu {res['daemon_cpu_pct']:.2f}%, "
            f"rss {res['rss_mb_max']} MB, probes/min {res['probes_per_instance_per_min']['median']:.1f} "
            f"(planned {res['probes_per_instance_per_min']['planned']}), p99 gap {res['gaps']['p99_s']:.3f}s "
            f"({res['gaps']['p99_beyond_jitter_pct']:+.1f}% beyond jitter), skipped {res['skipped_gaps']}")
        results.append(res)
    return results


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", type=int, nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-scale-") as tmp:
        print(json.dumps(run(Path(tmp), args.quick, set(args.only) if args.only is not None else None), indent=1))
