"""Kernel sight's misreads (issue 33), measured on the real server at the default settings.

1. **Non-streamed answers** (``soak``): one real ``mlx_lm.server`` (the newest 0.32.x, tiny
   model) made slow by the lab's ``slow`` fault (``STEP`` s a batch step, spent sleeping: the
   process idles while it works, as a Mac's does while its GPU computes), asked again and again
   by ``CLIENTS`` clients of the official ``openai`` SDK, not streaming. ``mlxwatch run`` watches
   it at every default (no door, no shim), with the lab's relaunch hook as its restart; the
   fault is set again after a restart. Before kernel sight read answers sent whole: 1-2 false
   verdicts per 10 minutes, 2 restarts, 6 of 12 requests failed. Goal: 0 verdicts, every
   request answered.
2. **Idle connections under a livelock** (``idle``): ``IDLE_CONNECTIONS`` TCP connections that
   never send a byte are opened to the server, then it livelocks (``spin``); seconds from the
   fault to the verdict. Before they counted as waiting requests, hidden work, and the verdict
   took 160-164 s instead of 31-33 s.

Run (``MLXWATCH_BENCH_SRC`` names another tree to measure, e.g. the base commit's)::

    python -m bench.kernel_misreads --duration 600
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from bench.common import SRC, TEST_PYTHON, DaemonProcess, git_commit, log, summary, write_config
from lab.server import CLI as LAB_CLI
from lab.server import LabServer, server_version

STEP = 4.0  # seconds every batch step sleeps
CLIENTS = 3
MAX_TOKENS = 8
IDLE_CONNECTIONS = 5
HANG_WAIT = 300.0


def _instance(server: LabServer) -> dict[str, Any]:
    return {"name": "lab", "url": server.url, "log": str(server.log_path), "pid_file": str(server.pid_file),
            "restart": {"command": [str(TEST_PYTHON), str(LAB_CLI), "relaunch", str(server.workdir)],
                        "timeout": "120s", "backoff": "1s"}}


def _events(daemon: DaemonProcess, name: str, since: float = 0.0) -> list[dict[str, Any]]:
    return [r for r in daemon.journal() if r.get("event") == name and (r.get("detected_at") or r.get("at") or 0) >= since]


def _ask(url: str, stop: threading.Event, out: list[dict[str, Any]], i: int) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=600,
                           http_client=httpx.Client(trust_env=False))
    n = 0
    while not stop.is_set():
        n += 1
        rec: dict[str, Any] = {"start": time.time()}
        try:
            got = client.chat.completions.create(
                model="default_model", max_tokens=MAX_TOKENS, temperature=0.0,
                messages=[{"role": "user", "content": f"client {i} request {n}: tell me about the quick brown fox"}])
            rec["ok"] = got.choices[0].finish_reason is not None
        except openai.OpenAIError as exc:
            rec["ok"], rec["error"] = False, f"{type(exc).__name__}: {exc}"[:200]
        rec["seconds"] = round(time.time() - rec["start"], 2)
        out.append(rec)


def soak(python: str, workdir: Path, duration: float) -> dict[str, Any]:
    server = LabServer.start(python, workdir / "server")
    cfg = write_config(workdir / "daemon" / "config.yaml", [_instance(server)], workdir / "daemon" / "state")
    daemon = DaemonProcess(cfg, workdir / "daemon" / "state", workdir / "daemon" / "daemon.log")
    stop, done = threading.Event(), []
    threads: list[threading.Thread] = []
    fault_set = 0
    try:
        daemon.start()
        daemon.wait_until(lambda: daemon.instance_state("lab").get("state") == "healthy", 180, "instance healthy")
        server.set_fault("slow", STEP)
        t0 = time.time()
        threads = [threading.Thread(target=_ask, args=(server.url, stop, done, i), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        while time.time() - t0 < duration:
            time.sleep(1)
            if not daemon.alive():
                raise RuntimeError(f"the daemon exited: {daemon.log_path}")
            if not server.fault_file.exists() or not server.fault_file.read_text().strip():
                server.set_fault("slow", STEP)  # a restart cleared it: the server is as slow as before
                fault_set += 1
        stop.set()
        for t in threads:
            t.join(STEP * (MAX_TOKENS + 4) * 3)
        log_text = daemon.log_text()
        out = {"duration_s": round(time.time() - t0, 1),
               "verdicts": len(_events(daemon, "verdict")), "restarts": len(_events(daemon, "restart")),
               "kernel_stalls": len(_events(daemon, "kernel_stall")), "slow_reported": len(_events(daemon, "slow")),
               "recovered_before_restart": log_text.count("recovered before restart"),
               "not_recovered": len(_events(daemon, "not_recovered")),
               "requests": len(done), "answered": sum(1 for r in done if r["ok"]),
               "failed": [r.get("error") for r in done if not r["ok"]][:5],
               "seconds": summary(r["seconds"] for r in done if r["ok"]), "fault_set_again": fault_set,
               "probes_failed": log_text.count("probe failed")}
    finally:
        stop.set()
        daemon.stop()
        server.refresh()
        server.stop()
    return out


def idle(python: str, workdir: Path) -> dict[str, Any]:
    server = LabServer.start(python, workdir / "server")
    cfg = write_config(workdir / "daemon" / "config.yaml", [_instance(server)], workdir / "daemon" / "state")
    daemon = DaemonProcess(cfg, workdir / "daemon" / "state", workdir / "daemon" / "daemon.log")
    silent: list[socket.socket] = []
    try:
        daemon.start()
        daemon.wait_until(lambda: daemon.instance_state("lab").get("state") == "healthy", 180, "instance healthy")
        silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(IDLE_CONNECTIONS)]
        time.sleep(12.0)  # a healthy server with idle connections: a stall alert here is false
        false_alerts = len(_events(daemon, "kernel_stall"))
        hang_at = time.time()
        server.set_fault("spin")
        deadline = hang_at + HANG_WAIT
        while time.time() < deadline and not _events(daemon, "verdict", since=hang_at):
            time.sleep(0.2)
        found = _events(daemon, "verdict", since=hang_at)
        out = {"idle_connections": IDLE_CONNECTIONS, "false_stall_alerts_while_healthy": false_alerts,
               "livelock_to_verdict_s": round(found[0]["detected_at"] - hang_at, 1) if found else None}
    finally:
        for s in silent:
            s.close()
        daemon.stop()
        server.refresh()
        server.stop()
    return out


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=600, help="seconds of the non-streaming soak (600)")
    parser.add_argument("--only", choices=("soak", "idle"), default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the result here as JSON")
    args = parser.parse_args()
    python = str(TEST_PYTHON)
    result: dict[str, Any] = {"mlx_lm": server_version(python), "src": str(SRC), "commit": git_commit(),
                              "settings": {"step_s": STEP, "clients": CLIENTS, "max_tokens": MAX_TOKENS}}
    with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-kernel-misreads-") as tmp:
        if args.only in (None, "idle"):
            result["idle"] = idle(python, Path(tmp) / "idle")
            log(f"idle: {result['idle']}")
        if args.only in (None, "soak"):
            result["soak"] = soak(python, Path(tmp) / "soak", args.duration)
            log(f"soak: {result['soak']}")
    text = json.dumps(result, indent=1, default=str)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
