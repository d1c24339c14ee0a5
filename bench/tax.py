"""Probe tax: what the watchdog's probes cost a real server's users.

One real ``mlx_lm.server`` (the newest 0.32.x, tiny model, CPU). A trial is one long streamed
generation (``TOKENS`` tokens); its tokens/s (tokens after the first / time from the first to the
last) and its inter-token gaps (p99, max) are measured by the client. Conditions: no watchdog,
``mlxwatch run`` probing every 1 s, and every 30 s, each trial in a shuffled order (every
condition ``reps`` times). A daemon is started before its trial and left to settle (its first
probe done), then the generation starts after a random part of the interval, so that probes
land at a random phase; the probes that landed inside the generation are counted from the
server's access log (``POST /v1/chat/completions`` lines, less the generation's own).
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import DaemonProcess, log, quantile, summary, write_config
from lab.server import LabServer, server_version

TOKENS = 3500
CONDITIONS = ("none", "1s", "30s")


def generate(url: str) -> dict[str, Any]:
    arrivals: list[float] = []
    body = {"messages": [{"role": "user", "content": "write"}], "max_tokens": TOKENS, "stream": True}
    t0 = time.monotonic()
    with httpx.Client(trust_env=False, timeout=300) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"content"' in line:
                    arrivals.append(time.monotonic())
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else None
    return {"tokens": len(arrivals), "ttft_s": arrivals[0] - t0 if arrivals else None,
            "tokens_per_s": (len(arrivals) - 1) / span if span else None,
            "gap_p50_ms": 1000 * quantile(gaps, 0.5) if gaps else None,
            "gap_p99_ms": 1000 * quantile(gaps, 0.99) if gaps else None,
            "gap_max_ms": 1000 * max(gaps) if gaps else None,
            "duration_s": time.monotonic() - t0}


def _posts(log_path: Path, start: int) -> int:
    with open(log_path, "rb") as fh:
        fh.seek(start)
        return fh.read().decode("utf-8", "replace").count("POST /v1/chat/completions")


def run(python: str, workdir: Path, reps: int) -> dict[str, Any]:
    version = server_version(python)
    server = LabServer.start(python, workdir / "server")
    order = [c for c in CONDITIONS for _ in range(reps)]
    random.shuffle(order)
    trials = []
    try:
        generate(server.url)  # warm: the first generation pays for compiling and caches
        for i, cond in enumerate(order):
            daemon = None
            if cond != "none":
                interval = float(cond[:-1])
                d = workdir / f"daemon-{i}"
                cfg = write_config(d / "config.yaml", [{
                    "name": "tax", "url": server.url, "log": str(server.log_path), "pid_file": str(server.pid_file),
                    "probe": {"interval": cond}, "restart": "none"}], d / "state")
                daemon = DaemonProcess(cfg, d / "state", d / "daemon.log")
                daemon.start()
                daemon.wait_until(lambda: daemon.instance_state("tax").get("state") == "healthy",  # noqa: B023  called here
                                  60, "tax healthy")
                time.sleep(random.uniform(0, interval))
            else:
                time.sleep(1.0)
            start = server.log_path.stat().st_size
            res = generate(server.url)
            res["probes_inside"] = max(0, _posts(server.log_path, start) - 1)
            res["condition"] = cond
            if daemon is not None:
                daemon.stop()
            trials.append(res)
            log(f"tax #{i + 1}/{len(order)} {cond}: {res['tokens_per_s']:.0f} tok/s, p99 gap {res['gap_p99_ms']:.2f} ms, "
                f"max {res['gap_max_ms']:.1f} ms, {res['probes_inside']} probe(s) inside")
    finally:
        server.stop()
    by = {c: [t for t in trials if t["condition"] == c] for c in CONDITIONS}
    table = {c: {"tokens_per_s": summary(t["tokens_per_s"] for t in ts),
                 "gap_p99_ms": summary(t["gap_p99_ms"] for t in ts),
                 "gap_max_ms": summary(t["gap_max_ms"] for t in ts),
                 "probes_inside": summary(t["probes_inside"] for t in ts)} for c, ts in by.items()}
    return {"mlx_lm": version, "tokens": TOKENS, "reps": reps, "order": order, "trials": trials, "table": table}


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    from bench.common import TEST_PYTHON

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-tax-") as tmp:
        print(json.dumps(run(str(TEST_PYTHON), Path(tmp), args.reps)["table"], indent=1))
