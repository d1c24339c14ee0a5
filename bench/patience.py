"""Big models at the defaults: patience while long prompts are read, and hangs during one.

Issue 33: no verdict while a server reads long prompts at a big model's speed, and a hang
during a long prefill still called.

One real ``mlx_lm.server`` (tiny model, CPU; ``tests/lab``) per row, made to read prompts at a
big model's speed from its start (the lab's ``prefill MS [idle]`` fault: MS milliseconds a
prompt token, the process computing or idle, as a Mac's is while its GPU works), at the
default ``--prefill-step-size`` (2,048: 12 ms a token is a chunk every 25 s, a 70B dense model
on a Max chip). One ``mlxwatch run`` daemon as its own process pointed at its URL, every probe
setting at its default, no door, no shim, kernel sight on; the lab's relaunch hook as its
``command:`` restart, so that a false verdict is a restart. Agents in a process of their own
(``tests/lab/agent.py``, the official ``openai`` SDK):

- **streamed**: one agent, ``--turns`` (3) prompts of ``--tokens`` (3,600) one after the other;
- **non-streamed**: three agents, two prompts each (issue 33's agent on a Mac-like server).

Per row: verdicts (goal 0) and answers completed (goal all), restarts, `slow` episodes.

Hangs during a long prefill (``--trials`` each), the server at 12 ms a token, a streamed prompt:

- **hang**: the generation thread blocks for good after the prompt's first chunk (``X/Y``
  with X < Y logged): onset (the block, stamped by the lab in the server's log) -> verdict,
  goal 2 minutes;
- **livelock**: the prompt is read to its end (``N/N``), then every step returns nothing
  while computing: onset (the last chunk) -> verdict, goal 60 s.

Rows (``--rows``, comma-separated, shell patterns): ``MS/streamed|whole/computing|idle`` (e.g.
``12/streamed/computing``, ``12/*``, ``*/whole/idle``), ``hang``, ``livelock``. The whole table
takes hours (a 3,600-token prompt is 216 s at 60 ms a token): run it in parts. Each part's rows
are merged into ``bench/patience.json`` (rows run again replace the old ones) and the section
"Big models at the defaults" of ``bench/RESULTS.md`` is rendered from all of them::

    python -m bench.patience --rows '12/*,hang,livelock'    # the issue's rows
    python -m bench.patience --rows '5/*' --no-write         # a look, nothing written
    python -m bench.patience --rows '*'                      # everything (hours)
"""

from __future__ import annotations

import fnmatch
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, SRC, TEST_PYTHON, add_record_options, fmt_mmm, log, run_header, summary, write_section
from bench.front_detection import events, start_daemon
from lab.server import LabServer, relaunches_started, server_version

SPEEDS = (5.0, 12.0, 30.0, 60.0)  # ms a prompt token
DELIVERIES = ("streamed", "whole")
MODES = ("computing", "idle")
HANG_MS = 12.0
DEFAULT_TOKENS = 3600
GOALS = {"hang": 120.0, "livelock": 60.0}  # onset -> verdict, seconds
AGENT = SRC / "tests" / "lab" / "agent.py"
SECTION = "## Big models at the defaults: patience while a long prompt is read"
JSON = ROOT / "bench" / "patience.json"
ONSET = re.compile(r"mlxwatch lab: prefill (hang|livelock) begins at ([0-9.]+)")


def row_ids() -> list[str]:
    return [f"{ms:g}/{d}/{m}" for ms in SPEEDS for d in DELIVERIES for m in MODES] + ["hang", "livelock"]


def select(patterns: str) -> list[str]:
    wanted = [p for p in patterns.split(",") if p]
    chosen = [r for r in row_ids() if any(fnmatch.fnmatchcase(r, p) for p in wanted)]
    unknown = [p for p in wanted if not any(fnmatch.fnmatchcase(r, p) for r in row_ids())]
    if unknown:
        raise SystemExit(f"--rows: no row matches {', '.join(unknown)} (rows: {', '.join(row_ids())})")
    return chosen


def healthy(daemon) -> bool:
    return daemon.instance_state("lab").get("state") == "healthy"


def agents_run(url: str, tokens: int, stream: bool, clients: int, turns: int, timeout: float) -> subprocess.Popen:
    args = [str(TEST_PYTHON), str(AGENT), url, "--tokens", str(tokens), "--clients", str(clients),
            "--turns", str(turns), "--timeout", str(timeout)]
    return subprocess.Popen(args + (["--stream"] if stream else []), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def speed_row(python: str, workdir: Path, row: str, tokens: int, turns: int, step: int) -> dict[str, Any]:
    ms_text, delivery, mode = row.split("/")
    ms = float(ms_text)
    stream = delivery == "streamed"
    clients, each = (1, turns) if stream else (3, 2)
    fault = f"prefill {ms:g}" + (" idle" if mode == "idle" else "")
    server = LabServer.start(python, workdir / "server", start_fault=fault,
                             extra_args=("--prefill-step-size", str(step)))
    daemon, url = start_daemon(server, workdir / "daemon", front=False)
    reading = tokens * ms / 1000 * clients * each  # the prompts' reading time alone
    try:
        daemon.wait_until(lambda: healthy(daemon), 300, "healthy")
        t0 = time.time()
        proc = agents_run(url, tokens, stream, clients, each, timeout=reading + 600)
        out, _ = proc.communicate(timeout=2 * reading + 1200)
        answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        elapsed = time.time() - t0
        verdicts = events(daemon, "verdict", t0)
        if verdicts:  # a restart under way: over before the server is stopped (its hook relaunches it)
            daemon.wait_until(lambda: any(events(daemon, e, t0) for e in ("recovered", "gave_up", "closed")), 300,
                              "the incident closed after a false verdict")
        slow = events(daemon, "slow", t0)
        stalls = events(daemon, "kernel_stall", t0)
        captured = events(daemon, "captured", t0)
    finally:
        daemon.stop()
        server.refresh()
        server.stop()
    result = {"row": row, "mlx_lm": server_version(python), "ms_per_token": ms, "delivery": delivery, "mode": mode,
              "prefill_step_size": step, "chunk_s": round(step * ms / 1000, 1), "prompt_tokens": tokens,
              "clients": clients, "turns": each, "requests": clients * each,
              "answered": sum(bool(a["ok"]) for a in answers), "errors": [a["error"] for a in answers if a["error"]][:3],
              "verdicts": len(verdicts), "verdict_failures": [(v.get("failures") or [None])[-1] for v in verdicts][:3],
              "verdict_after_s": [round(v["detected_at"] - t0, 1) for v in verdicts][:3],
              "bundles": [f"{c.get('kind')}, {c.get('confidence')}" for c in captured][:3],
              "restarts": relaunches_started(server.workdir), "slow_episodes": len(slow),
              "kernel_stalls": len(stalls), "seconds": round(elapsed, 1),
              "answer_seconds": summary(a["seconds"] for a in answers if a["ok"])}
    result["pass"] = result["verdicts"] == 0 and result["answered"] == result["requests"]
    log(f"patience {row}: {result['verdicts']} verdict(s), {result['answered']}/{result['requests']} answered, "
        f"{result['restarts']} restart(s), {elapsed:.0f}s")
    return result


def onset_of(server: LabServer, since: int, shape: str) -> float | None:
    with open(server.log_path, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    found = [float(t) for s, t in ONSET.findall(text) if s == shape]
    return found[0] if found else None


def hang_row(python: str, workdir: Path, shape: str, trials: int, tokens: int, step: int) -> dict[str, Any]:
    """Onset -> verdict for a hang during a long prefill (``shape``: hang or livelock)."""
    speed = f"prefill {HANG_MS:g}"
    server = LabServer.start(python, workdir / "server", start_fault=speed,
                             extra_args=("--prefill-step-size", str(step)))
    daemon, url = start_daemon(server, workdir / "daemon", front=False)
    out: list[dict[str, Any]] = []
    procs: list[subprocess.Popen] = []
    try:
        for trial in range(trials):
            daemon.wait_until(lambda: healthy(daemon), 300, "healthy")
            time.sleep(random.uniform(0, 30))  # any phase against the probe interval
            server.refresh()
            since = server.log_path.stat().st_size
            t0 = time.time()
            server.set_fault(f"{speed} {shape}")
            procs.append(agents_run(url, tokens, True, 1, 1, timeout=600))
            daemon.wait_until(lambda t0=t0: events(daemon, "verdict", t0), 600, f"{shape}: verdict")
            verdict = events(daemon, "verdict", t0)[0]
            daemon.wait_until(lambda t0=t0: events(daemon, "recovered", t0), 300, f"{shape}: recovered")
            onset = onset_of(server, since, shape)
            seconds = None if onset is None else round(verdict["detected_at"] - onset, 1)
            captured = events(daemon, "captured", t0)
            out.append({"trial": trial, "onset_to_verdict_s": seconds,
                        # a verdict before the onset (or with none: the restart came first) is a false one
                        "false_verdict": seconds is None or seconds <= 0,
                        "request_to_verdict_s": round(verdict["detected_at"] - t0, 1),
                        "bundle": f"{captured[0].get('kind')}, {captured[0].get('confidence')}" if captured else None,
                        "failure": (verdict.get("failures") or [None])[-1]})
            log(f"patience {shape} trial {trial}: verdict {seconds}s after onset "
                f"({out[-1]['request_to_verdict_s']}s after the request)")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        daemon.stop()
        server.refresh()
        server.stop()
    s = summary(t["onset_to_verdict_s"] for t in out if not t["false_verdict"])
    false = sum(t["false_verdict"] for t in out)
    return {"row": shape, "mlx_lm": server_version(python), "ms_per_token": HANG_MS, "prefill_step_size": step,
            "chunk_s": round(step * HANG_MS / 1000, 1), "prompt_tokens": tokens, "trials": out, "onset_to_verdict": s,
            "false_verdicts": false,
            "pass": false == 0 and s["n"] == trials and s["max"] is not None and s["max"] <= GOALS[shape]}


def section(data: dict[str, Any]) -> str:
    rows = data["rows"]
    lines = [SECTION, "",
             "`python -m bench.patience` (`bench/patience.py`), run in parts (each row says when and from which "
             "commit). One real server a row, reading prompts at a big model's speed from its start (the lab's "
             "`prefill MS` fault: MS ms a prompt token; **computing** burns the CPU, **idle** sleeps, as a Mac's "
             "process does while its GPU works), at the default `--prefill-step-size` (2,048 tokens a chunk). "
             "`mlxwatch run` pointed at its URL at every **default**, no door, no shim, kernel sight on, the lab's "
             "relaunch hook as the restart. Agents use the official `openai` SDK: **streamed**, one agent sending "
             "its prompts one after the other; **whole**, three agents sending two prompts each without streaming.",
             "", "| ms a token | a chunk, s | answers | process | mlx-lm | prompt tokens | verdicts (goal 0) | "
             "answered (goal all) | restarts | `slow` | run |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {row: n for n, row in enumerate(row_ids())}
    speeds = sorted((k for k in rows if k.split("@")[0] not in GOALS),
                    key=lambda k: (rows[k]["prompt_tokens"], order.get(k.split("@")[0], len(order))))
    for key in speeds:
        r = rows[key]
        all_answered = r["answered"] == r["requests"]
        lines.append(f"| {r['ms_per_token']:g} | {r['chunk_s']:g} | {r['delivery']} | {r['mode']} | {r['mlx_lm']} | "
                     f"{r['prompt_tokens']:,} | {r['verdicts']}{'' if r['verdicts'] == 0 else ' **missed**'} | "
                     f"{r['answered']} of {r['requests']}{'' if all_answered else ' **missed**'} | {r['restarts']} | "
                     f"{r['slow_episodes']} | {r['started_at'][:16]} {r['commit']} |")
    missed = [rows[k] for k in speeds if not rows[k]["pass"]]
    if missed:
        lines += ["", "Rows that drew a verdict:", ""]
        for r in missed:
            after = ", ".join(f"{a:g} s" for a in r["verdict_after_s"])
            lines.append(f"- {r['row']} ({r['commit']}): verdict {after} after the agents began "
                         f"({'; '.join(str(f) for f in r['verdict_failures'])}); bundle {', '.join(r['bundles'])}.")
        if any(a >= 0.9 * 900 for r in missed for a in r["verdict_after_s"]):
            lines += ["", "A verdict near 900 s is `probe.grace_ceiling` (15 min), which bounds every allowance: a "
                      "server that sends nothing to anyone for longer needs it raised (docs/deciding.md#patience)."]
    lines += ["", "Until 5676547 `probe.grace_ceiling` was 10 min: three 3,600-token prompts read together at 60 ms a "
              "token (a chunk of each a step, 369 s a step) send nothing to anyone for about 650 s, and the 60 ms "
              "non-streamed idle row drew a verdict at 606-621 s, 0 of 6 answered (63c98b2, dfd4f3d)."]
    hangs = [rows[s] for s in GOALS if s in rows]
    if hangs:
        lines += ["", f"A hang during a long prefill ({HANG_MS:g} ms a token, a streamed prompt; the onset is the "
                  "lab's own stamp in the server's log):", "",
                  "| shape | a chunk, s | mlx-lm | n | verdicts before the onset (goal 0) | onset → verdict, s, "
                  "median (min–max) | goal | run |",
                  "|---|---|---|---|---|---|---|---|"]
        names = {"hang": "blocked after the first chunk (`X/Y`, X < Y)", "livelock": "livelock after `N/N`"}
        for r in hangs:
            s = r["onset_to_verdict"]
            goal = GOALS[r["row"]]
            met = r["pass"]
            lines.append(f"| {names[r['row']]} | {r['chunk_s']:g} | {r['mlx_lm']} | {len(r['trials'])} | "
                         f"{r['false_verdicts']} | {fmt_mmm(s)} | "
                         f"≤ {goal:g} s | {'met' if met else '**missed**'}, {r['started_at'][:16]} {r['commit']} |")
        lines += ["", "Each hang row's server is new to its daemon, so no chunk was learned before the hang: the "
                  "prompt's next chunk is bounded by the probes' hint (their least time a prompt token, doubled). On "
                  "a loaded host their fixed cost makes it slow (88 s a chunk of this 25 s server), and the blocked "
                  "read is called after that bound. Until 73cc3b5 a hint was cut at the prior (60 s a chunk): a "
                  "blocked read was called 49 s after its onset, but a server of 61 s chunks (30 ms a token) was "
                  "called hung 1 s before its second chunk came. Until 355f6b6 a probe given its first token then "
                  "nothing waited out its 90 s `timeout`: the livelock after `N/N` was called 8.8-60.5 s after its "
                  "onset."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.patience", description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="12/*,hang,livelock",
                        help="comma-separated rows or shell patterns (default: the 12 ms rows, hang, livelock)")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                        help=f"prompt tokens a request (default {DEFAULT_TOKENS}; other sizes are rows of their own)")
    parser.add_argument("--turns", type=int, default=3, help="the streaming agent's prompts (default 3)")
    parser.add_argument("--trials", type=int, default=3, help="trials of each hang (default 3)")
    parser.add_argument("--step", type=int, default=2048, help="the server's --prefill-step-size (default 2048)")
    parser.add_argument("--python", default=str(TEST_PYTHON), help="the server's Python (default: the newest mlx-lm)")
    add_record_options(parser)
    args = parser.parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
    else:
        header = run_header()
        done: dict[str, Any] = {}
        with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-patience-") as tmp:
            for n, row in enumerate(select(args.rows)):
                workdir = Path(tmp) / f"row-{n}"
                if row in GOALS:
                    result = hang_row(args.python, workdir, row, args.trials, args.tokens, args.step)
                else:
                    result = speed_row(args.python, workdir, row, args.tokens, args.turns, args.step)
                key = row if args.tokens == DEFAULT_TOKENS else f"{row}@{args.tokens}"  # longer prompts: rows of their own
                done[key] = {**result, "started_at": header["started_at"], "commit": header["commit"],
                             "load_average": header["load_average"]}
        if args.no_write:  # the shape of bench/patience.json: `--render FILE --no-write` prints its section
            part = {"machine": header["machine"], "rows": done, "pass": all(r["pass"] for r in done.values())}
            print(json.dumps(part, indent=1, default=str))
            return 0 if part["pass"] else 1
        try:
            data = json.loads(JSON.read_text())
        except (OSError, ValueError):
            data = {"machine": header["machine"], "rows": {}}
        data["rows"].update(done)
        data["pass"] = all(r["pass"] for r in data["rows"].values())
    if args.no_write:
        print(section(data))
        return 0 if data.get("pass") else 1
    write_section("patience", data, SECTION, section(data))
    log("wrote bench/patience.json and its section of bench/RESULTS.md")
    return 0 if data.get("pass") else 1


if __name__ == "__main__":
    sys.exit(main())
