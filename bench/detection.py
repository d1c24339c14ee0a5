"""Benchmark: mlxwatch against the common workaround, on the real mlx_lm.server.

The workaround (from the public report): a 4-token probe every 5 minutes, hard restart on the
first failure. mlxwatch's defaults: probe every 30 s, 45 s first-token limit, a confirming
probe 10 s after a failure, verdict after 2 failures, grace while progress is visible.

Both run here at 1/30 of real time against the same lab server (tiny model, CPU), with each
fault switched on at a random moment of the prober's schedule. Reported per fault: the median
detection latency of each, their ratio, and the median scaled back to real seconds; and, with a
slow server processing a long prompt, how many restarts each would have ordered (all false).

    python bench/detection.py [--trials 5] [--python /path/to/server/python] [--out bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mlxwatch.config import CaptureConfig, Config, InstanceConfig, ProbeConfig, RestartConfig
from mlxwatch.lab.server import LabServer, server_version
from mlxwatch.probes import probe_generation
from mlxwatch.watchdog.daemon import Daemon
from mlxwatch.watchdog.journal import Journal

SCALE = 30.0
CRON_PERIOD, CRON_TIMEOUT = 300.0 / SCALE, 45.0 / SCALE
MLXWATCH = ProbeConfig(interval=30.0 / SCALE, suspect_interval=10.0 / SCALE, first_token_timeout=45.0 / SCALE,
                       timeout=90.0 / SCALE, failures=2, grace_ceiling=600.0 / SCALE, endpoint_timeout=1.0)
FAULTS = ("spin", "block", "die")


async def cron_detection(server: LabServer, fault: str, client: httpx.AsyncClient) -> float:
    """The workaround: probe every CRON_PERIOD; the first failure is the verdict."""
    start = time.monotonic()
    switch_at = start + random.uniform(0, CRON_PERIOD)
    tick = 0
    while True:
        now = time.monotonic()
        if now >= switch_at and not server.fault_file.read_text():
            server.set_fault(fault)
        target = start + tick * CRON_PERIOD
        if target > now:
            await asyncio.sleep(min(target, max(switch_at, now)) - now if switch_at > now else target - now)
            continue
        tick += 1
        result = await probe_generation(client, server.url, first_token_timeout=CRON_TIMEOUT,
                                        timeout=CRON_TIMEOUT * 2, max_tokens=4)
        if not result.ok and time.monotonic() >= switch_at:
            return time.monotonic() - switch_at


async def mlxwatch_detection(server: LabServer, fault: str, state_dir: Path) -> float:
    """The real daemon (restart none: we only time the verdict)."""
    inst = InstanceConfig("bench", server.url, server.log_path, server.pid_file, MLXWATCH, RestartConfig())
    config = Config(None, (inst,), state_dir, (), CaptureConfig(snapshots=1, spacing=0.2, ceiling=10.0))
    stop = asyncio.Event()
    daemon = Daemon(config, state_dir)
    task = asyncio.create_task(daemon.run(stop))
    journal = Journal(state_dir)
    try:
        while not (daemon.instance_state("bench").get("last_probe") or {}).get("ok"):
            await asyncio.sleep(0.05)
        await asyncio.sleep(random.uniform(0, MLXWATCH.interval))
        switch_at = time.time()
        server.set_fault(fault)
        while True:
            verdicts = [r for r in journal.records() if r.get("event") == "verdict"]
            if verdicts:
                return verdicts[0]["detected_at"] - switch_at
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task


async def false_restarts(server: LabServer, state_dir: Path, client: httpx.AsyncClient) -> dict[str, int]:
    """A slow server prefilling a long prompt: verdicts each prober would have ordered."""
    server.set_fault("slow", 0.5)
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 60)
    inst = InstanceConfig("bench", server.url, server.log_path, server.pid_file, MLXWATCH, RestartConfig())
    config = Config(None, (inst,), state_dir, (), CaptureConfig(snapshots=1, spacing=0.2, ceiling=10.0))
    stop = asyncio.Event()
    daemon_task = asyncio.create_task(Daemon(config, state_dir).run(stop))
    long_request = asyncio.create_task(client.post(f"{server.url}/v1/chat/completions", timeout=600,
                                                   json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 2}))
    cron = 0
    while not long_request.done():
        result = await probe_generation(client, server.url, first_token_timeout=CRON_TIMEOUT, timeout=CRON_TIMEOUT * 2)
        cron += 0 if result.ok else 1
        await asyncio.sleep(CRON_PERIOD / 4)  # sampled more often than cron would: every failure is a false restart
    stop.set()
    await daemon_task
    verdicts = [r for r in Journal(state_dir).records() if r.get("event") == "verdict"]
    return {"cron_failed_probes": cron, "mlxwatch_verdicts": len(verdicts)}


async def main_async(args) -> dict:
    results: dict = {"server": f"mlx-lm {server_version(args.python)}", "scale": SCALE, "faults": {}}
    with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-") as tmp:
        root = Path(tmp)
        server = LabServer.start(args.python, root / "server")
        try:
            async with httpx.AsyncClient(trust_env=False) as client:
                for fault in FAULTS:
                    cron, ours = [], []
                    for trial in range(args.trials):
                        server.relaunch()
                        cron.append(await cron_detection(server, fault, client))
                        server.relaunch()
                        ours.append(await mlxwatch_detection(server, fault, root / f"state-{fault}-{trial}"))
                    results["faults"][fault] = _summary(cron, ours)
                    print(f"{fault:6} cron median {results['faults'][fault]['cron_median_s']:.2f}s, "
                          f"mlxwatch median {results['faults'][fault]['mlxwatch_median_s']:.2f}s, "
                          f"ratio {results['faults'][fault]['ratio']:.2f}", flush=True)
                server.relaunch()
                results["false_restarts_during_long_prefill"] = await false_restarts(server, root / "state-slow", client)
        finally:
            server.stop()
    return results


def _summary(cron: list[float], ours: list[float]) -> dict:
    c, m = statistics.median(cron), statistics.median(ours)
    return {"trials": len(cron), "cron_median_s": c, "mlxwatch_median_s": m, "ratio": m / c,
            "cron_real_median_s": c * SCALE, "mlxwatch_real_median_s": m * SCALE,
            "cron_runs": cron, "mlxwatch_runs": ours}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--python", default=sys.executable, help="interpreter with mlx-lm for the server")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"detection-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "faults"}, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
