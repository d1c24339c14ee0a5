"""The daemon's HTTP transport: every connection it opens is registered as its own
(``mlxwatch.host.ownconns``) before a byte is sent, and let go when it closes, so kernel sight
never reads the daemon's probes as other clients' requests.

httpcore takes a network backend (its public ``AsyncNetworkBackend``); httpx's transport does
not pass one through, so the pool it builds is given ours (``registering_transport``). Where a
future httpx builds its pool otherwise, the transport is left as it is and said so by
``registers``: the kernel source still finds the connections it catches open
(``/proc/self/fd``), and ``tests/test_ownconns.py`` fails.
"""

from __future__ import annotations

import ssl
import typing

import httpcore
import httpx

from mlxwatch.host.ownconns import OWN, OwnConnections


class _Stream(httpcore.AsyncNetworkStream):
    def __init__(self, inner: httpcore.AsyncNetworkStream, own: OwnConnections, key: tuple[str, int] | None) -> None:
        self._inner, self._own, self._key = inner, own, key

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._inner.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            self._own.closed(self._key)
            self._key = None  # closed once, however often httpcore closes it

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        inner = await self._inner.start_tls(ssl_context, server_hostname, timeout)
        return _Stream(inner, self._own, self._key)  # the same TCP connection: the key goes with it

    def get_extra_info(self, info: str) -> typing.Any:
        return self._inner.get_extra_info(info)


class RegisteringBackend(httpcore.AsyncNetworkBackend):
    """httpcore's backend, registering each TCP connection's local address as ours."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend | None = None, own: OwnConnections = OWN) -> None:
        self._inner = inner if inner is not None else httpcore.AnyIOBackend()
        self._own = own

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: typing.Iterable[typing.Any] | None = None) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _Stream(stream, self._own, self._own.opened(stream.get_extra_info("client_addr")))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: typing.Iterable[typing.Any] | None = None
                                  ) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def registering_transport(own: OwnConnections = OWN, **kwargs: typing.Any) -> httpx.AsyncHTTPTransport:
    """``httpx.AsyncHTTPTransport(**kwargs)`` whose connections register in ``own``."""
    transport = httpx.AsyncHTTPTransport(**kwargs)
    pool = getattr(transport, "_pool", None)
    inner = getattr(pool, "_network_backend", None)
    if isinstance(inner, httpcore.AsyncNetworkBackend):
        pool._network_backend = RegisteringBackend(inner, own)  # type: ignore[union-attr]
    return transport


def registers(client: httpx.AsyncClient) -> bool:
    """Does ``client``'s transport register its connections?"""
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    return isinstance(getattr(pool, "_network_backend", None), RegisteringBackend)
