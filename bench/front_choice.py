"""What the front door costs: the same requests direct to a stand-in server and through the door.

    .venvs/test/bin/python -m bench.front_choice [--requests 300] [--chunks 2000]

A small aiohttp stand-in answers non-streaming requests and streams SSE chunks as fast as it
can; one client (aiohttp) measures per-request latency (p50/p99) of the non-streaming answer and
the chunk rate of one long stream, direct and through the door (aiohttp server + client), in one
process on loopback. Standalone (not part of bench/run.py yet); prints one JSON object.

Not measured: an h11/uvicorn + httpx variant of the door (the alternative weighed in
docs/front-door.md, "Why aiohttp").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
from aiohttp import web

from mlxwatch.config import FrontConfig
from mlxwatch.front import FrontDoor

ANSWER = json.dumps({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}],
                     "usage": {"completion_tokens": 1}}).encode()
CHUNK = b'data: {"choices": [{"index": 0, "delta": {"content": "tok"}, "finish_reason": null}]}\n\n'


async def _standin(chunks: int) -> web.AppRunner:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(body=ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(chunks):
            await resp.write(CHUNK)
        await resp.write(b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _measure(base: str, requests: int) -> dict:
    async with aiohttp.ClientSession() as session:
        url = base + "/v1/chat/completions"
        latencies = []
        for _ in range(requests):
            t0 = time.perf_counter()
            async with session.post(url, json={"messages": []}) as r:
                await r.read()
            latencies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        seen = 0
        async with session.post(url, json={"messages": [], "stream": True}) as r:
            async for line in r.content:
                seen += line.startswith(b"data:")
        stream_s = time.perf_counter() - t0
    return {"p50_ms": round(_q(latencies, 0.5) * 1e3, 3), "p99_ms": round(_q(latencies, 0.99) * 1e3, 3),
            "stream_events_per_s": round(seen / stream_s)}


async def main(requests: int, chunks: int) -> dict:
    runner = await _standin(chunks)
    port = runner.addresses[0][1]
    upstream = f"http://127.0.0.1:{port}"
    door = FrontDoor("bench", upstream, FrontConfig(listen=("127.0.0.1", 0)))
    await door.start()
    try:
        host, dport = door.address
        direct = await _measure(upstream, requests)
        through = await _measure(f"http://{host}:{dport}", requests)
        view = door.view()
    finally:
        await door.stop(drain=1.0)
        await runner.cleanup()
    return {"requests": requests, "chunks": chunks, "direct": direct, "door": through,
            "door_tokens_counted": view.tokens_total}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--chunks", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.requests, args.chunks))))
