"""Pass-throughs for comparison with the front door, each doing the door's forwarding job only
(no delivery ledger, no token counting, no gate), so the front bench (``bench/front_perf.py``)
can put the library choice in numbers beside the door, nginx and direct access. Not a product;
never imported by ``mlxwatch``. The HTTP libraries weighed for the door (docs/front-door.md,
"Why httptools"):

- ``--library aiohttp``: aiohttp's server and client (what the door was first built on): what
  they cost per request and per chunk with nothing of the door's.
- ``--library uvicorn``: uvicorn with its h11 parser for the server side, httpx for the client side.

    python -m bench.front_alternative --library uvicorn --listen 127.0.0.1:8082 --upstream http://127.0.0.1:8080

uvicorn comes with the ``bench`` extra (``bench/run.sh`` installs it). Ends on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
from typing import Any, Awaitable, Callable

import httpx

# RFC 9110 7.6.1: connection-specific fields, never forwarded (as the door does)
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding",
              b"upgrade", b"host", b"content-length"}

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def make_app(upstream: str) -> Callable[[dict[str, Any], Receive, Send], Awaitable[None]]:
    """An ASGI app forwarding every request to ``upstream`` and streaming the answer back as it
    arrives (``aiter_raw``: no decoding, no re-chunking)."""
    client = httpx.AsyncClient(base_url=upstream, timeout=None, trust_env=False,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await client.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        target = scope["raw_path"].decode() + (f"?{scope['query_string'].decode()}" if scope["query_string"] else "")
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        request = client.build_request(scope["method"], target, headers=headers, content=body)
        response = await client.send(request, stream=True)
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()

    return app


async def serve_aiohttp(upstream: str, host: str, port: int) -> None:
    """aiohttp's server and client joined the plainest way (low-level ``web.Server``, ``readany``
    then ``write``), as the door joined them when it was built on aiohttp, without its work."""
    import asyncio
    import signal

    import aiohttp
    from aiohttp import web

    hop = {k.decode() for k in HOP_BY_HOP}
    session = aiohttp.ClientSession(auto_decompress=False, connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=None), cookie_jar=aiohttp.DummyCookieJar())

    async def handle(request: web.BaseRequest) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
        async with session.request(request.method, upstream + request.raw_path, headers=headers,
                                   data=body or None, allow_redirects=False) as answer:
            response = web.StreamResponse(status=answer.status, headers={
                k: v for k, v in answer.headers.items() if k.lower() not in hop})
            await response.prepare(request)
            while chunk := await answer.content.readany():
                await response.write(chunk)
            await response.write_eof()
            return response

    runner = web.ServerRunner(web.Server(handle), handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    await runner.cleanup()
    await session.close()


def main() -> None:
    import asyncio

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--library", choices=("uvicorn", "aiohttp"), default="uvicorn")
    parser.add_argument("--listen", required=True, help="HOST:PORT (loopback)")
    parser.add_argument("--upstream", required=True, help="the server's base URL")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    if args.library == "aiohttp":
        asyncio.run(serve_aiohttp(args.upstream, host, int(port)))
        return
    import uvicorn

    uvicorn.run(make_app(args.upstream), host=host, port=int(port), http="h11", loop="asyncio",
                log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
