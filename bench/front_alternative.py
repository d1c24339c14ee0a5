"""Pass-throughs for comparison with the front door, each doing the door's forwarding job only
(no delivery ledger, no token counting, no gate), so the front bench (``bench/front_perf.py``)
can put the library choice in numbers beside the door, nginx and direct access. Not a product;
never imported by ``mlxwatch``. The HTTP libraries weighed for the door (docs/front-door.md,
"Why httptools"):

- ``--library aiohttp``: aiohttp's server and client (what the door was first built on): what
  they cost per request and per chunk with nothing of the door's.
- ``--library uvicorn``: uvicorn with its h11 parser for the server side, httpx for the client side.
- ``--library relay``: no library above the parser: asyncio's transports and httptools, each
  request forwarded from the callback that completes it, each read of the answer written on from
  the callback that receives it. The least a CPython proxy does: the floor under the door's cost.
  ``--uvloop`` runs it on uvloop's event loop.
- ``--library threads``: the relay's work on a thread per client connection with blocking
  sockets, no event loop: what another I/O model of CPython would buy.

    python -m bench.front_alternative --library uvicorn --listen 127.0.0.1:8082 --upstream http://127.0.0.1:8080

uvicorn comes with the ``bench`` extra (``bench/run.sh`` installs it). Ends on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
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


def _head(status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """An answer's head as the relays send it on: end-to-end headers, the body re-framed chunked."""
    head = [b"HTTP/1.1 %d OK\r\n" % status]
    head += [k + b": " + v + b"\r\n" for k, v in headers if k.lower() not in HOP_BY_HOP]
    return b"".join(head) + b"Transfer-Encoding: chunked\r\n\r\n"


class _RequestParts:
    """httptools' callbacks gathering one request, and the request as the server gets it."""

    def __init__(self) -> None:
        self.url, self.headers, self.body, self.complete = b"", [], [], False  # type: ignore[var-annotated]

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def upstream_request(self, method: bytes) -> bytes:
        body = b"".join(self.body)
        lines = [method + b" " + self.url + b" HTTP/1.1\r\nHost: upstream\r\n"]
        lines += [k + b": " + v + b"\r\n" for k, v in self.headers if k.lower() not in HOP_BY_HOP]
        return b"".join(lines) + b"Content-Length: %d\r\n\r\n" % len(body) + body


class _RelayUp(asyncio.Protocol):
    """One connection to the server, kept while the server keeps it: writes a request, re-frames
    its answer (chunked); a body that runs until the server closes (mlx_lm.server's, HTTP/1.0)
    ends at the close."""

    def __init__(self, idle: list["_RelayUp"]) -> None:
        import httptools

        self.idle, self.down, self.closed = idle, None, False
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.answering = False  # the answer's head has gone to the client

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def send(self, down: Any, request: bytes) -> None:
        self.down, self.headers, self.answering = down, [], False
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.answering = True
        self.down.transport.write(_head(self.parser.get_status_code(), self.headers))

    def on_body(self, body: bytes) -> None:
        self.down.transport.write(b"%x\r\n%b\r\n" % (len(body), body))

    def on_message_complete(self) -> None:
        down, self.down = self.down, None
        down.transport.write(b"0\r\n\r\n")
        self.idle.append(self)
        down.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.idle:
            self.idle.remove(self)
        down, self.down = self.down, None
        if down is not None and self.answering and exc is None:  # the body ran until the server closed
            down.transport.write(b"0\r\n\r\n")
            down.transport.resume_reading()
        elif down is not None:
            down.transport.close()



class _RelayDown(asyncio.Protocol, _RequestParts):
    """One client connection: parses a request and forwards it from the callback that completes it."""

    def __init__(self, upstream: tuple[str, int], idle: list[_RelayUp]) -> None:
        import httptools

        _RequestParts.__init__(self)
        self.upstream, self.idle = upstream, idle
        self.parser = httptools.HttpRequestParser(self)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        request = self.upstream_request(self.parser.get_method())
        _RequestParts.__init__(self)
        self.transport.pause_reading()  # one request at a time per connection
        while self.idle:
            up = self.idle.pop()
            if not up.closed:
                up.send(self, request)
                return
        asyncio.get_running_loop().create_task(self._connect(request))

    async def _connect(self, request: bytes) -> None:
        _, up = await asyncio.get_running_loop().create_connection(lambda: _RelayUp(self.idle), *self.upstream)
        up.send(self, request)

    def connection_lost(self, exc: Exception | None) -> None: ...


async def serve_relay(upstream: str, host: str, port: int) -> None:
    """The bare relay (``--library relay``): no limits, no timeouts, no backpressure, no errors
    handled; a measuring stick, not a proxy to run."""
    import signal
    from urllib.parse import urlsplit

    parts = urlsplit(upstream)
    idle: list[_RelayUp] = []
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    server = await asyncio.get_running_loop().create_server(lambda: _RelayDown(address, idle), host, port)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)
    await stop.wait()
    server.close()


class _Answer:
    """httptools' callbacks for one answer read by a relay thread: what one ``recv`` brings is
    sent on to the client before the next."""

    def __init__(self) -> None:
        self.headers, self.done = [], False  # type: ignore[var-annotated]
        self.out: list[bytes] = []
        self.parser: Any = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.out.append(_head(self.parser.get_status_code(), self.headers))

    def on_body(self, body: bytes) -> None:
        self.out.append(b"%x\r\n%b\r\n" % (len(body), body))

    def on_message_complete(self) -> None:
        self.out.append(b"0\r\n\r\n")
        self.done = True


def _relay_thread(client: Any, address: tuple[str, int]) -> None:
    """One client connection on its own thread with blocking sockets: no event loop between a
    byte's arrival and its ``send`` on. The server connection is kept while the server keeps it,
    and made again for the next request when it closes (as mlx_lm.server does after each answer,
    its body ending with the connection)."""
    import socket

    import httptools

    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    up = None
    try:
        while True:
            req = _RequestParts()
            parser = httptools.HttpRequestParser(req)
            while not req.complete:
                data = client.recv(65536)
                if not data:
                    return
                parser.feed_data(data)
            if up is None:
                up = socket.create_connection(address)
                up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up.sendall(req.upstream_request(parser.get_method()))
            answer = _Answer()
            answer.parser = reader = httptools.HttpResponseParser(answer)
            while not answer.done:
                data = up.recv(65536)
                if not data:  # the body ran until the server closed
                    answer.out.append(b"0\r\n\r\n")
                    answer.done = True
                else:
                    reader.feed_data(data)
                client.sendall(b"".join(answer.out))
                answer.out.clear()
            if not data or not reader.should_keep_alive():
                up.close()
                up = None
    finally:
        client.close()
        if up is not None:
            up.close()


def serve_threads(upstream: str, host: str, port: int) -> None:
    """The threaded relay (``--library threads``): a measuring stick like the relay."""
    import signal
    import socket
    import threading
    from urllib.parse import urlsplit

    parts = urlsplit(upstream)
    address = (parts.hostname or "127.0.0.1", parts.port or 80)
    listener = socket.create_server((host, port), backlog=512)
    signal.signal(signal.SIGTERM, lambda *_: listener.close())
    try:
        while True:
            client, _ = listener.accept()
            threading.Thread(target=_relay_thread, args=(client, address), daemon=True).start()
    except OSError:
        return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--library", choices=("uvicorn", "aiohttp", "relay", "threads"),
                        default="uvicorn")
    parser.add_argument("--listen", required=True, help="HOST:PORT (loopback)")
    parser.add_argument("--upstream", required=True, help="the server's base URL")
    parser.add_argument("--uvloop", action="store_true", help="relay only: on uvloop's event loop")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    if args.library == "aiohttp":
        asyncio.run(serve_aiohttp(args.upstream, host, int(port)))
        return
    if args.library == "threads":
        serve_threads(args.upstream, host, int(port))
        return
    if args.library == "relay":
        if args.uvloop:
            import uvloop

            uvloop.run(serve_relay(args.upstream, host, int(port)))
        else:
            asyncio.run(serve_relay(args.upstream, host, int(port)))
        return
    import uvicorn

    uvicorn.run(make_app(args.upstream), host=host, port=int(port), http="h11", loop="asyncio",
                log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
