"""The ``notify`` hook: run on verdict, recovery and gave-up with the incident as JSON on stdin.

Runs go one at a time, in event order, on one worker task, each with a timeout; a failing or
hanging hook is logged and never blocks the watchdog (it only delays the next hook run).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any, Sequence

from mlxwatch.host.commands import communicate_bounded, end_process

log = logging.getLogger("mlxwatch.notify")
NOTIFY_TIMEOUT = 30.0
STDERR_TAIL = 4096  # only the end of a failing hook's stderr is logged; the rest is read and dropped


async def run_notify(argv: Sequence[str], event: str, payload: dict[str, Any], timeout: float = NOTIFY_TIMEOUT) -> bool:
    """Run the hook once; True if it exited 0 in time. Never raises."""
    data = json.dumps({"event": event, **payload}, default=str).encode()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )
    except OSError as exc:
        log.warning("notify hook %s could not start: %s", argv[0], exc)
        return False
    try:
        async with asyncio.timeout(timeout):
            _, err = await communicate_bounded(proc, STDERR_TAIL, stdin_data=data, tail=True)
    except TimeoutError:
        await end_process(proc, ((signal.SIGKILL, 5.0),))
        log.warning("notify hook %s timed out after %gs for %s; killed", argv[0], timeout, event)
        return False
    except asyncio.CancelledError:  # the daemon is stopping: it leaves no hook running behind it
        await end_process(proc, ((signal.SIGKILL, 5.0),))
        raise
    if proc.returncode != 0:
        log.warning("notify hook %s exited %s for %s: %s", argv[0], proc.returncode, event,
                    err.data.decode(errors="replace").strip()[-200:])
        return False
    return True


class Notifier:
    """Hook runs in event order, one at a time (a chat hook must not post ``captured`` before
    ``verdict``), on a worker the watchers never wait for; a clean shutdown waits briefly."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = tuple(argv)
        self._queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._worker: asyncio.Task | None = None

    def fire(self, event: str, payload: dict[str, Any]) -> None:
        if not self.argv:
            return
        self._queue.put_nowait((event, payload))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="notify")

    async def _run(self) -> None:
        while not self._queue.empty():
            event, payload = self._queue.get_nowait()
            await run_notify(self.argv, event, payload)  # never raises; each run bounded by its timeout

    async def drain(self, timeout: float = 5.0) -> None:
        """Give the hooks still to run ``timeout`` seconds, then end the one running (its process
        group) and drop the rest."""
        worker = self._worker
        if worker is None or worker.done():
            return
        _, pending = await asyncio.wait([worker], timeout=timeout)
        if pending:
            log.warning("notify hook still running at shutdown; ended (%d more not run)", self._queue.qsize())
            worker.cancel()
            await asyncio.gather(worker, return_exceptions=True)
