"""One full check of a server: the generation probe plus both endpoint probes, run together.

This is what ``mlxwatch check`` prints, what a bundle records as the probe transcript, and what
the watchdog runs on every cycle. The verdict comes from the generation probe alone; the
endpoints only sharpen the reason (``/health`` 503 means the generation thread died).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from mlxwatch.config import ProbeConfig
from mlxwatch.probes.endpoints import EndpointResult, probe_endpoint
from mlxwatch.probes.generation import Failure, GenerationProbeResult, probe_generation
from mlxwatch.probes.owned import registering_transport


@dataclass
class CheckReport:
    """A generation probe and the endpoint states seen at the same time."""

    url: str
    generation: GenerationProbeResult
    health: EndpointResult
    models: EndpointResult

    @property
    def healthy(self) -> bool:
        return self.generation.ok

    @property
    def lingering(self) -> asyncio.Task[None] | None:
        """The generation probe's lingering reader, if it gave up at a deadline (see ``run_check``)."""
        return self.generation.lingering

    @property
    def failure(self) -> str | None:
        if self.generation.ok:
            return None
        if self.health.status == 503 and self.generation.failure != Failure.CONNECT_REFUSED:
            return Failure.THREAD_DIED
        return self.generation.failure

    @property
    def reason(self) -> str:
        if self.generation.ok:
            return "ok"
        if self.failure == Failure.THREAD_DIED and self.generation.failure != Failure.THREAD_DIED:
            return f"server reports its generation thread died (/health {self.health.summary}); probe: {self.generation.reason}"
        return self.generation.reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "failure": self.failure,
            "reason": self.reason,
            "generation": self.generation.to_dict(),
            "health": self.health.to_dict(),
            "models": self.models.to_dict(),
        }


async def run_check(
    client: httpx.AsyncClient,
    url: str,
    *,
    first_token_timeout: float = ProbeConfig.first_token_timeout,
    timeout: float = ProbeConfig.timeout,
    max_tokens: int = ProbeConfig.max_tokens,
    endpoint_timeout: float = ProbeConfig.endpoint_timeout,
    linger: float = 0.0,
    read_until: float | None = None,
    cut: asyncio.Future[str] | None = None,
    on_token: Callable[[], None] | None = None,
) -> CheckReport:
    """Probe generation and the endpoints concurrently; never raises for the server's behaviour.

    A generation probe that fails fast (0.32 closes the in-flight stream as its generation
    thread dies) is followed by a second ``/health`` read: the first one raced the death.
    The whole check still ends within ``timeout`` plus at most ``endpoint_timeout``.

    ``linger`` is the generation probe's (see ``probe_generation``): after a deadline verdict
    its stream is read on in ``report.lingering`` rather than dropped on a struggling server;
    ``read_until`` bounds that reading from the sending instead (``probe_generation``);
    ``cut`` ends the probe's wait early, ``on_token`` hears its tokens (``probe_generation``).
    """
    loop = asyncio.get_running_loop()
    started = loop.time()
    generation, health, models = await asyncio.gather(
        probe_generation(
            client, url, first_token_timeout=first_token_timeout, timeout=timeout, max_tokens=max_tokens,
            linger=linger, read_until=read_until, cut=cut, on_token=on_token,
        ),
        probe_endpoint(client, url, "/health", endpoint_timeout),
        probe_endpoint(client, url, "/v1/models", endpoint_timeout),
    )
    remaining = timeout - (loop.time() - started)
    if not generation.ok and health.status == 200 and remaining > 0.5:
        health = await probe_endpoint(client, url, "/health", min(endpoint_timeout, remaining))
    return CheckReport(url, generation, health, models)


@dataclass(frozen=True)
class WaitedCheck:
    """The last check of ``check_until_healthy``, how long it waited and how many probes it took."""

    report: CheckReport
    seconds: float
    probes: int


async def check_until_healthy(
    url: str,
    *,
    first_token_timeout: float,
    timeout: float,
    max_tokens: int,
    endpoint_timeout: float,
    wait: float | None,
    on_wait: Callable[[float, str], None] = lambda seconds, reason: None,
) -> WaitedCheck:
    """``run_check`` once, or (``wait``) again until one is healthy or ``wait`` seconds have passed:
    for a server still loading in CI. After a quick failure the next probe comes a second after
    the last one began; a probe started in time may run its own ``timeout`` past ``wait``.
    ``on_wait(seconds, reason)`` hears each new reason to wait, once (not once per probe)."""
    async with make_client() as client:
        loop = asyncio.get_running_loop()
        started, probes, said = loop.time(), 0, None
        while True:
            began = loop.time()
            probes += 1
            report = await run_check(client, url, first_token_timeout=first_token_timeout, timeout=timeout,
                                     max_tokens=max_tokens, endpoint_timeout=endpoint_timeout)
            waited = loop.time() - started
            if report.healthy or wait is None or waited >= wait:
                return WaitedCheck(report, waited, probes)
            if report.reason != said:
                said = report.reason
                on_wait(waited, report.reason)
            pause = min(1.0 - (loop.time() - began), wait - waited)  # quick failures: once a second
            if pause > 0:
                await asyncio.sleep(pause)


def make_client() -> httpx.AsyncClient:
    """A long-lived client: no env proxies (loopback servers), one shared TLS context.

    The daemon makes one client per instance (its own connections: a wedged server cannot take
    another's); building a TLS context per client cost 18 ms and 0.7 MB each (5 s and 200 MB at
    300 instances), so every client shares one, built on first use. Its connections register
    as the daemon's own (``probes.owned``): kernel sight leaves them out."""
    limits = httpx.Limits(max_connections=64)
    return httpx.AsyncClient(trust_env=False, verify=_tls_context(), limits=limits,
                             transport=registering_transport(verify=_tls_context(), limits=limits))


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()
