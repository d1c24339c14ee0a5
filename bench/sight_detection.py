"""Kernel sight at the DEFAULT settings, without the front door and without the shim: onset ->
verdict with an app streaming and with no client traffic at all, and a slow soak.

One real ``mlx_lm.server`` (tiny model, CPU; ``tests/lab``) and one ``mlxwatch run`` daemon
process pointed at its URL with every probe setting at its default (only the lab's relaunch
hook as the ``command:`` restart is set; the restart budget is raised so that trials do not
give up), as most users run it. The app (``bench.front_detection.OpenLoopClient``, in this
process: someone else's to the daemon) sends a new streaming request every 2 s.

Detection (``--trials`` per fault and traffic): wait until the instance is healthy (and, with
the app, answering), wait a random part of the probe interval (no traffic: the next probe is
what finds it) or of the kernel's 5 s reading period (with the app), switch the fault on (the
onset) and read the daemon's journal for the verdict. Faults: ``spin`` (livelock), ``block``,
``gil`` (wedged: a native call holds the GIL). Goals: median <= 30 s with the app, <= 45 s with
no traffic (the cron probe: 195 s; the front door: about 21 s, "The front door at the defaults").

Slow soak (``--soak`` seconds): the server made slow (the lab's ``slow`` fault, 1 s a batch
step) with long prompts streamed straight to it every 2 s: expect 0 verdicts.

Writes ``bench/sight_detection.json`` and the section "Kernel sight at the defaults" of
``bench/RESULTS.md``. Run::

    python -m bench.sight_detection                                  # the record
    python -m bench.sight_detection --trials 1 --soak 60 --no-write   # a quick look
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

from bench.analysis import CRON_PERIOD, CRON_TIMEOUT
from bench.common import (
    OLD_PYTHON,
    ROOT,
    TEST_PYTHON,
    add_record_options,
    fmt_mmm,
    log,
    record,
    run_header,
    summary,
)
from bench.front_detection import OpenLoopClient, _client_summary, events, slow_soak, start_daemon
from lab.server import LabServer, server_version
from mlxwatch.config import ProbeConfig

FAULTS = ("spin", "block", "gil")
NAMES = {"spin": "livelock (spin)", "block": "blocked", "gil": "wedged (GIL held)"}
GOALS = {"app": 30.0, "quiet": 45.0}  # median onset -> verdict, seconds
CRON_MEDIAN = CRON_PERIOD / 2 + CRON_TIMEOUT
SECTION = "## Kernel sight at the defaults: detection without the door, and the slow soak"
KERNEL_PERIOD = 5.0  # the kernel source's reading period while healthy (evidence/kernel.py POLL_HEALTHY)
VERDICT_WAIT = 240.0
RECOVERY_WAIT = 240.0


def detection(python: str, workdir: Path, trials: int, traffic: str) -> dict[str, Any]:
    server = LabServer.start(python, workdir / "server")
    daemon, url = start_daemon(server, workdir / "daemon", front=False)
    client = OpenLoopClient(url, every=2.0) if traffic == "app" else None
    out: dict[str, list[dict[str, Any]]] = {f: [] for f in FAULTS}
    try:
        daemon.wait_until(lambda: daemon.instance_state("lab").get("state") == "healthy", 180, "healthy")
        if client:
            client.start()
        for trial in range(trials):
            for fault in FAULTS:
                ready = time.time()
                daemon.wait_until(lambda ready=ready: daemon.instance_state("lab").get("state") == "healthy"
                                  and (client is None or client.answered_since(ready)), RECOVERY_WAIT, "healthy")
                time.sleep(random.uniform(0, KERNEL_PERIOD if client else ProbeConfig.interval))
                server.refresh()
                onset = time.time()
                server.set_fault(fault)
                daemon.wait_until(lambda onset=onset: events(daemon, "verdict", onset), VERDICT_WAIT, f"{fault}: verdict")
                verdict = events(daemon, "verdict", onset)[0]
                daemon.wait_until(lambda onset=onset: events(daemon, "recovered", onset), RECOVERY_WAIT,
                                  f"{fault}: recovered")
                seconds = round(verdict["detected_at"] - onset, 1)
                out[fault].append({"trial": trial, "onset_to_verdict_s": seconds, "failures": verdict.get("failures"),
                                   "stall": bool(events(daemon, "kernel_stall", onset))})
                log(f"sight detection {traffic} {fault} trial {trial}: verdict {seconds}s after onset")
    finally:
        if client:
            client.close()
        daemon.stop()
        server.refresh()
        server.stop()
    result: dict[str, Any] = {"mlx_lm": server_version(python), "traffic": traffic, "trials": out}
    if client:
        result["clients"] = _client_summary(client.results)
    for fault in FAULTS:
        result[fault] = summary(t["onset_to_verdict_s"] for t in out[fault])
    result["pass"] = all(result[f]["median"] is not None and result[f]["median"] <= GOALS[traffic] for f in FAULTS)
    return result


def section(data: dict[str, Any]) -> str:
    m = data["machine"]
    door = _door_median()
    lines = [SECTION, "",
             f"`python -m bench.sight_detection` (`bench/sight_detection.py`), run on {data['started_at'][:10]} "
             f"from commit {data['commit']} on {m['cpus']} cores ({m['cpu']}), load average at the start "
             f"{data['load_average'][0]}; other work ran on the machine at times. One real server and one "
             "`mlxwatch run` daemon as its own process pointed at the server's URL, every probe setting at its "
             "**default**, no front door, no shim (only the lab's relaunch hook as the `command:` restart). With "
             "**the app**: a new streaming request straight to the server every 2 s (httpx, its own connections); "
             "**no traffic**: nothing but the daemon's probes. Times from the daemon's journal.", "",
             "| mlx-lm | traffic | fault | n | onset → verdict, s, median (min–max) | goal | |",
             "|---|---|---|---|---|---|---|"]
    for run in data["detection"]:
        for fault in FAULTS:
            s = run[fault]
            goal = GOALS[run["traffic"]]
            met = s.get("median") is not None and s["median"] <= goal
            lines.append(f"| {run['mlx_lm']} | {'the app' if run['traffic'] == 'app' else 'none'} | {NAMES[fault]} | "
                         f"{s['n']} | {fmt_mmm(s)} | ≤ {goal:g} s | {'met' if met else '**missed**'} |")
    lines += ["", f"Side by side: the cron probe (a 4-token request every {CRON_PERIOD:.0f} s, {CRON_TIMEOUT:.0f} s "
              f"timeout) takes {CRON_MEDIAN:.0f} s at the median; the front door at the defaults "
              f"{'about ' + format(door, '.0f') + ' s' if door else 'about 21 s'} (\"The front door at the "
              "defaults\"); before kernel sight, the daemon's probes alone took 147–153 s measured (115 s "
              "computed, \"Detection and recovery\")."]
    for run in data["detection"]:
        c = run.get("clients")
        if c:
            lines.append(f"\nThe app ({run['mlx_lm']}): {c['requests']} requests, {c['ok']} answered, "
                         f"{c['errors']} errors, {c['empty']} empty.")
    soak = data.get("slow_soak")
    if soak:
        c = soak["clients"]
        lines += ["", f"**Slow soak** ({soak['mlx_lm']}): {soak['duration_s'] / 60:.0f} minutes with the server made "
                  f"slow (the lab's `slow` fault, {soak['slow_step_s']:g} s added to every batch step, "
                  "`--prefill-step-size 64`) and a long prompt streamed straight to it every 2 s: "
                  f"**{soak['verdicts']} verdicts** (goal 0: {'met' if soak['pass'] else '**missed**'}), "
                  f"{soak['slow_episodes']} `slow` episode(s) journaled, state at the end `{soak['state_at_end']}`; "
                  f"{c['requests']} requests, {c['ok']} answered, {c['errors']} errors, each taking "
                  f"{fmt_mmm(c['seconds'])} s."]
    return "\n".join(lines) + "\n"


def _door_median() -> float | None:
    try:
        run = json.loads((ROOT / "bench" / "front_detection.json").read_text())["detection"]
    except (OSError, ValueError, KeyError):
        return None
    medians = [r[f]["median"] for r in run.values() for f in ("spin", "block") if r.get(f, {}).get("median")]
    return sorted(medians)[len(medians) // 2] if medians else None


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.sight_detection", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="trials per fault and traffic (default 3)")
    parser.add_argument("--soak", type=float, default=600, help="seconds of the slow soak (default 600; 0: skip)")
    parser.add_argument("--pythons", default=f"{OLD_PYTHON},{TEST_PYTHON}",
                        help="the servers' Pythons, comma-separated; no traffic and the soak use the last")
    add_record_options(parser)
    args = parser.parse_args(argv)

    def run() -> dict[str, Any]:
        pythons = [p for p in args.pythons.split(",") if p]
        data = run_header(detection=[])
        with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-sight-") as tmp:
            for n, python in enumerate(pythons):
                data["detection"].append(detection(python, Path(tmp) / f"app-{n}", args.trials, "app"))
            data["detection"].append(detection(pythons[-1], Path(tmp) / "quiet", args.trials, "quiet"))
            if args.soak > 0:
                data["slow_soak"] = slow_soak(pythons[-1], Path(tmp) / "soak", args.soak, front=False,
                                              extra_args=("--prefill-step-size", "64"))
        data["pass"] = all(r["pass"] for r in data["detection"]) and data.get("slow_soak", {}).get("pass", True)
        return data

    return record("sight_detection", args, run, SECTION, section)


if __name__ == "__main__":
    import sys

    sys.exit(main())
