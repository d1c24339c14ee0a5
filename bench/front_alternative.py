"""The alternative weighed for the front door (docs/front-door.md, "Why aiohttp"): a pass-through
built from uvicorn (server side, its h11 parser) and httpx (client side), doing the door's
forwarding job only: no delivery ledger, no token counting, no gate. It exists so that the
front bench (``bench/front_perf.py``) can put the library choice in numbers beside the door,
nginx and direct access; it is not a product and is never imported by ``mlxwatch``.

    python -m bench.front_alternative --listen 127.0.0.1:8082 --upstream http://127.0.0.1:8080

Needs uvicorn (the ``bench`` extra; ``bench/run.sh`` installs it). Ends on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
from typing import Any, Awaitable, Callable

import httpx
import uvicorn

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT (loopback)")
    parser.add_argument("--upstream", required=True, help="the server's base URL")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    uvicorn.run(make_app(args.upstream), host=host, port=int(port), http="h11", loop="asyncio",
                log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
