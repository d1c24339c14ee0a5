"""The front door at the DEFAULT settings: onset -> verdict with client traffic, and a slow soak.

One real ``mlx_lm.server`` (tiny model, CPU; ``tests/lab``) and one ``mlxwatch run`` daemon
process watching it with every probe and front setting at its default (only ``front.listen``
and the lab's relaunch hook as the ``command:`` restart are set; the restart budget is raised
so that trials do not give up). An open-loop client sends a new streaming request through the
door every second, as a busy app would.

Detection (``--trials`` per fault, ``spin`` = livelock and ``block``): wait until the instance is
healthy and the client was answered, wait a random part of ``front.stall_timeout`` (a random
phase against the door's poll), switch the fault on (the onset) and read the daemon's journal
for the verdict. Goal: median onset -> verdict <= 30 s for each (the probes alone, at the
defaults, take about two minutes).

Slow soak (``--soak`` seconds): the same server made slow (the lab's ``slow`` fault, ``SLOW_STEP``
per batch step) with long prompts streamed through the door: expect 0 verdicts.

Writes ``bench/front_detection.json`` and the section "The front door at the defaults" of
``bench/RESULTS.md`` (``--render FILE`` rewrites the section from a saved JSON). Run::

    python -m bench.front_detection                       # the record: 5 trials per fault and version, 600 s soak
    python -m bench.front_detection --trials 2 --soak 60 --no-write   # a quick look
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.analysis import CRON_PERIOD, CRON_TIMEOUT
from bench.common import (
    OLD_PYTHON,
    TEST_PYTHON,
    add_record_options,
    DaemonProcess,
    fmt_mmm,
    log,
    record,
    run_header,
    summary,
    write_config,
)
from lab.ports import free_port
from lab.server import CLI as LAB_CLI
from lab.server import LabServer, server_version
from mlxwatch.config import FrontConfig

FAULTS = ("spin", "block")
GOAL = 30.0  # seconds, median onset -> verdict with traffic through the door
CRON_MEDIAN = CRON_PERIOD / 2 + CRON_TIMEOUT  # the cron probe on a hang: the next tick after U(0, period), then its timeout
SPEEDUP_GOAL = 6.0  # ... and at least this many times faster than the cron probe
SECTION = "## The front door at the defaults: detection with client traffic, and the slow soak"
VERDICT_WAIT = 180.0  # a trial gives up waiting for its verdict after this
RECOVERY_WAIT = 240.0
SLOW_STEP = 1.0
LONG_PROMPT_WORDS = 300
WORDS = "the quick brown fox jumps over the lazy dog and counts every token the server delivers".split()


class OpenLoopClient:
    """A new streaming request every ``every`` seconds, each in its own thread."""

    def __init__(self, url: str, every: float = 1.0, long_prompts: bool = False) -> None:
        self.url, self.every, self.long_prompts = url, every, long_prompts
        self.stop = threading.Event()
        self.results: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)

    def _run(self) -> None:
        workers = []
        rnd = random.Random(7)
        while not self.stop.wait(self.every):
            words = LONG_PROMPT_WORDS if self.long_prompts else 5
            prompt = " ".join(rnd.choice(WORDS) for _ in range(words))
            t = threading.Thread(target=self._one, args=(prompt,), daemon=True)
            t.start()
            workers.append(t)
            workers = [w for w in workers if w.is_alive()]
        for w in workers:
            w.join(60)

    def _one(self, prompt: str) -> None:
        rec: dict[str, Any] = {"sent": time.time(), "tokens": 0, "finished": False, "done": False, "tail": []}
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "stream": True,
                "temperature": 0.0}
        try:
            with httpx.Client(trust_env=False, timeout=300) as client, \
                    client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                rec["status"] = r.status_code
                for line in r.iter_lines():
                    if line.strip():
                        rec["tail"] = [*rec["tail"][-2:], line[:300]]
                    if line.startswith("data:") and '"error"' in line:
                        rec["error"] = line[:200]
                    elif line.startswith("data:") and '"content"' in line:
                        rec["tokens"] += 1
                    rec["finished"] = rec["finished"] or '"finish_reason": "' in line or '"finish_reason":"' in line
                    rec["done"] = rec["done"] or line.strip() == "data: [DONE]"
        except httpx.HTTPError as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["ended"] = time.time()
        # "empty" is what the SDK takes quietly for a success: a 200 whose stream ended without a
        # finish_reason or [DONE] (an answer that ends at once, with a finish_reason, is complete)
        rec["kind"] = ("error" if rec.get("error") or rec.get("status") != 200
                       else "ok" if rec["finished"] or rec["done"] else "empty")
        with self.lock:
            self.results.append(rec)

    def answered_since(self, t: float) -> bool:
        with self.lock:
            return any(r["kind"] == "ok" and r["sent"] >= t for r in self.results)


def start_daemon(server: LabServer, workdir: Path, front: bool = True) -> tuple[DaemonProcess, str]:
    """``mlxwatch run`` on ``server`` at the defaults (only the lab's relaunch hook, a budget that
    trials do not exhaust and, with ``front``, ``front.listen`` are set); returns the daemon and
    the URL clients use: the door's, or the server's own."""
    inst: dict[str, Any] = {
        "name": "lab", "url": server.url, "log": str(server.log_path), "pid_file": str(server.pid_file),
        "restart": {"command": [str(TEST_PYTHON), str(LAB_CLI), "relaunch", str(server.workdir)],
                    "timeout": "120s", "backoff": "1s", "window": "1s", "budget": 100}}
    url = server.url
    if front:
        port = free_port()
        inst["front"] = {"listen": f"127.0.0.1:{port}"}  # every other probe and front setting: its default
        url = f"http://127.0.0.1:{port}"
    cfg = write_config(workdir / "config.yaml", [inst], workdir / "state")
    daemon = DaemonProcess(cfg, workdir / "state", workdir / "daemon.log")
    daemon.start()
    return daemon, url


def events(daemon: DaemonProcess, name: str, since: float) -> list[dict[str, Any]]:
    return [r for r in daemon.journal() if r.get("event") == name and r.get("ts", 0) >= since]


def detection(python: str, workdir: Path, trials: int) -> dict[str, Any]:
    server = LabServer.start(python, workdir / "server")
    daemon, door = start_daemon(server, workdir / "daemon")
    client = OpenLoopClient(door)
    out: dict[str, list[dict[str, Any]]] = {f: [] for f in FAULTS}
    try:
        daemon.wait_until(lambda: daemon.instance_state("lab").get("state") == "healthy", 180, "healthy")
        client.start()
        for trial in range(trials):
            for fault in FAULTS:
                ready = time.time()
                daemon.wait_until(lambda ready=ready: daemon.instance_state("lab").get("state") == "healthy"
                                  and client.answered_since(ready), RECOVERY_WAIT, "healthy and answering")
                time.sleep(random.uniform(0, FrontConfig.stall_timeout))
                server.refresh()
                onset = time.time()
                server.set_fault(fault)
                daemon.wait_until(lambda onset=onset: events(daemon, "verdict", onset), VERDICT_WAIT, f"{fault}: verdict")
                verdict = events(daemon, "verdict", onset)[0]
                daemon.wait_until(lambda onset=onset: events(daemon, "recovered", onset), RECOVERY_WAIT, f"{fault}: recovered")
                seconds = round(verdict["detected_at"] - onset, 1)
                out[fault].append({"trial": trial, "onset_to_verdict_s": seconds,
                                   "failures": verdict.get("failures")})
                log(f"front detection {fault} trial {trial}: verdict {seconds}s after onset")
    finally:
        client.close()
        daemon.stop()
        server.refresh()
        server.stop()
    result: dict[str, Any] = {"mlx_lm": server_version(python), "trials": out,
                              "clients": _client_summary(client.results)}
    for fault in FAULTS:
        result[fault] = summary(t["onset_to_verdict_s"] for t in out[fault])
    result["pass"] = all(result[f]["median"] is not None and result[f]["median"] <= GOAL for f in FAULTS) \
        and result["clients"]["empty"] == 0
    return result


def slow_soak(python: str, workdir: Path, duration: float, front: bool = True,
              extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """``duration`` s of a server made slow (``SLOW_STEP`` s a batch step) with a long prompt
    streamed every 2 s, through the door or (``front=False``) straight to the server."""
    server = LabServer.start(python, workdir / "server", extra_args=extra_args)
    daemon, url = start_daemon(server, workdir / "daemon", front)
    client = OpenLoopClient(url, every=2.0, long_prompts=True)
    try:
        daemon.wait_until(lambda: daemon.instance_state("lab").get("state") == "healthy", 180, "healthy")
        server.set_fault("slow", SLOW_STEP)
        t0 = time.time()
        client.start()
        while time.time() - t0 < duration:
            time.sleep(1)
            if not daemon.alive():
                raise RuntimeError(f"the daemon exited: {daemon.log_path}")
        verdicts = events(daemon, "verdict", t0)
        slow = events(daemon, "slow", t0)
        state = daemon.instance_state("lab").get("state")
    finally:
        client.close()
        daemon.stop()
        server.refresh()
        server.stop()
    return {"mlx_lm": server_version(python), "duration_s": duration, "slow_step_s": SLOW_STEP,
            "verdicts": len(verdicts), "slow_episodes": len(slow), "state_at_end": state,
            "clients": _client_summary(client.results), "pass": not verdicts}


def _client_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"requests": len(results), "ok": sum(r["kind"] == "ok" for r in results),
            "complete_without_tokens": sum(r["kind"] == "ok" and not r["tokens"] for r in results),
            "empty_examples": [{k: r.get(k) for k in ("status", "tokens", "tail")} for r in results
                               if r["kind"] == "empty" or (r["kind"] == "ok" and not r["tokens"])][:5],
            "errors": sum(r["kind"] == "error" for r in results), "empty": sum(r["kind"] == "empty" for r in results),
            "seconds": summary(r["ended"] - r["sent"] for r in results)}


def section(data: dict[str, Any]) -> str:
    """The RESULTS.md section for one run (``data`` as written to ``bench/front_detection.json``)."""
    m = data["machine"]
    lines = [SECTION, "",
             f"`python -m bench.front_detection` (`bench/front_detection.py`), run on {data['started_at'][:10]} "
             f"from commit {data['commit']} on {m['cpus']} cores ({m['cpu']}), load average at the start "
             f"{data['load_average'][0]}; other work ran on the machine at times. One real server and one "
             "`mlxwatch run` daemon as its own process with every probe and front setting at its **default** "
             "(only `front.listen` and the lab's relaunch hook as the `command:` restart are set); an open-loop "
             "client (httpx) sends a new streaming request through the door every second, as a busy app does. "
             f"Each onset at a random moment of the door's {FrontConfig.stall_timeout:g} s stall window; times "
             "from the daemon's journal.", "",
             "| mlx-lm | fault | n | onset → verdict, s, median (min–max) | cron probe, median | faster than the cron "
             f"| goal: ≤ {GOAL:g} s and ≥ {SPEEDUP_GOAL:g}× |",
             "|---|---|---|---|---|---|---|"]
    for version, run in data["detection"].items():
        for fault in FAULTS:
            s = run[fault]
            ratio = CRON_MEDIAN / s["median"] if s.get("median") else None
            met = s.get("median") is not None and s["median"] <= GOAL and ratio is not None and ratio >= SPEEDUP_GOAL
            name = {"spin": "livelock (spin)", "block": "blocked"}[fault]
            faster = f"{ratio:.1f}×" if ratio else "–"
            lines.append(f"| {version.removeprefix('mlx-lm ')} | {name} | {s['n']} | {fmt_mmm(s)} | "
                         f"{CRON_MEDIAN:.0f} s | {faster} | {'met' if met else '**missed**'} |")
    lines += ["", f"The cron probe is the workaround people deploy (a 4-token request every {CRON_PERIOD:.0f} s "
              f"with a {CRON_TIMEOUT:.0f} s timeout): on a hang its median is {CRON_PERIOD / 2:.0f} + "
              f"{CRON_TIMEOUT:.0f} s (\"Detection and recovery\" above). mlxwatch's probes alone, at the same "
              "defaults, take about two minutes (same section)."]
    for version, run in data["detection"].items():
        c = run["clients"]
        lines.append(f"\nClients through the door ({version}): {c['requests']} requests, {c['ok']} answered, "
                     f"{c['errors']} explicit errors (failed loudly at the verdict, or 503 with Retry-After while "
                     f"the server restarted), **{c['empty']} empty successes** (a 200 ending without finish_reason or "
                     f"[DONE]); {c.get('complete_without_tokens', 0)} of the answered ended complete with no content "
                     "chunk (the tiny random model's output detokenizes to nothing at times).")
    soak = data.get("slow_soak")
    if soak:
        c = soak["clients"]
        lines += ["", f"**Slow soak** ({soak['mlx_lm']}): {soak['duration_s'] / 60:.0f} minutes of the same setup "
                  f"with the server made slow (the lab's `slow` fault, {soak['slow_step_s']:g} s added to every batch "
                  f"step) and a {LONG_PROMPT_WORDS}-word prompt streamed through the door every 2 s: "
                  f"**{soak['verdicts']} verdicts** (goal 0: {'met' if soak['pass'] else '**missed**'}), state at the "
                  f"end `{soak['state_at_end']}`; {c['requests']} requests, {c['ok']} answered, {c['errors']} errors, "
                  f"{c['empty']} empty, each taking {fmt_mmm(c['seconds'])} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.front_detection", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="trials per fault and version (default 5)")
    parser.add_argument("--soak", type=float, default=600, help="seconds of the slow soak (default 600; 0: skip)")
    parser.add_argument("--pythons", default=f"{OLD_PYTHON},{TEST_PYTHON}",
                        help="the servers' Pythons (their mlx-lm versions), comma-separated; the soak uses the last")
    add_record_options(parser)
    args = parser.parse_args(argv)

    def run() -> dict[str, Any]:
        pythons = [p for p in args.pythons.split(",") if p]
        data = run_header(detection={})
        with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-front-") as tmp:
            for n, python in enumerate(pythons):
                result = detection(python, Path(tmp) / f"detection-{n}", args.trials)
                data["detection"][f"mlx-lm {result['mlx_lm']}"] = result
            if args.soak > 0:
                data["slow_soak"] = slow_soak(pythons[-1], Path(tmp) / "soak", args.soak)
        data["pass"] = all(r["pass"] for r in data["detection"].values()) and data.get("slow_soak", {}).get("pass", True)
        return data

    return record("front_detection", args, run, SECTION, section)


if __name__ == "__main__":
    import sys

    sys.exit(main())
