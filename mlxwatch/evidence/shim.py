"""The launch shim's heartbeat as evidence: a server started with ``mlxwatch launch`` counts its
deliveries from inside (``mlxwatch.shim``); the heartbeat is found by the proven server's PID (no
config needed) and judged by ``mlxwatch.shim.watch.ShimWatch``:

- tokens delivered to other clients (the probe's own subtracted): **delivered**;
- a long prompt being processed: **progress**;
- requests in flight with neither a token nor prompt progress for ``probe.stall_timeout``, a
  stale heartbeat (a native call holds the GIL, or the process is stopped), or a dead
  generation thread: a **stall** (one early probe per episode; the probe that confirms it is
  decisive);
- steps with no token (livelock), one step that never returns (blocked): what it **saw**.

``instances[].shim``: ``auto`` uses the heartbeat when the server has one; ``required`` also
says, once per server process, when it has none; ``off`` never reads it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from mlxwatch.evidence import Evidence, Seeing, Stall, Window
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.shim import heartbeat
from mlxwatch.shim.watch import POLL, ShimWatch


@dataclass
class ShimSource:
    identity: Callable[[], ProcessIdentity | None]  # the proven server, if any
    mode: Callable[[], str]  # instances[].shim, read at each look (a reload changes it)
    stall_timeout: Callable[[], float]  # probe.stall_timeout, likewise
    clock: Callable[[], float]
    name: str = "shim"
    watch: ShimWatch = field(default_factory=ShimWatch)
    read_at: float | None = None
    found: deque[tuple[float, str, str]] = field(default_factory=lambda: deque(maxlen=200))  # (at, kind, line)
    stall: Stall | None = None  # what the last reading showed
    seen: tuple[str, ...] = ()

    async def prime(self) -> None:
        return None

    async def look(self, window: Window) -> Evidence:
        notes = await self._read(window)
        inside = [(kind, line) for at, kind, line in self.found if window.start < at <= window.end]
        flows = [at for at, _, _ in self.found]
        return Evidence(delivered=tuple(line for kind, line in inside if kind == "delivered"),
                        progress=tuple(line for kind, line in inside if kind == "busy"),
                        stall=self.stall, seen=self.seen if window.probe is not None else (), notes=notes,
                        last_flow=max(flows) if flows else None)

    async def _read(self, window: Window) -> tuple[str, ...]:
        """A new reading when due: at every failed probe, else every ``POLL`` seconds."""
        ident = self.identity()
        watch = self.watch
        watch.mode, watch.stall_timeout = self.mode(), self.stall_timeout()
        if ident is None or watch.pid != ident.pid:
            self.found.clear()
            self.stall, self.seen = None, ()
        watch.reset_for(ident.pid if ident else None)
        if watch.mode == "off" or ident is None or not watch.should_read(self.clock()):
            self.stall, self.seen = None, ()
            return ()
        if window.probe is None and self.read_at is not None and window.end - self.read_at < POLL:
            return ()
        self.read_at = window.end
        hb, problem = await asyncio.to_thread(heartbeat.find, ident.pid, ident.create_time)
        if hb is None:
            watch.absent(self.clock())
            self.stall, self.seen = None, ()
            if watch.mode == "required":
                return (f"shim: required, but the server (PID {ident.pid}) has none: {problem}",)
            return ()
        probe_tokens = window.probe.generation.tokens if window.probe is not None else 0
        judged = watch.judge(hb, probe_tokens)
        self.found.extend((window.end, "delivered", line) for line in judged.delivered)
        self.found.extend((window.end, "busy", line) for line in judged.busy)
        self.seen = tuple(judged.evidence)
        self.stall = None
        if judged.stall is not None:
            self.stall = Stall(judged.stall, ("shim", judged.stall_key), source=self.name, event="shim_stall",
                               journal={"pid": hb.pid, "reason": judged.stall, "evidence": judged.evidence,
                                        "heartbeat": hb.summary()})
        return ()


def build(seeing: Seeing) -> ShimSource:
    """The launch shim's heartbeat, read when the server has one (``instances[].shim``)."""
    return ShimSource(identity=seeing.identity, mode=lambda: seeing.inst().shim,
                      stall_timeout=lambda: seeing.inst().probe.stall_timeout, clock=seeing.clock)
