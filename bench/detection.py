"""Detection and recovery, per fault shape, on both mlx-lm versions, in real time.

For each version one real ``mlx_lm.server`` (tiny model, CPU; ``tests/lab``) and one
``mlxwatch run`` daemon process watching it at the FAST config below, with the lab's relaunch
hook as its ``command:`` restart and the default capture settings. Each trial: wait until the
instance is healthy again, wait a random part of one probe interval (a random phase of the
probe schedule), switch the fault on (the onset), and read the daemon's journal: verdict,
bundle written (``captured``), restart done (``restart``), first healthy probe (``recovered``).
Faults: ``spin`` (livelock), ``block``, ``die`` (generation thread raises), ``kill`` (SIGKILL).

Side by side, at each onset the cron workaround's request is sent too (non-streaming, 4 tokens,
as ``curl -m 45`` would): how it ends (error after how long, or no answer until the daemon's
restart took the server away) is what the cron's exact distribution needs (``bench/model.py``).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import TEST_PYTHON, DaemonProcess, log, write_config
from lab.server import CLI as LAB_CLI
from lab.server import LabServer, server_version

FAST = {"interval": 2.0, "suspect_interval": 1.0, "first_token_timeout": 2.0, "timeout": 4.0, "failures": 2,
        "endpoint_timeout": 1.0, "grace_ceiling": 600.0, "startup_timeout": 120.0}
FAULTS = ("spin", "block", "die", "kill")
CRON_REQUEST_CAP = 120.0  # the request is given up after this (the cron's own timeout is applied in the model)


def daemon_config(server: LabServer, workdir: Path) -> Path:
    inst = {
        "name": "lab", "url": server.url, "log": str(server.log_path), "pid_file": str(server.pid_file),
        "probe": {k: (f"{v:g}s" if k not in ("failures",) else v) for k, v in FAST.items()},
        "restart": {"command": [str(TEST_PYTHON), str(LAB_CLI), "relaunch", str(server.workdir)],
                    "timeout": "120s", "backoff": "1s", "window": "1s", "budget": 3},
    }
    return write_config(workdir / "config.yaml", [inst], workdir / "state")


def cron_request(url: str, out: dict[str, Any]) -> None:
    """The workaround's check: one non-streaming 4-token completion, as a cron job sends it."""
    t0 = time.monotonic()
    body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 4}
    try:
        with httpx.Client(trust_env=False, timeout=CRON_REQUEST_CAP) as client:
            r = client.post(f"{url}/v1/chat/completions", json=body)
        out.update(outcome="http", status=r.status_code, ok=r.status_code == 200 and bool(r.json().get("choices")))
    except httpx.TimeoutException:
        out.update(outcome="timeout", ok=False)
    except httpx.HTTPError as exc:
        out.update(outcome=type(exc).__name__, ok=False, error=str(exc)[:200])
    except ValueError as exc:
        out.update(outcome="bad_json", ok=False, error=str(exc)[:200])
    out["elapsed"] = time.monotonic() - t0


def _incident_events(records: list[dict], after: float) -> dict[str, dict]:
    """The first incident detected after ``after``: its records by event (first of each)."""
    inc_id = None
    events: dict[str, dict] = {}
    for rec in records:
        if rec.get("event") == "verdict" and inc_id is None and (rec.get("detected_at") or 0) >= after:
            inc_id = rec["id"]
        if inc_id is not None and rec.get("id") == inc_id:
            events.setdefault(rec["event"], rec)
    return events


def _bundle_size(path: str | None) -> int | None:
    if not path:
        return None
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def trial(server_dir: Path, daemon: DaemonProcess, fault: str, url: str) -> dict[str, Any]:
    # Healthy again, with no incident open.
    daemon.wait_until(lambda: daemon.instance_state("lab").get("state") == "healthy"
                      and not daemon.instance_state("lab").get("incident"), 180, "healthy before a trial")
    time.sleep(0.5 + random.uniform(0, FAST["interval"]))
    lab = LabServer.load(server_dir)
    cron: dict[str, Any] = {}
    onset = time.time()
    if fault == "kill":
        lab.refresh()
        os.kill(lab.pid, signal.SIGKILL)
    else:
        lab.set_fault(fault)
    sender = threading.Thread(target=cron_request, args=(url, cron), daemon=True)
    sender.start()

    def done() -> bool:
        ev = _incident_events(daemon.journal(), onset)
        return "recovered" in ev or "gave_up" in ev or "not_recovered" in ev
    daemon.wait_until(done, 180, f"{fault}: verdict through recovery")
    ev = _incident_events(daemon.journal(), onset)
    sender.join(10)
    verdict = ev["verdict"]
    captured = ev.get("captured") or ev.get("capture_failed") or {}
    restart = ev.get("restart") or {}
    recovered = ev.get("recovered") or {}
    detected = verdict.get("detected_at") or verdict["ts"]
    out = {
        "fault": fault, "onset": onset,
        "verdict_s": detected - onset,
        "bundle_s": (captured.get("ts") - detected) if captured else None,
        "restart_s": (restart.get("ts") - captured.get("ts")) if restart and captured else None,
        "recovery_s": (recovered.get("ts") - restart.get("ts")) if recovered and restart else None,
        "total_s": (recovered.get("ts") - onset) if recovered else None,
        "first_failure_after_onset_s": (verdict.get("first_failure_at") or detected) - onset,
        "failures": verdict.get("failures"),
        "kind": (ev.get("recovered") or captured).get("kind"),
        "confidence": (ev.get("recovered") or captured).get("confidence"),
        "bundle": captured.get("bundle"),
        "bundle_bytes": _bundle_size(captured.get("bundle")),
        "restart_result": (restart or {}).get("event"),
        "events": sorted(ev),
        "cron_request": {**cron, "verdict_at_s": detected - onset,
                         "restarting_at_s": (ev["restarting"]["ts"] - onset) if "restarting" in ev else None},
    }
    return out


def run_version(python: str, workdir: Path, trials: int, results: dict, key: str, faults=FAULTS) -> None:
    version = server_version(python)
    res = results[key] = {"python": python, "mlx_lm": version, "trials": [], "error": None}
    server = None
    daemon = None
    try:
        server = LabServer.start(python, workdir / "server")
        daemon = DaemonProcess(daemon_config(server, workdir), workdir / "state", workdir / "daemon.log")
        daemon.start()
        daemon.wait_until(lambda: daemon.instance_state("lab").get("state") == "healthy", 120, "first healthy")
        # Faults in a fixed rotation, started at a different point per version, so that two
        # livelocks (a core each) rarely overlap; the phase within the schedule is random.
        offset = 0 if key.endswith("0.32") else 2
        order = [faults[(i + offset) % len(faults)] for i in range(trials * len(faults))]
        for i, fault in enumerate(order):
            t = trial(server.workdir, daemon, fault, server.url)
            res["trials"].append(t)
            log(f"detection {version} #{i + 1}/{len(order)} {fault}: verdict {t['verdict_s']:.1f}s, "
                f"bundle {t['bundle_s'] or 0:.1f}s, restart {t['restart_s'] or 0:.1f}s, "
                f"recovery {t['recovery_s'] or 0:.2f}s, total {t['total_s'] or 0:.1f}s, kind {t['kind']}; "
                f"cron request {t['cron_request'].get('outcome')} {t['cron_request'].get('status', '')} "
                f"after {t['cron_request'].get('elapsed', float('nan')):.1f}s")
    except Exception as exc:  # reported, never hidden
        res["error"] = f"{type(exc).__name__}: {exc}"
        log(f"detection {version}: FAILED: {res['error']}")
    finally:
        if daemon is not None:
            daemon.stop()
            res["daemon_log_tail"] = daemon.log_text()[-4000:]
            res["daemon_errors"] = [l for l in daemon.log_text().splitlines() if " ERROR " in l][:20]
        if server is not None:
            LabServer.load(server.workdir).stop()


def run(workdir: Path, trials: int, pythons: dict[str, str]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    threads = [threading.Thread(target=run_version, args=(py, workdir / f"detection-{key}", trials, results, key))
               for key, py in pythons.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"config": FAST, "faults": list(FAULTS), "trials_per_fault": trials, "versions": results}


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    from bench.common import OLD_PYTHON

    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--version", choices=["0.31", "0.32", "both"], default="both")
    args = parser.parse_args()
    pys = {"mlx-lm-0.31": str(OLD_PYTHON), "mlx-lm-0.32": str(TEST_PYTHON)}
    if args.version != "both":
        pys = {k: v for k, v in pys.items() if k.endswith(args.version)}
    with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-det-") as tmp:
        out = run(Path(tmp), args.trials, pys)
        print(json.dumps(out, indent=1, default=str)[:20000])
    sys.exit(0)
