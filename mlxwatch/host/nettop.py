"""macOS: per-connection byte counts from ``nettop`` (no root needed). Not built yet: the
reader says so, and the daemon falls back to the probe's rules."""

from __future__ import annotations

import time
from typing import Collection

from mlxwatch.host.sockets import Reading


class NettopReader:
    def __call__(self, ports: Collection[int]) -> Reading:
        return Reading(time.monotonic(), error="kernel sight on macOS (nettop) is not built yet")
