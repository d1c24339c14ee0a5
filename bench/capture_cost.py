"""Capture cost: what one evidence bundle costs on a hung real server, with the default settings.

For each version and fault (``spin``, ``block``, ``die``): a fresh server, the fault switched
on and bitten by one streaming request left in flight (as the watchdog's own probes leave it),
then ``capture_bundle`` exactly as the daemon calls it at the default config (3 snapshots 2 s
apart, ceiling 60 s, the capture's probe limited to min(first_token_timeout 45 s, 10 s), cut by
the window's end). Measured: the wall time of the whole capture and of each step (from the
manifest), the bundle's size on disk, and every ``py-spy dump`` the capture ran, timed around
the subprocess (JSON dumps, and ``--native`` text dumps on Linux).

How long py-spy stops the target: a dump's wall time is an upper bound (it includes py-spy's
own start and symbol loading before it attaches). The pause itself is measured on a healthy
server streaming a long generation: each dump's pause shows as the one inter-token gap that
spans it, minus the usual gap.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import httpx

from bench.common import log, summary
from mlxwatch.capture import CaptureRequest, capture_bundle, pyspy
from mlxwatch.config import CaptureConfig, ProbeConfig
from mlxwatch.host.commands import run_command
from lab.server import LabServer, server_version

FAULTS = ("spin", "block", "die")


def _bundle_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


async def _bite(url: str) -> asyncio.Task:
    """A streaming request left in flight: the fault bites on the batch step that serves it."""
    client = httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(300.0))

    async def go() -> None:
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions",
                                     json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                                           "stream": True}) as r:
                async for _ in r.aiter_bytes():
                    pass
        except (httpx.HTTPError, asyncio.CancelledError):
            pass
        finally:
            await client.aclose()

    task = asyncio.ensure_future(go())
    await asyncio.sleep(1.0)
    return task


async def timed_capture(pid: int, out_dir: Path, label: str, url: str, log: Path, biter: asyncio.Task,
                        runner: Any = run_command, **kw: Any) -> tuple[Any, float]:
    """``capture_bundle`` of ``pid`` as the daemon calls it at the default config, then what it
    left running (its lingering probe, the biting request) ended; the bundle and its wall time."""
    cap, p = CaptureConfig(), ProbeConfig()  # the defaults, as the daemon passes them
    req = CaptureRequest(
        pid=pid, out_dir=out_dir, label=label, url=url, log=log,
        snapshots=cap.snapshots, spacing=cap.spacing, ceiling=cap.ceiling, log_tail_lines=cap.log_tail_lines,
        probe_first_token_timeout=min(p.first_token_timeout, 10.0), probe_timeout=min(p.timeout, 20.0),
        verdict="benchmark capture", keep=1000, **kw,
    )
    t0 = time.monotonic()
    bundle = await capture_bundle(req, runner=runner)
    wall = time.monotonic() - t0
    if bundle.lingering is not None:
        bundle.lingering.cancel()
        await asyncio.gather(bundle.lingering, return_exceptions=True)
    biter.cancel()
    await asyncio.gather(biter, return_exceptions=True)
    return bundle, wall


async def one_capture(server: LabServer, fault: str, out_dir: Path) -> dict[str, Any]:
    server.relaunch()
    server.set_fault(fault)
    biter = await _bite(server.url)
    dumps: list[dict[str, Any]] = []

    async def timed(argv: Sequence[str], timeout: float):
        t0 = time.monotonic()
        result = await run_command(argv, timeout)
        if "py-spy" in os.path.basename(str(argv[0])) or any("py-spy" in str(a) for a in argv[:3]):
            kind = "json" if "--json" in argv else ("native" if "--native" in argv else "text")
            dumps.append({"kind": kind, "nonblocking": "--nonblocking" in argv, "wall_s": time.monotonic() - t0,
                          "ok": result.ok})
        return result

    bundle, wall = await timed_capture(server.pid, out_dir, f"bench-{fault}", server.url, server.log_path, biter,
                                       runner=timed)
    server.set_fault("")
    m = bundle.manifest
    return {
        "fault": fault, "wall_s": wall, "manifest_duration_s": m.get("duration"),
        "steps": {s["name"]: {"duration": s["duration"], "start": s["start"], "outcome": s["outcome"]}
                  for s in m.get("steps", [])},
        "bundle_bytes": _bundle_bytes(bundle.path), "files": len(m.get("files", [])),
        "kind": bundle.classification.kind, "confidence": bundle.classification.confidence,
        "pyspy_dumps": dumps,
    }


async def pause_on_generation(server: LabServer, dumps_per_kind: int = 5) -> dict[str, Any]:
    """py-spy dumps against a server streaming tokens: the gap each dump leaves in the stream."""
    server.relaunch()
    exe = pyspy.find_py_spy()
    if exe is None:
        return {"error": "py-spy not found"}
    streams: list[list[float]] = []  # token arrival times, one list per generation
    windows: list[tuple[str, float, float]] = []
    finished = asyncio.Event()

    async def stream() -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=300) as client:
            while not finished.is_set():  # generations back to back until every dump is done
                arrivals: list[float] = []
                streams.append(arrivals)
                async with client.stream("POST", f"{server.url}/v1/chat/completions",
                                         json={"messages": [{"role": "user", "content": "go"}], "max_tokens": 3500,
                                               "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            arrivals.append(time.monotonic())

    task = asyncio.ensure_future(stream())
    await asyncio.sleep(1.5)
    for kind in ["json", "native"] * dumps_per_kind:
        argv = pyspy.dump_command(exe, server.pid, as_json=kind == "json", native=kind == "native")
        t0 = time.monotonic()
        await run_command(argv, 10.0)
        windows.append((kind, t0, time.monotonic()))
        await asyncio.sleep(0.4)
    await asyncio.sleep(0.5)
    finished.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    gaps = [(a, b) for arrivals in streams for a, b in itertools.pairwise(arrivals)]
    arrivals = [t for s in streams for t in s]
    usual = statistics.median(b - a for a, b in gaps) if gaps else None
    out: dict[str, Any] = {"tokens": len(arrivals), "usual_gap_ms": usual * 1000 if usual else None, "dumps": []}
    for kind, t0, t1 in windows:
        spanning = [b - a for a, b in gaps if b > t0 and a < t1]  # gaps overlapping the dump (None: between generations)
        longest = max(spanning) if spanning else None
        out["dumps"].append({"kind": kind, "wall_s": t1 - t0, "longest_gap_s": longest,
                             "pause_s": (longest - usual) if longest is not None and usual is not None else None})
    return out


async def run_async(python: str, workdir: Path, reps: int, captures: bool = True, pause: bool = True) -> dict[str, Any]:
    version = server_version(python)
    server = LabServer.start(python, workdir / "server")
    res: dict[str, Any] = {"mlx_lm": version, "captures": [], "pause": None}
    try:
        for _rep in range(reps if captures else 0):
            for fault in FAULTS:
                r = await one_capture(server, fault, workdir / "bundles")
                res["captures"].append(r)
                log(f"capture {version} {fault}: {r['wall_s']:.2f}s, {r['bundle_bytes'] / 1024:.0f} KB, {r['kind']}, "
                    f"dumps " + ", ".join(f"{d['kind']} {d['wall_s']:.2f}s" for d in r["pyspy_dumps"]))
        if not pause:
            return res
        res["pause"] = await pause_on_generation(server)
        log(f"capture {version}: py-spy pause on a generating server: " + ", ".join(
            f"{d['kind']} {1000 * (d['pause_s'] or 0):.0f}ms (wall {d['wall_s']:.2f}s)" for d in res["pause"]["dumps"]))
    finally:
        server.stop()
    return res


def run(workdir: Path, pythons: dict[str, str], reps: int, captures: bool = True, pause: bool = True) -> dict[str, Any]:
    """The captures on hung servers and/or the pause measured on generating ones."""
    out = {}
    for key, py in pythons.items():
        out[key] = asyncio.run(run_async(py, workdir / f"capture-{key}", reps, captures, pause))
    return {"reps": reps, "versions": out}


def merge(captures: dict[str, Any] | None, pauses: dict[str, Any] | None) -> dict[str, Any] | None:
    if captures is None:
        return pauses
    if pauses is not None:
        for key, v in pauses["versions"].items():
            captures["versions"].setdefault(key, {"mlx_lm": v["mlx_lm"], "captures": []})["pause"] = v["pause"]
    return captures


def tables(data: dict[str, Any]) -> dict[str, Any]:
    """Per version and fault: min/median/max of the wall time, steps, size and dump times."""
    out: dict[str, Any] = {}
    for key, v in data["versions"].items():
        for fault in FAULTS:
            caps = [c for c in v["captures"] if c["fault"] == fault]
            steps = sorted({s for c in caps for s in c["steps"]})
            dumps = [d for c in caps for d in c["pyspy_dumps"]]
            out[f"{key}/{fault}"] = {
                "wall": summary(c["wall_s"] for c in caps),
                "steps": {s: summary(c["steps"][s]["duration"] for c in caps if s in c["steps"]) for s in steps},
                "bundle_kb": summary(c["bundle_bytes"] / 1024 for c in caps),
                "dump_json": summary(d["wall_s"] for d in dumps if d["kind"] == "json"),
                "dump_native": summary(d["wall_s"] for d in dumps if d["kind"] == "native"),
                "kinds": sorted({c["kind"] for c in caps}),
            }
    return out


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    from bench.common import OLD_PYTHON, TEST_PYTHON

    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-cap-") as tmp:
        data = run(Path(tmp), {"mlx-lm-0.31": str(OLD_PYTHON), "mlx-lm-0.32": str(TEST_PYTHON)}, args.reps)
        print(json.dumps(tables(data), indent=1))
        print(json.dumps({k: v["pause"] for k, v in data["versions"].items()}, indent=1))
