"""The ``notify`` hook: run on verdict, recovery and gave-up with the incident as JSON on stdin.

It runs in its own task with a timeout; a failing or hanging hook is logged and never blocks
the watchdog.
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
    """Fire-and-forget hook runs, tracked so a clean shutdown can wait for them briefly."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = tuple(argv)
        self.tasks: set[asyncio.Task] = set()

    def fire(self, event: str, payload: dict[str, Any]) -> None:
        if not self.argv:
            return
        task = asyncio.get_running_loop().create_task(run_notify(self.argv, event, payload))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def drain(self, timeout: float = 5.0) -> None:
        """Give running hooks ``timeout`` seconds, then end the rest (their process groups)."""
        if self.tasks:
            _, pending = await asyncio.wait(list(self.tasks), timeout=timeout)
            for task in pending:
                log.warning("notify hook still running at shutdown; ended")
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
