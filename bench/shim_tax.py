"""Shim tax: tokens/s of a real ``mlx_lm.server`` with and without the launch shim (issue 9).

Two real servers on the same tiny model (CPU), one started plainly and one through ``mlxwatch
launch``; both run for the whole benchmark, so load and thermal state are shared. A trial is one
streamed generation of ``--tokens`` tokens, batched (the default path, ``BatchGenerator.next``
per step) or seeded (served one at a time, through ``stream_generate``); its tokens/s is counted
by the client from the first to the last content chunk. Trials of the two servers alternate in
a shuffled order, ``--reps`` each. The noise is the spread of one condition's own trials; the
shim's cost is within the noise when the medians differ by less than that spread::

    python -m bench.shim_tax [--python .venvs/test/bin/python] [--reps 6] [--tokens 1500]

Results go to stdout and ``bench/results/shim-tax.json``. Only the PIDs started here are stopped.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

import bench.common  # noqa: F401  (puts tests/ on sys.path: the lab servers are the test lab's)
from lab.server import LabServer, server_version

ROOT = Path(__file__).resolve().parent.parent


def trial(url: str, tokens: int, seeded: bool) -> dict:
    body = {"messages": [{"role": "user", "content": "write"}], "max_tokens": tokens, "stream": True,
            "temperature": 0, **({"seed": 1} if seeded else {})}
    arrivals = []
    with httpx.Client(trust_env=False, timeout=600) as client:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and '"content"' in line:
                    arrivals.append(time.monotonic())
    span = arrivals[-1] - arrivals[0] if len(arrivals) > 1 else None
    return {"tokens": len(arrivals), "tokens_per_s": (len(arrivals) - 1) / span if span else None}


def wrapper_cost(batch: int = 8, calls: int = 200_000) -> dict:
    """The counting wrapper's own cost per ``BatchGenerator.next`` call, in-process and without a
    model: a ``next`` that returns one prompt response and ``batch`` generation responses, called
    ``calls`` times unwrapped and wrapped (best of 5 rounds each). Load-independent enough to say
    what the shim adds to each step; a real step costs milliseconds (tiny model on CPU) to tens of
    milliseconds (a 26B model on a Mac)."""
    from dataclasses import dataclass

    from mlxwatch.shim import agent as shim_agent

    @dataclass
    class P:
        uid: int
        progress: tuple

    @dataclass
    class G:
        uid: int
        token: int
        finish_reason: str | None

    result = ([P(0, (10, 20))], [G(i, 7, None) for i in range(batch)])

    def make():
        class Gen:
            def next(self):
                return result

            def insert_segments(self, segments, max_tokens=None):
                return list(range(len(segments)))

        return Gen

    plain_cls, wrapped_cls = make(), make()
    with tempfile.TemporaryDirectory() as tmp:
        agent = shim_agent.Agent(time.time(), None, False, tmp)
        shim_agent.patch_batch_generator(agent, wrapped_cls, "bench.Gen")
        wrapped = wrapped_cls()
        wrapped.insert_segments([[1]] * batch)

        def best(gen) -> float:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(calls):
                    gen.next()
                times.append((time.perf_counter() - t0) / calls)
            return min(times)

        base, counted = best(plain_cls()), best(wrapped)
    return {"batch": batch, "calls": calls, "unwrapped_us": base * 1e6, "wrapped_us": counted * 1e6,
            "added_us_per_step": (counted - base) * 1e6}


def recorder_cost(requests: int = 2000, events: int = 64, body_bytes: int = 2048) -> dict:
    """What ``launch --record`` adds, in-process and without a model: a request's arrival and end
    to the spool (a ``body_bytes`` body, the handler's tees on and off) and each SSE token event
    read in passing, written as mlx-lm writes them (best of 5 rounds each; the spool on this
    machine's disk, in a temporary directory). Paid in the request's own thread, not the batch
    loop's; the server's own ``json.dumps`` of each event costs about as much as the event's read."""
    import http.client
    import io
    import json as _json

    from mlxwatch.shim.recorder import RequestRecorder
    from mlxwatch.shim.spool import SpoolWriter

    body = _json.dumps({"messages": [{"role": "user", "content": "x" * body_bytes}], "stream": True}).encode()
    head = (b"Content-Type: application/json\r\nAuthorization: Bearer x\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n")
    event = ("data: " + _json.dumps({"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": None,
                                                                      "delta": {"role": "assistant", "content": " w"}}]})
             + "\n\n").encode()

    class Handler:
        command, path, client_address = "POST", "/v1/chat/completions", ("127.0.0.1", 5555)

    with tempfile.TemporaryDirectory() as tmp:
        rec = RequestRecorder(SpoolWriter(tmp, 1, 600.0, 256 * 1024**2), lambda line: None)

        def one(n_events: int, recording: bool) -> None:
            h = Handler()
            h.headers, h.rfile, h.wfile = http.client.parse_headers(io.BytesIO(head)), io.BytesIO(body), io.BytesIO()
            flight = rec.begin(h) if recording else None
            h.rfile.read(len(body))
            h.wfile.write(b"HTTP/1.0 200 OK\r\nContent-type: text/event-stream\r\n\r\n")
            for _ in range(n_events):
                h.wfile.write(event)
            if flight is not None:
                rec.end(h, flight, None)

        def best(n: int, n_events: int, recording: bool) -> float:
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(n):
                    one(n_events, recording)
                times.append((time.perf_counter() - t0) / n)
            return min(times)

        per_request = best(requests, 0, True) - best(requests, 0, False)
        per_event = ((best(requests // 10, events, True) - best(requests // 10, events, False)) / events
                     - per_request / events)
        assert rec.errors == 0
        rec.spool.close()
    return {"body_bytes": len(body), "per_request_us": per_request * 1e6, "per_event_us": per_event * 1e6}


def summarize(values: list[float]) -> dict:
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=str(ROOT / ".venvs" / "test" / "bin" / "python"),
                    help="the server's interpreter (mlx-lm installed)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0, help="for the shuffled order")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    costs = [wrapper_cost(batch) for batch in (1, 8, 32)]
    for c in costs:
        print(f"wrapper: {c['added_us_per_step']:.2f} us added per next() with {c['batch']} sequence(s) in the batch "
              f"({c['unwrapped_us']:.2f} -> {c['wrapped_us']:.2f} us)", flush=True)
    recording = recorder_cost()
    print(f"recorder (launch --record): {recording['per_request_us']:.0f} us a request (arrival and end to the "
          f"spool, {recording['body_bytes']} B body), {recording['per_event_us']:.1f} us a token event", flush=True)
    with tempfile.TemporaryDirectory(prefix="mlxwatch-shim-tax-") as tmp:
        plain = LabServer.start(args.python, Path(tmp) / "plain")
        shim_dir = Path(tmp) / "shim"
        shim_dir.mkdir()
        (shim_dir / "model").symlink_to(plain.model_dir)
        shimmed = LabServer.start(args.python, shim_dir, shim=())
        servers = {"plain": plain, "shim": shimmed}
        try:
            results: dict[str, dict[str, list[float]]] = {p: {"plain": [], "shim": []} for p in ("batched", "seeded")}
            for path in ("batched", "seeded"):
                for server in servers.values():  # warm-up, not counted
                    trial(server.url, 200, path == "seeded")
                order = [c for c in ("plain", "shim") for _ in range(args.reps)]
                rng.shuffle(order)
                for condition in order:
                    got = trial(servers[condition].url, args.tokens, path == "seeded")
                    if got["tokens_per_s"]:
                        results[path][condition].append(got["tokens_per_s"])
                    print(f"{path:8} {condition:5} {got['tokens']:5} tokens {got['tokens_per_s'] or 0:8.1f} tok/s",
                          flush=True)
        finally:
            for server in servers.values():
                server.stop()
    report = {"mlx_lm": server_version(args.python), "tokens": args.tokens, "reps": args.reps,
              "wrapper_cost": costs, "recorder_cost": recording, "paths": {}}
    for path, by in results.items():
        p, s = summarize(by["plain"]), summarize(by["shim"])
        noise = max(p["max"] - p["min"], s["max"] - s["min"])
        diff = s["median"] - p["median"]
        report["paths"][path] = {"plain": p, "shim": s, "median_difference": diff,
                                 "median_difference_pct": 100 * diff / p["median"], "noise": noise,
                                 "within_noise": abs(diff) <= noise, "trials": by}
        print(f"{path}: plain {p['median']:.1f} ({p['min']:.1f}-{p['max']:.1f}) tok/s, "
              f"shim {s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}) tok/s, "
              f"difference {diff:+.1f} tok/s ({100 * diff / p['median']:+.1f}%), noise {noise:.1f} tok/s: "
              f"{'within' if abs(diff) <= noise else 'OUTSIDE'} the noise")
    out = ROOT / "bench" / "results" / "shim-tax.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
