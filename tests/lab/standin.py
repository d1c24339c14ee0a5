"""A tiny token-streaming stand-in for ``mlx_lm.server``, for scale benchmarks and edge tests.

It answers ``/health``, ``/v1/models`` and streaming ``/v1/chat/completions`` (4 tokens, SSE,
``[DONE]``) the way mlx-lm does, with no model: one process can serve hundreds of ports, so a
benchmark measures the watchdog, not the model. Its command line is *not* an mlx-lm server's,
which is what the identity tests need from a "stranger on the port"::

    python tests/lab/standin.py --ports 8100-8109 [--mode hang] [--mode-file PATH]

``--mode-file`` names a file whose first word switches the mode at run time: ``ok`` (default),
``hang`` (accept, read the request, never answer), ``garbage`` (a malformed stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

STANDIN = str(Path(__file__).resolve())  # run it as a script: stdlib only, no mlxwatch
TOKENS = ("Hello", " from", " the", " stand-in")


def _mode(args: argparse.Namespace) -> str:
    if args.mode_file:
        try:
            with open(args.mode_file, encoding="utf-8") as fh:
                words = fh.read().split()
            return words[0] if words else "ok"
        except OSError:
            return "ok"
    return args.mode


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, args: argparse.Namespace) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip() or 0)
        if length:
            await reader.readexactly(length)
        method, path = request_line.split(" ")[:2]
        mode = _mode(args)
        if path == "/health":
            await _send(writer, 200, "application/json", b'{"status": "ok"}')
        elif path == "/v1/models":
            await _send(writer, 200, "application/json", b'{"object": "list", "data": []}')
        elif method == "POST" and path == "/v1/chat/completions":
            if mode == "hang":
                await asyncio.Event().wait()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            if mode == "garbage":
                writer.write(b'data: {"choices": [{"delta": "not an object"}]}\n\n')
            else:
                for i, token in enumerate(TOKENS):
                    chunk = {"choices": [{"index": 0, "delta": {"content": token},
                                          "finish_reason": "length" if i == len(TOKENS) - 1 else None}]}
                    writer.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        else:
            await _send(writer, 404, "application/json", b'{"error": "not found"}')
    except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def _send(writer: asyncio.StreamWriter, status: int, ctype: str, body: bytes) -> None:
    writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                 "Connection: close\r\n\r\n".encode() + body)
    await writer.drain()


def parse_ports(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


async def serve(args: argparse.Namespace) -> None:
    servers = [await asyncio.start_server(lambda r, w: _handle(r, w, args), "127.0.0.1", port)
               for port in parse_ports(args.ports)]
    print("ready", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tests/lab/standin.py")
    parser.add_argument("--ports", required=True, help="a port or a range, e.g. 8100-8399")
    parser.add_argument("--mode", default="ok", choices=["ok", "hang", "garbage"])
    parser.add_argument("--mode-file")
    try:
        asyncio.run(serve(parser.parse_args(argv)))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    sys.exit(main())
