"""Evidence sources driven by a test: the log asked the way the watcher does, one window after
another (``LogLooks``), and what the kernel shows on a server's port (``KernelShows``)."""

from __future__ import annotations

import asyncio
import time

from mlxwatch.evidence import Evidence, Window
from mlxwatch.evidence.log import LogSource, ProgressTracker
from mlxwatch.host.sockets import Connection, Reading
from mlxwatch.probes import CheckReport


class KernelShows:
    """A kernel reader (``mlxwatch.host.sockets.Reader``): ``streams`` client streams of
    someone else's on ``port``, past their head (248 bytes, one segment), each growing by one
    token event (350 bytes, one segment) at every reading while ``flowing``."""

    def __init__(self, streams: int = 0, port: int = 9, flowing: bool = False) -> None:
        self.streams, self.port, self.flowing = streams, port, flowing
        self.sent, self.segments = 248, 1

    def __call__(self, ports) -> Reading:
        if self.flowing:
            self.sent, self.segments = self.sent + 350, self.segments + 1
        conns = tuple(Connection(self.port, ("127.0.0.1", 40000 + i), (i,), self.sent, 300, self.segments)
                      for i in range(self.streams))
        return Reading(time.monotonic(), conns)


class KernelAnswers:
    """A kernel reader with one client's request always waiting on ``port`` (someone else's: a
    non-streaming client such as the openai SDK's). ``answer()`` has the server answer it as
    mlx-lm does: at the next reading the connection is closed by the server (its TIME_WAIT
    remnant, no counts) and the client's next request waits on a new one."""

    def __init__(self, port: int = 9) -> None:
        self.port, self.client_port, self.closing = port, 41000, False

    def answer(self) -> None:
        self.closing = True

    def __call__(self, ports) -> Reading:
        conns = []
        if self.closing:
            conns.append(Connection(self.port, ("127.0.0.1", self.client_port), (self.client_port,), 0, 0,
                                    closed=True, counted=False))
            self.client_port, self.closing = self.client_port + 1, False
        conns.append(Connection(self.port, ("127.0.0.1", self.client_port), (self.client_port,), 0, 400))
        return Reading(time.monotonic(), tuple(conns))


class LogLooks:
    """A log source asked once per failed probe, each window following the last."""

    def __init__(self, tracker: ProgressTracker) -> None:
        self.t = 0.0
        self.source = LogSource(tracker, clock=lambda: self.t)

    @property
    def tracker(self) -> ProgressTracker:
        return self.source.tracker

    def prime(self) -> str | None:
        return self.source.tracker.prime()

    def observe(self, report: CheckReport | None) -> Evidence:
        self.t += 1.0
        return asyncio.run(self.source.look(Window(self.t - 1.0, self.t, probe=report, suspect=True)))
