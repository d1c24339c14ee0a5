"""False positives: a long soak against a slow but working real server under real load.

One real ``mlx_lm.server`` (the newest 0.32.x, tiny model, CPU) started with a small
``--prefill-step-size`` and the lab's ``slow`` fault (every batch step delayed): prompts of
thousands of tokens are processed in many small steps, each logged as ``Prompt processing
progress: X/Y``. Real concurrent clients send such prompts (streamed, short answers) with
pauses between them. Against that same server, side by side:

- ``mlxwatch run`` at the detection benchmark's FAST config (``restart: none``, the server's
  log followed): its probes do miss their 2 s first-token limit while a long prompt is being
  processed, and the advancing prompt progress is what holds the verdict; the soak asserts
  that this grace was exercised (the daemon logs "progress holds the verdict");
- ``mlxwatch run`` at the default config (probe every 30 s, 45 s first-token limit);
- the cron workaround scaled like the FAST config: every ``CRON_PERIOD`` a non-streaming
  4-token request with a fixed timeout (FAST's total ``timeout``), a restart ordered on the
  first failure. Nothing is restarted here (it would disturb the others); each failure is
  counted as the restart the cron job would have ordered.

Every verdict (mlxwatch) and every failed cron request is a false positive: the server works
throughout (every client request is checked to complete with 200).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import DaemonProcess, log, summary, write_config
from bench.detection import FAST
from lab.server import LabServer, server_version
from mlxwatch.serverlog.markers import PROGRESS

PREFILL_STEP = 32
SLOW_STEP = 0.3  # seconds added to every batch step (a real model's step costs real time)
CLIENTS = 10  # more than mlx-lm's prefill batch (8): at times a new request waits for a slot
PROMPT_WORDS = (600, 1000)  # about 2,000 to 3,600 tokens of the tiny model's tokenizer
ANSWER_TOKENS = 8
THINK = (5.0, 40.0)  # seconds between a client's requests
CRON_PERIOD = 10.0
CRON_TIMEOUT = FAST["timeout"]
WORDS = ("the quick brown fox jumps over the lazy dog mlxwatch sends a short probe and counts delivered "
         "tokens a server that answers models but never generates is not healthy").split()


def client_loop(url: str, stop: threading.Event, out: list[dict[str, Any]], seed: int) -> None:
    rnd = random.Random(seed)
    with httpx.Client(trust_env=False, timeout=600) as client:
        time.sleep(rnd.uniform(0, THINK[1]))
        while not stop.is_set():
            prompt = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(*PROMPT_WORDS)))
            t0 = time.time()
            rec: dict[str, Any] = {"start": t0}
            try:
                with client.stream("POST", f"{url}/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": prompt}],
                                         "max_tokens": ANSWER_TOKENS, "stream": True}) as r:
                    rec["status"] = r.status_code
                    tokens = 0
                    for line in r.iter_lines():
                        if line.startswith("data:") and '"content"' in line:
                            tokens += 1
                    rec["tokens"] = tokens
            except httpx.HTTPError as exc:
                rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["seconds"] = time.time() - t0
            out.append(rec)
            stop.wait(rnd.uniform(*THINK))


def cron_loop(url: str, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    """Every CRON_PERIOD, one non-streaming 4-token request with a CRON_TIMEOUT limit."""
    body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 4}
    start = time.monotonic()
    tick = 0
    with httpx.Client(trust_env=False) as client:
        while not stop.is_set():
            t0 = time.time()
            rec: dict[str, Any] = {"at": t0}
            try:
                r = client.post(f"{url}/v1/chat/completions", json=body, timeout=CRON_TIMEOUT)
                rec["ok"] = r.status_code == 200
                rec["status"] = r.status_code
            except httpx.TimeoutException:
                rec["ok"], rec["error"] = False, "timeout"
            except httpx.HTTPError as exc:
                rec["ok"], rec["error"] = False, f"{type(exc).__name__}: {exc}"
            rec["seconds"] = time.time() - t0
            out.append(rec)
            tick += 1
            stop.wait(max(0.0, start + tick * CRON_PERIOD - time.monotonic()))


def run(python: str, workdir: Path, duration: float) -> dict[str, Any]:
    version = server_version(python)
    server = LabServer.start(python, workdir / "server", extra_args=("--prefill-step-size", str(PREFILL_STEP)))
    daemons: dict[str, DaemonProcess] = {}
    stop = threading.Event()
    clients: list[dict[str, Any]] = []
    cron: list[dict[str, Any]] = []
    threads: list[threading.Thread] = []
    try:
        base = {"name": "soak", "url": server.url, "log": str(server.log_path), "pid_file": str(server.pid_file),
                "restart": "none"}
        for name, probe in (("fast", {k: (f"{v:g}s" if k != "failures" else v) for k, v in FAST.items()}),
                            ("defaults", {})):
            cfg = write_config(workdir / name / "config.yaml", [{**base, **({"probe": probe} if probe else {})}],
                               workdir / name / "state")
            daemons[name] = DaemonProcess(cfg, workdir / name / "state", workdir / name / "daemon.log")
            daemons[name].start()
        for d in daemons.values():
            d.wait_until(lambda d=d: d.instance_state("soak").get("state") == "healthy", 120, "soak instance healthy")
        log_start = server.log_path.stat().st_size
        server.set_fault("slow", SLOW_STEP)
        t0 = time.time()
        threads = [threading.Thread(target=client_loop, args=(server.url, stop, clients, i), daemon=True)
                   for i in range(CLIENTS)]
        threads.append(threading.Thread(target=cron_loop, args=(server.url, stop, cron), daemon=True))
        for t in threads:
            t.start()
        last = time.time()
        while time.time() - t0 < duration:
            time.sleep(5)
            for d in daemons.values():
                if not d.alive():
                    raise RuntimeError(f"a soak daemon exited: {d.log_path}")
            if time.time() - last >= 60:
                last = time.time()
                v = {n: sum(1 for r in d.journal() if r.get("event") == "verdict") for n, d in daemons.items()}
                held = daemons["fast"].log_text().count("progress holds the verdict")
                log(f"soak {time.time() - t0:.0f}s: {len(clients)} client requests, verdicts {v}, "
                    f"fast grace held {held}x, cron failures {sum(1 for c in cron if not c['ok'])}/{len(cron)}")
        stop.set()
        soak_s = time.time() - t0
        for t in threads:
            t.join(120)
        with open(server.log_path, "rb") as fh:
            fh.seek(log_start)
            server_log = fh.read().decode("utf-8", "replace")
    finally:
        stop.set()
        for d in daemons.values():
            d.stop()
        server.stop()
    out: dict[str, Any] = {
        "mlx_lm": version, "duration_s": round(soak_s, 1),
        "server": {"prefill_step_size": PREFILL_STEP, "slow_step_s": SLOW_STEP},
        "load": {"clients": CLIENTS, "prompt_words": PROMPT_WORDS, "answer_tokens": ANSWER_TOKENS, "think_s": THINK},
        "clients": {"requests": len(clients), "ok": sum(1 for c in clients if c.get("status") == 200 and not c.get("error")),
                    "seconds": summary(c["seconds"] for c in clients),
                    "prompt_tokens": summary({int(m.group(2)) for m in PROGRESS.finditer(server_log)}),
                    "progress_lines": len(PROGRESS.findall(server_log)),
                    "broken_pipes": server_log.count("BrokenPipeError")},
        "cron": {"period_s": CRON_PERIOD, "timeout_s": CRON_TIMEOUT, "requests": len(cron),
                 "failed": sum(1 for c in cron if not c["ok"]), "seconds": summary(c["seconds"] for c in cron),
                 "failures": [c for c in cron if not c["ok"]][:50]},
        "mlxwatch": {},
    }
    for name, d in daemons.items():
        text = d.log_text()
        records = d.journal()
        out["mlxwatch"][name] = {
            "verdicts": sum(1 for r in records if r.get("event") == "verdict"),
            "probes_failed": text.count("probe failed"),
            "grace_held": text.count("progress holds the verdict"),
            "verdict_records": [r for r in records if r.get("event") == "verdict"][:10],
            "held_examples": [l for l in text.splitlines() if "progress holds the verdict" in l][:3],
        }
    out["grace_exercised"] = out["mlxwatch"]["fast"]["grace_held"] > 0
    return out


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    from bench.common import TEST_PYTHON

    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=float, default=120)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-soak-") as tmp:
        print(json.dumps(run(str(TEST_PYTHON), Path(tmp), args.duration), indent=1, default=str))
