"""Slow is not hung: a real server made slow under long prompts, then made to hang.

One real ``mlx_lm.server`` (the newest 0.32.x, tiny model, CPU) with a small
``--prefill-step-size`` and the lab's ``slow`` fault at ``SLOW_STEP`` (>= 1 s) per batch step,
kept busy by ``CLIENTS`` clients that each send a long prompt and stream a long answer, again
and again. ``mlxwatch run`` watches it at the detection benchmark's FAST config (first-token
limit 2 s, the log followed, the lab's relaunch hook as its restart). Its probes miss their
deadline most of the time (measured: the first token comes 2-4 s after a probe is sent), but
their tokens do arrive, on the stream mlxwatch keeps reading.

Phase 1 (``--duration``, 600 s for the record): expect 0 verdicts, and ``slow`` reported (the
journal's ``slow`` record; the state file's state). Phase 2: the clients stop, the same server
is made to hang (``block``): expect a verdict within the policy's bound for a server that was
slow (``hang_bound``: the window of failures starts over at the probe that saw the last
delivery, so one probe more than from healthy). Run::

    python -m bench.slow_soak --duration 120
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import TEST_PYTHON, DaemonProcess, log, summary, write_config
from bench.detection import FAST
from lab.server import CLI as LAB_CLI
from lab.server import LabServer, server_version

PREFILL_STEP = 32
SLOW_STEP = 1.0  # seconds added to every batch step
CLIENTS = 2  # two long prompts in flight, as in the field report
PROMPT_WORDS = (300, 500)
ANSWER_TOKENS = 40  # a long answer: most of the time is decoding, where nothing logs progress
WORDS = ("the quick brown fox jumps over the lazy dog mlxwatch sends a short probe and counts delivered "
         "tokens a server that answers models but never generates is not healthy").split()
HANG_WAIT = 120.0  # how long phase 2 waits for the verdict at most


def hang_bound(p: dict[str, Any]) -> float:
    """Worst case from the hang to the verdict for a server that was slow: the probe in flight
    (its deadline), then ``failures`` more probes (the first of the new window may still see
    the last delivery), each after a jittered suspect interval, plus the time a loaded
    machine adds (3 s, as the real-server tests allow)."""
    step = min(p["interval"], p["suspect_interval"]) * 1.1 + p["first_token_timeout"]
    return p["timeout"] + (p["failures"] + 1) * step + 3.0


def client_loop(url: str, stop: threading.Event, out: list[dict[str, Any]], seed: int) -> None:
    rnd = random.Random(seed)
    with httpx.Client(trust_env=False, timeout=900) as client:
        while not stop.is_set():
            prompt = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(*PROMPT_WORDS)))
            rec: dict[str, Any] = {"start": time.time()}
            try:
                with client.stream("POST", f"{url}/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": prompt}],
                                         "max_tokens": ANSWER_TOKENS, "stream": True, "temperature": 0.0}) as r:
                    rec["status"] = r.status_code
                    rec["tokens"] = sum(1 for line in r.iter_lines() if line.startswith("data:") and '"content"' in line)
            except httpx.HTTPError as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["seconds"] = time.time() - rec["start"]
            out.append(rec)


def events(d: DaemonProcess, name: str, since: float = 0.0) -> list[dict[str, Any]]:
    return [r for r in d.journal() if r.get("event") == name and r.get("ts", 0) >= since]


def run(python: str, workdir: Path, duration: float) -> dict[str, Any]:
    version = server_version(python)
    server = LabServer.start(python, workdir / "server", extra_args=("--prefill-step-size", str(PREFILL_STEP)))
    probe = {k: (f"{v:g}s" if k != "failures" else v) for k, v in FAST.items()}
    inst = {"name": "slow", "url": server.url, "log": str(server.log_path), "pid_file": str(server.pid_file),
            "probe": probe, "restart": {"command": [str(TEST_PYTHON), str(LAB_CLI), "relaunch",
                                                    str(server.workdir)], "timeout": "120s", "backoff": "1s"}}
    cfg = write_config(workdir / "daemon" / "config.yaml", [inst], workdir / "daemon" / "state")
    daemon = DaemonProcess(cfg, workdir / "daemon" / "state", workdir / "daemon" / "daemon.log")
    stop = threading.Event()
    clients: list[dict[str, Any]] = []
    threads: list[threading.Thread] = []
    states: dict[str, int] = {}
    try:
        daemon.start()
        daemon.wait_until(lambda: daemon.instance_state("slow").get("state") == "healthy", 120, "instance healthy")
        server.set_fault("slow", SLOW_STEP)
        t0 = time.time()
        threads = [threading.Thread(target=client_loop, args=(server.url, stop, clients, i), daemon=True)
                   for i in range(CLIENTS)]
        for t in threads:
            t.start()
        last = time.time()
        while time.time() - t0 < duration:
            time.sleep(1)
            if not daemon.alive():
                raise RuntimeError(f"the daemon exited: {daemon.log_path}")
            state = daemon.instance_state("slow").get("state", "?")
            states[state] = states.get(state, 0) + 1
            if time.time() - last >= 60:
                last = time.time()
                log(f"slow soak {time.time() - t0:.0f}s: {len(clients)} client requests, "
                    f"verdicts {len(events(daemon, 'verdict'))}, slow reported {len(events(daemon, 'slow'))}x, "
                    f"states seen {states}")
        soak_s = time.time() - t0
        stop.set()
        for t in threads:
            t.join(300)
        verdicts_while_slow = events(daemon, "verdict")
        slow_records = events(daemon, "slow")

        # Phase 2: the same server hangs. Still slow (the fault file names one fault at a time:
        # block takes over at the next step), nothing more is delivered.
        hang_at = time.time()
        server.set_fault("block")
        deadline = hang_at + HANG_WAIT
        while time.time() < deadline and not events(daemon, "verdict", since=hang_at):
            time.sleep(0.2)
        found = events(daemon, "verdict", since=hang_at)
        detection = round(found[0]["detected_at"] - hang_at, 1) if found else None
        log_text = daemon.log_text()
    finally:
        stop.set()
        daemon.stop()
        server.refresh()
        server.stop()
    bound = hang_bound(FAST)
    out: dict[str, Any] = {
        "mlx_lm": version, "duration_s": round(soak_s, 1), "config": FAST,
        "server": {"prefill_step_size": PREFILL_STEP, "slow_step_s": SLOW_STEP},
        "load": {"clients": CLIENTS, "prompt_words": PROMPT_WORDS, "answer_tokens": ANSWER_TOKENS},
        "clients": {"requests": len(clients),
                    "ok": sum(1 for c in clients if c.get("status") == 200 and not c.get("error")),
                    "seconds": summary(c["seconds"] for c in clients)},
        "phase1": {"verdicts": len(verdicts_while_slow), "slow_reported": len(slow_records),
                   "slow_evidence": [r.get("evidence") for r in slow_records[:3]],
                   "states_seen_s": states, "probes_failed": log_text.count("probe failed"),
                   "late_deliveries": log_text.count("arrived late"),
                   "grace_held": log_text.count("progress holds the verdict")},
        "phase2": {"detected_s": detection, "bound_s": round(bound, 1)},
    }
    out["pass"] = (out["phase1"]["verdicts"] == 0 and out["phase1"]["slow_reported"] > 0
                   and detection is not None and detection <= bound)
    return out


if __name__ == "__main__":
    import argparse
    import json
    import sys
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600, help="seconds of phase 1 (default 600)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-slow-soak-") as tmp:
        result = run(str(TEST_PYTHON), Path(tmp), args.duration)
    print(json.dumps(result, indent=1, default=str))
    sys.exit(0 if result["pass"] else 1)
