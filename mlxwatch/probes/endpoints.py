"""Endpoint probes: ``GET /health`` and ``GET /v1/models``.

Evidence only. ``/v1/models`` never touches the generation engine and ``/health`` before
mlx-lm 0.32 always says ok, so neither can make a server healthy; but ``/health`` 503 (0.32+)
says the generation thread died, and both timing out says the whole process is wedged.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from mlxwatch.config import ProbeConfig
from mlxwatch.probes.replies import body_summary

MAX_BODY = 4096


@dataclass
class EndpointResult:
    """What one GET saw. ``status`` is None when no HTTP response came back."""

    path: str
    status: int | None = None
    body: str = ""
    elapsed: float | None = None
    error: str | None = None

    @property
    def answered(self) -> bool:
        return self.status is not None

    @property
    def summary(self) -> str:
        if self.status is None:
            return f"no answer ({self.error})"
        return f"{self.status} {body_summary(self.body, limit=60)}".strip()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "summary": self.summary}


async def probe_endpoint(client: httpx.AsyncClient, url: str, path: str,
                         timeout: float = ProbeConfig.endpoint_timeout) -> EndpointResult:
    """GET ``url + path`` within ``timeout`` seconds, keeping at most 4 KB of the body."""
    result = EndpointResult(path)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("GET", url + path, timeout=httpx.Timeout(None)) as response:
                result.status = response.status_code
                body = bytearray()
                async for chunk in response.aiter_raw():
                    body += chunk[: MAX_BODY - len(body)]
                    if len(body) >= MAX_BODY:
                        break
                result.body = body.decode("utf-8", errors="replace")
    except TimeoutError:
        result.error = f"timed out after {timeout:g}s"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    result.elapsed = round(loop.time() - t0, 4)
    return result
