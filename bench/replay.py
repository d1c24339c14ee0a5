"""Replay (issue 35): what the door's recorder costs, its memory at its bound, whether a replay
sends the recorded bytes, and what ``--shrink`` takes on the lab's sequence fault.

    .venvs/test/bin/python -m bench.replay [--parts cost,memory,fidelity,shrink] [--repeats 2]

- **cost**: ``bench/front_perf.py``'s harness (the token-streaming stand-in, 50 tok/s per stream,
  its client), direct vs the door vs the door with ``front.record: true``, at 1, 16 and 64
  streams, paired per repeat. Goals (the door's own): tokens/s at least 97 % of direct, added p99
  inter-token gap at most 1 ms, added first token at most 1 ms.
- **memory**: the door in this process with ``record_max_bytes`` 64 MiB; 512 KiB requests
  through it to four times the bound; the recorder's bytes and the process's RSS as they go.
- **fidelity**: requests of every shape (JSON with odd spacing and unicode escapes, not JSON,
  1 MiB) through a recording door to a server that hashes each body it reads; the bundle; then
  ``replay`` to a second such server: the two servers' hashes, in order, must be equal.
- **shrink**: the lab's ``sequence`` fault on the real server (each version): 20 requests
  through a recording door, two of them the trigger; captured; ``--shrink``: trials, time, and
  whether the pair was found.

Writes ``bench/replay.json`` and the section "Replay" of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import OLD_PYTHON, TEST_PYTHON, git_commit, load_average, log, machine, record
from bench.front_perf import Proc, _role_argv, _wait_ready, measure

SECTION = "## Replay (issue 35): the recorder's cost and memory, replay fidelity, shrink"


# --- cost ---------------------------------------------------------------------------------------

def cost(work: Path, repeats: int, seconds: float) -> dict[str, Any]:
    standin = Proc(_role_argv("standin", "--interval", "0.02", "--ready", str(work / "standin.port")),
                   work / "standin.log")
    try:
        upstream = f"http://127.0.0.1:{_wait_ready(standin, work / 'standin.port')}"
        res = measure(upstream, "stand-in", [1, 16, 64], seconds, repeats, 50, ["direct", "door", "door+record"],
                      work, None)
    finally:
        standin.stop()
    summ = res["summary"]
    rec = {n: summ[n]["door+record"] for n in summ}
    rate = min(r["rate_vs_direct"] for r in rec.values())
    gap = rec["64"]["added_gap_p99_ms"]
    ttft = max(r["added_ttft_median_ms"] for r in rec.values())
    goals = [
        {"goal": "tokens/s with the recorder >= 97 % of direct (worst stream count)", "measured": rate, "met": rate >= 0.97},
        {"goal": "added p99 gap <= 1 ms (64 streams)", "measured": gap, "met": gap <= 1.0},
        {"goal": "added first token <= 1 ms (every stream count)", "measured": ttft, "met": ttft <= 1.0},
    ]
    own = {}  # what the recorder adds to the door itself: door+record minus door, paired per repeat
    for n, by_kind in res["runs"].items():
        door = {c["repeat"]: c for c in by_kind["door"]}
        pairs = [(c, door[c["repeat"]]) for c in by_kind["door+record"] if c["repeat"] in door]
        own[n] = {key: statistics.median([c[key] - d[key] for c, d in pairs])
                  for key in ("ttft_median_ms", "gap_p99_ms", "tokens_per_s")}
    return {"summary": summ, "goals": goals, "recorder_over_door": own}


def per_request(n: int = 100_000) -> dict[str, Any]:
    """The recorder's own work per request, alone (no I/O, no event loop): what the door adds to
    each request when recording, measured without the machine's scheduling noise."""
    import timeit

    from mlxwatch.front.delivery import RequestView
    from mlxwatch.front.recorder import Recorder

    rec = Recorder(600.0, 256 * 2**20, monotonic=time.monotonic, wall=time.time)
    headers = [("Content-Type", "application/json"), ("Authorization", "Bearer x"), ("User-Agent", "openai/1"),
               ("Accept", "*/*"), ("X-Stainless-Lang", "python")]
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    counter = iter(range(10**9))

    def one() -> None:
        fid = f"r{next(counter)}"
        rec.arrived(fid, "c1 127.0.0.1:5000", "POST", "/v1/chat/completions", headers, body, stream=True, max_tokens=64)
        rec.ended(RequestView(fid, "POST", "/v1/chat/completions", 0.0, True, 64, len(body), 0.1, 0.5, 50, 5000), "ok",
                  status=200, finish_reason="stop", client_gone=False)

    best = min(timeit.repeat(one, number=n, repeat=3)) / n
    return {"us_per_request": best * 1e6, "requests": n}


# --- memory -------------------------------------------------------------------------------------

async def _memory(bound: int, body_kib: int, rounds: int) -> dict[str, Any]:
    from mlxwatch.config import FrontConfig
    from mlxwatch.front import FrontDoor

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                     b'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    door = FrontDoor("bench", url, FrontConfig(listen=("127.0.0.1", 0), record=True, record_max_bytes=bound))
    await door.start()
    me = psutil.Process()
    per_bound = bound // (body_kib * 1024)
    samples = []
    try:
        host, port = door.address
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            gc.collect()
            samples.append({"requests": 0, "held_mb": 0.0, "rss_mb": me.memory_info().rss / 2**20})
            sent = 0
            for _ in range(rounds):
                for batch in range(0, per_bound, 8):
                    bodies = [json.dumps({"messages": [{"role": "user", "content": os.urandom(body_kib * 512).hex()}],
                                          "stream": True}).encode() for _ in range(min(8, per_bound - batch))]
                    await asyncio.gather(*(client.post(f"http://{host}:{port}/v1/chat/completions", content=b)
                                           for b in bodies))
                    sent += len(bodies)
                gc.collect()
                assert door.recorder is not None
                samples.append({"requests": sent, "held_mb": door.recorder.held_bytes / 2**20,
                                "kept": len(door.recorder), "rss_mb": me.memory_info().rss / 2**20})
                log(f"replay memory: {samples[-1]}")
    finally:
        await door.stop(drain=0.5)
        server.close()
    growth = [s["rss_mb"] - samples[0]["rss_mb"] for s in samples[1:]]
    return {"bound_mb": bound / 2**20, "body_kib": body_kib, "samples": samples,
            "goal": "the recorder holds at most its bound; RSS flat after the first bound's worth",
            "met": all(s["held_mb"] <= bound / 2**20 for s in samples) and growth[-1] - growth[0] < bound / 2**20 / 2}


# --- fidelity -----------------------------------------------------------------------------------

def _bodies() -> list[bytes]:
    out = []
    for i in range(200):
        kind = i % 5
        if kind == 0:
            out.append(b'{"messages":[{"role":"user","content":"caf\\u00e9 %d"}],   "stream":true}' % i)
        elif kind == 1:
            out.append(json.dumps({"prompt": "x" * (i * 97 % 5000), "max_tokens": i}, indent=3).encode())
        elif kind == 2:
            out.append(b"not json at all \x00\xff\xfe " + bytes(range(256)))
        elif kind == 3:
            out.append(json.dumps({"messages": [{"role": "user", "content": "\u65e5\u672c " * 50}]},
                                  ensure_ascii=False).encode())
        else:
            out.append(b'{"prompt": "' + b"y" * (1024 * 1024 if i % 50 == 4 else 3000) + b'"}')
    return out


async def _fidelity(work: Path) -> dict[str, Any]:
    from mlxwatch.capture import CaptureRequest, capture_bundle
    from mlxwatch.capture.requests import load_requests
    from mlxwatch.config import FrontConfig
    from mlxwatch.front import FrontDoor
    from mlxwatch.replay.options import ReplayOptions
    from mlxwatch.replay.session import replay

    def hashing(into: list[str]):
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
            into.append(hashlib.sha256(await reader.readexactly(length)).hexdigest())
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
                         b'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
            await writer.drain()
            writer.close()
        return handle

    first: list[str] = []
    again: list[str] = []
    s1 = await asyncio.start_server(hashing(first), "127.0.0.1", 0)
    s2 = await asyncio.start_server(hashing(again), "127.0.0.1", 0)
    bodies = _bodies()
    door = FrontDoor("bench", f"http://127.0.0.1:{s1.sockets[0].getsockname()[1]}",
                     FrontConfig(listen=("127.0.0.1", 0), record=True))
    await door.start()
    try:
        host, port = door.address
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            for b in bodies:
                await client.post(f"http://{host}:{port}/v1/chat/completions", content=b,
                                  headers={"Content-Type": "application/json"})
        recorded = door.recorded()
    finally:
        await door.stop(drain=0.5)
    bundle = await capture_bundle(CaptureRequest(pid=None, out_dir=work / "fidelity", label="bench", snapshots=1,
                                                 spacing=0.1, ceiling=20.0, recorded=recorded))
    if bundle.lingering is not None:
        bundle.lingering.cancel()
    requests = load_requests(bundle.path)
    outcome = await replay(requests, f"http://127.0.0.1:{s2.sockets[0].getsockname()[1]}", ReplayOptions())
    s1.close()
    s2.close()
    sent = [hashlib.sha256(b).hexdigest() for b in bodies]
    return {"requests": len(bodies), "bytes": sum(map(len, bodies)), "recorded_server_side": len(first),
            "replayed_server_side": len(again), "equal_in_order": again == first == sent,
            "equal_as_a_set": sorted(again) == sorted(first) == sorted(sent), "hung": outcome.hung,
            "met": sorted(again) == sorted(first) == sorted(sent)}


# --- shrink -------------------------------------------------------------------------------------

async def _record_lab(python: str, work: Path) -> Path:
    from lab.sequence import FAULT, record_hang
    from lab.server import LabServer

    lab = LabServer.start(python, work / "lab")
    try:
        lab.set_fault(FAULT)
        return await record_hang(lab.url, lab.pid, work / "bundles")
    finally:
        lab.stop()


def shrink_lab(python: str, work: Path) -> dict[str, Any]:
    from lab.sequence import A_AT, B_AT, FAULT
    from lab.server import LabServer, server_version

    from mlxwatch.replay.options import Budget, ReplayOptions
    from mlxwatch.replay.run import plan_replay
    from mlxwatch.replay.shrink import shrink

    version = server_version(python)
    bundle = asyncio.run(_record_lab(python, work / version))
    lab = LabServer.load(work / version / "lab")
    fault = work / version / "fault-replay"
    fault.write_text(FAULT)
    saved = dict(os.environ)
    os.environ.update({**lab.environment(), "MLXWATCH_FAULT_FILE": str(fault)})
    try:
        plan = plan_replay(bundle, to=None, launch=True, allow_bundle_url=False)
        found = asyncio.run(shrink(plan, ReplayOptions(stall_timeout=1.5), Budget(trials=40, seconds=900),
                                   startup_timeout=120,
                                   on_trial=lambda t, n: log(f"replay shrink {version} trial {t.number} ({t.note}): "
                                                             f"{n} request(s): {'hung' if t.hung else 'no hang'} "
                                                             f"({t.seconds}s)")))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    kept = [r.seq for r in found.requests]
    return {"version": version, "requests": 20, "found": kept, "trials": len(found.trials), "seconds": found.seconds,
            "trial_seconds": [t.seconds for t in found.trials], "met": kept == [A_AT, B_AT]}


# --- the run ------------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    parts = args.parts.split(",")
    data: dict[str, Any] = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": git_commit(),
                            "machine": machine(), "load_before": load_average(), "parts": parts}
    work = Path(tempfile.mkdtemp(prefix="mlxwatch-bench-replay-"))
    try:
        if "cost" in parts:
            data["cost"] = cost(work, args.repeats, args.seconds)
        if "cost" in parts or "micro" in parts:
            data["micro"] = per_request()
        if "memory" in parts:
            data["memory"] = asyncio.run(_memory(64 * 2**20, 512, 4))
        if "fidelity" in parts:
            data["fidelity"] = asyncio.run(_fidelity(work))
        if "shrink" in parts:
            pythons = [str(p) for p in (OLD_PYTHON, TEST_PYTHON) if p.exists()]
            data["shrink"] = [shrink_lab(p, work) for p in pythons[-args.versions:]]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data["load_after"] = load_average()
    checks = [data["cost"]["goals"][i]["met"] for i in range(3)] if "cost" in data else []
    checks += [data[k]["met"] for k in ("memory", "fidelity") if k in data]
    checks += [s["met"] for s in data.get("shrink", [])]
    data["pass"] = all(checks)
    return data


def render(data: dict[str, Any]) -> str:
    out = [SECTION, "", f"{data['date']}, commit {data['commit']}, load average {data['load_before']} before and "
           f"{data['load_after']} after (2 shared cores, other engineers' tests running: a loaded machine). "
           "`python -m bench.replay` (bench/replay.py).", ""]
    if data.get("machine_note"):
        out += [data["machine_note"], ""]
    if "cost" in data:
        out += ["**The recorder's cost** (the door with `front.record: true` against the door without it and "
                "direct; the stand-in at 50 tok/s per stream, medians over repeats, paired with direct):", "",
                "| streams | path | tokens/s vs direct | added first token (ms) | added p99 gap (ms) |", "|---|---|---|---|---|"]
        for n, row in data["cost"]["summary"].items():
            for kind in ("door", "door+record"):
                r = row[kind]
                out.append(f"| {n} | {kind} | {r['rate_vs_direct'] * 100:.1f} % | {r['added_ttft_median_ms']:+.2f} | "
                           f"{r['added_gap_p99_ms']:+.2f} |")
        out += [""] + [f"- {g['goal']}: {g['measured']:.3f}: {'met' if g['met'] else 'MISSED'}"
                       for g in data["cost"]["goals"]] + [""]
        own = data["cost"].get("recorder_over_door") or {}
        if own:
            out += ["The recorder's own share (the door with it minus the door without it, paired per repeat; "
                    "at this load the cells' own jitter is several ms, far above either):", ""]
            out += [f"- {n} stream(s): first token {o['ttft_median_ms']:+.2f} ms, p99 gap {o['gap_p99_ms']:+.2f} ms, "
                    f"{o['tokens_per_s']:+.1f} tok/s" for n, o in own.items()] + [""]
    if "micro" in data:
        out += [f"**The recorder's own work per request**, alone (arrival and end recorded, no I/O; best of 3 x "
                f"{data['micro']['requests']:,}, at load average {data['micro'].get('load_average')}): "
                f"{data['micro']['us_per_request']:.1f} µs, against the 1 ms the door's goal allows it to add to a "
                "first token; it is not in a token's path (nothing per chunk).", ""]
    if "memory" in data:
        m = data["memory"]
        out += [f"**Memory at the bound**: `record_max_bytes` {m['bound_mb']:g} MiB, {m['body_kib']} KiB requests "
                "through the door (in the bench's own process, its client beside it):", "",
                "| requests | recorder holds (MiB) | requests kept | RSS (MiB) |", "|---|---|---|---|"]
        out += [f"| {s['requests']} | {s['held_mb']:.1f} | {s.get('kept', 0)} | {s['rss_mb']:.0f} |" for s in m["samples"]]
        out += ["", f"- {m['goal']}: {'met' if m['met'] else 'MISSED'}", ""]
    if "fidelity" in data:
        f = data["fidelity"]
        out += [f"**Fidelity**: {f['requests']} requests ({f['bytes'] / 2**20:.1f} MiB: JSON with odd spacing and "
                "unicode escapes, not JSON with NUL and 0xFF bytes, 1 MiB prompts) through a recording door to a "
                "server hashing each body it read; bundled; replayed to a second such server: "
                f"{f['replayed_server_side']} bodies read, each byte-identical to a recorded one: "
                f"{'yes' if f['equal_as_a_set'] else 'NO'}; in the recorded order: {'yes' if f['equal_in_order'] else 'no'} "
                "(the replay starts each request at its recorded offset; a large body still being sent can be "
                "overtaken by the next, as it could between the original clients).", ""]
    if "shrink" in data:
        out += ["**`--shrink` on the lab case** (the `sequence` fault: a prompt holding A, then within 5 s a streamed "
                "prompt holding B, livelocks the real server; 20 requests recorded through a door, #9 and #12 the "
                "trigger; a fresh server per trial, `--stall-timeout 1.5s`):", "",
                "| mlx-lm | found | trials | time (s) | per trial (s) |", "|---|---|---|---|---|"]
        for s in data["shrink"]:
            per = s["trial_seconds"]
            out.append(f"| {s['version']} | {' '.join(f'#{x}' for x in s['found'])} | {s['trials']} | "
                       f"{s['seconds']:.0f} | {min(per):.1f}-{max(per):.1f} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="cost,memory,fidelity,shrink")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--versions", type=int, default=2, help="shrink: on the newest N mlx-lm versions")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--render", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    return record("replay", args, lambda: run(args), SECTION, render)


if __name__ == "__main__":
    raise SystemExit(main())
