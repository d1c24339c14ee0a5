"""Clients that load a lab server the way real users do, for tests and benchmarks."""

from __future__ import annotations

import threading
import time

import httpx


def retry_every(url: str, period: float, stop: threading.Event) -> None:
    """A streaming client that gives up after 1.5 s and retries every ``period`` s, until
    ``stop``: against a hung server each try is admitted (mlx-lm logs ``POST ... 200``) and
    never served. Run it in a thread."""
    body = {"messages": [{"role": "user", "content": "are you there?"}], "max_tokens": 4, "stream": True}
    while not stop.is_set():
        started = time.monotonic()
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, trust_env=False,
                              timeout=httpx.Timeout(1.5)) as response:
                for _ in response.iter_raw():
                    pass
        except httpx.HTTPError:
            pass
        stop.wait(max(0.0, period - (time.monotonic() - started)))
