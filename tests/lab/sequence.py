"""The lab's request sequence for the ``sequence`` fault (issue 35), shared by the replay tests
and ``bench/replay.py``: 20 chat requests GAP seconds apart, #A_AT holding MARK_A (not streamed)
and #B_AT holding MARK_B (streamed), the two that set the livelock off::

    server.set_fault(FAULT)
    tasks = await send_twenty("http://127.0.0.1:8081")   # each left to end on its own
    bundle = await record_hang(server.url, server.pid, out_dir)   # through a recording door, captured
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from mlxwatch.capture import CaptureRequest, capture_bundle
from mlxwatch.config import FrontConfig
from mlxwatch.front import FrontDoor

MARK_A, MARK_B = "zebra-cache-primer", "quokka-long-stream"
FAULT = f"sequence {MARK_A} {MARK_B} 5"  # the fault file's line: A, then B streamed within 5 s
GAP = 0.25  # seconds between the requests: each is answered before the next (the tiny model)
A_AT, B_AT = 9, 12  # which of the 20 carry the markers (1-based): B 3 requests (0.75 s) after A


def body(i: int) -> bytes:
    if i == A_AT:
        content, stream = f"Prime the cache: {MARK_A}.", False
    elif i == B_AT:
        content, stream = f"Now the long one: {MARK_B}. Tell me a story.", True
    else:
        content, stream = f"Question {i}: name a colour.", i % 2 == 0
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 3, "stream": stream,
                       "temperature": 0.0}).encode()


async def send_twenty(base: str) -> list[asyncio.Task]:
    """The 20 requests at GAP intervals, each left to end on its own (those after the hang hang);
    the last task closes the client once they have."""
    client = httpx.AsyncClient(trust_env=False, timeout=60.0)
    tasks = []

    async def one(i: int) -> None:
        try:
            async with client.stream("POST", base + "/v1/chat/completions", content=body(i),
                                     headers={"Content-Type": "application/json"}) as response:
                async for _ in response.aiter_raw():
                    pass
        except httpx.HTTPError:
            pass

    for i in range(1, 21):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(GAP)
    tasks.append(asyncio.create_task(_close_after(client, tasks[:])))
    return tasks


async def _close_after(client: httpx.AsyncClient, tasks: list[asyncio.Task]) -> None:
    try:
        await asyncio.gather(*tasks)
    finally:
        await client.aclose()


async def record_hang(server_url: str, pid: int, out_dir: Path) -> Path:
    """The 20 requests through a recording door of our own to the server at ``server_url``
    (the fault set), the hang captured into a bundle under ``out_dir`` while the last requests
    are in flight; its path. The door fails what is left and stops."""
    door = FrontDoor("lab", server_url, FrontConfig(listen=("127.0.0.1", 0), record=True))
    await door.start()
    try:
        host, port = door.address
        tasks = await send_twenty(f"http://{host}:{port}")
        await asyncio.sleep(2.0)  # the last ones are in flight (hung)
        bundle = await capture_bundle(CaptureRequest(pid=pid, out_dir=out_dir, label="lab", url=server_url, snapshots=1,
                                                     spacing=0.1, ceiling=20.0, recorded=door.recorded(),
                                                     recorded_at=time.monotonic(), probe_first_token_timeout=1.0))
        if bundle.lingering is not None:
            bundle.lingering.cancel()
        door.fail_in_flight("recorded")
        await asyncio.gather(*tasks, return_exceptions=True)
        return bundle.path
    finally:
        await door.stop(drain=0.5)
