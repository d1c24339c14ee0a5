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

Run::

    python -m bench.front_detection --trials 3 --soak 120
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import TEST_PYTHON, DaemonProcess, log, summary, write_config
from lab.ports import free_port
from lab.server import CLI as LAB_CLI
from lab.server import LabServer, server_version
from mlxwatch.config import FrontConfig

FAULTS = ("spin", "block")
GOAL = 30.0  # seconds, median onset -> verdict with traffic through the door
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
        rec: dict[str, Any] = {"sent": time.time(), "tokens": 0}
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "stream": True,
                "temperature": 0.0}
        try:
            with httpx.Client(trust_env=False, timeout=300) as client, \
                    client.stream("POST", f"{self.url}/v1/chat/completions", json=body) as r:
                rec["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data:") and '"error"' in line:
                        rec["error"] = line[:200]
                    elif line.startswith("data:") and '"content"' in line:
                        rec["tokens"] += 1
        except httpx.HTTPError as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"
        rec["ended"] = time.time()
        rec["kind"] = ("error" if rec.get("error") or rec.get("status") != 200
                       else "ok" if rec["tokens"] else "empty")
        with self.lock:
            self.results.append(rec)

    def answered_since(self, t: float) -> bool:
        with self.lock:
            return any(r["kind"] == "ok" and r["sent"] >= t for r in self.results)


def start_daemon(server: LabServer, workdir: Path) -> tuple[DaemonProcess, str]:
    port = free_port()
    inst = {"name": "lab", "url": server.url, "log": str(server.log_path), "pid_file": str(server.pid_file),
            "restart": {"command": [str(TEST_PYTHON), str(LAB_CLI), "relaunch", str(server.workdir)],
                        "timeout": "120s", "backoff": "1s", "window": "1s", "budget": 100},
            "front": {"listen": f"127.0.0.1:{port}"}}  # every other probe and front setting: its default
    cfg = write_config(workdir / "config.yaml", [inst], workdir / "state")
    daemon = DaemonProcess(cfg, workdir / "state", workdir / "daemon.log")
    daemon.start()
    return daemon, f"http://127.0.0.1:{port}"


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


def slow_soak(python: str, workdir: Path, duration: float) -> dict[str, Any]:
    server = LabServer.start(python, workdir / "server")
    daemon, door = start_daemon(server, workdir / "daemon")
    client = OpenLoopClient(door, every=2.0, long_prompts=True)
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
        states = daemon.instance_state("lab").get("state")
    finally:
        client.close()
        daemon.stop()
        server.refresh()
        server.stop()
    return {"mlx_lm": server_version(python), "duration_s": duration, "slow_step_s": SLOW_STEP,
            "verdicts": len(verdicts), "state_at_end": states, "clients": _client_summary(client.results),
            "pass": not verdicts}


def _client_summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    return {"requests": len(results), "ok": sum(r["kind"] == "ok" for r in results),
            "errors": sum(r["kind"] == "error" for r in results), "empty": sum(r["kind"] == "empty" for r in results),
            "seconds": summary(r["ended"] - r["sent"] for r in results)}


if __name__ == "__main__":
    import argparse
    import json
    import sys
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=5, help="trials per fault (default 5)")
    parser.add_argument("--soak", type=float, default=600, help="seconds of the slow soak (default 600; 0: skip)")
    parser.add_argument("--python", default=str(TEST_PYTHON), help="the server's Python (its mlx-lm version)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-front-") as tmp:
        result = {"detection": detection(args.python, Path(tmp) / "detection", args.trials)}
        if args.soak > 0:
            result["slow_soak"] = slow_soak(args.python, Path(tmp) / "soak", args.soak)
    print(json.dumps(result, indent=1, default=str))
    sys.exit(0 if all(part["pass"] for part in result.values()) else 1)
