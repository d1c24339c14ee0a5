"""The scale benchmark's server: ``tests/lab/standin.py`` (one process, many ports, 4 streamed
tokens, ``/health``, ``/v1/models``), unchanged, plus a recorder of when each generation request
arrived on which port, so that probe gaps are measured where the probes land, outside the daemon::

    python -m bench.standin --ports 8100-8399 --record OUT.json

On SIGTERM it writes ``OUT.json`` and exits: ``posts`` (``[port, arrival]`` per generation
request) and ``requests`` (``[port, kind, arrival, done]`` per request, kind ``post``,
``health``, ``models``; done = the stand-in finished answering), epoch seconds. Everything else
is the stand-in's own code: the recorder wraps the request reader and only looks at the request
line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

import bench.common  # noqa: F401  (puts tests/ on sys.path: the stand-in is the test lab's)
from lab import standin

POSTS: list[tuple[int, float]] = []
REQUESTS: list[tuple[int, str, float, float]] = []
KINDS = {b"POST /v1/chat/completions": "post", b"GET /health": "health", b"GET /v1/models": "models"}


class _RecordingReader:
    """Passes reads through; notes the time a ``POST /v1/chat/completions`` request line arrives."""

    def __init__(self, reader: asyncio.StreamReader, port: int) -> None:
        self._reader, self._port = reader, port
        self.kind: str | None = None
        self.arrival = 0.0

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        head = await self._reader.readuntil(separator)
        self.arrival = time.time()
        self.kind = next((k for prefix, k in KINDS.items() if head.startswith(prefix)), "other")
        if self.kind == "post":
            POSTS.append((self._port, self.arrival))
        return head

    async def readexactly(self, n: int) -> bytes:
        return await self._reader.readexactly(n)

    def __getattr__(self, name: str):
        return getattr(self._reader, name)


_original_handle = standin._handle


async def _recording_handle(reader, writer, args) -> None:
    port = writer.get_extra_info("sockname")[1]
    rec = _RecordingReader(reader, port)
    await _original_handle(rec, writer, args)
    if rec.kind is not None:
        REQUESTS.append((port, rec.kind, rec.arrival, time.time()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.standin")
    parser.add_argument("--ports", required=True)
    parser.add_argument("--record", required=True)
    args = parser.parse_args(argv)

    def dump(*_: object) -> None:
        tmp = args.record + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"ports": standin.parse_ports(args.ports), "posts": POSTS, "requests": REQUESTS}, fh)
        os.replace(tmp, args.record)
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)
    standin._handle = _recording_handle  # the stand-in's server looks this name up per connection
    standin.main(["--ports", args.ports])


if __name__ == "__main__":
    sys.exit(main())
