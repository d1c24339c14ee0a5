"""Run external diagnostic tools (py-spy, sample, spindump) with a hard timeout each.

A diagnostic tool must never hang the capture: py-spy on macOS can block on a suspended target
(py-spy #390), so on timeout the tool gets SIGTERM, then SIGKILL, and the step is recorded as
timed out. Output is bounded. The runner is injectable so tests can check command construction.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

MAX_OUTPUT = 8 * 1024 * 1024


@dataclass
class CommandResult:
    """What one tool run produced. ``error`` is set when it did not run to a clean exit 0."""

    argv: list[str]
    returncode: int | None
    stdout: bytes
    stderr: bytes
    duration: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


Runner = Callable[[Sequence[str], float], Awaitable[CommandResult]]


async def run_command(argv: Sequence[str], timeout: float) -> CommandResult:
    """Run ``argv`` (no shell) for at most ``timeout`` seconds."""
    started = time.monotonic()
    argv = list(argv)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )
    except FileNotFoundError:
        return CommandResult(argv, None, b"", b"", 0.0, f"{argv[0]}: not found")
    except OSError as exc:
        return CommandResult(argv, None, b"", b"", 0.0, f"{argv[0]}: {exc.strerror or exc}")
    try:
        async with asyncio.timeout(timeout):
            stdout, stderr = await proc.communicate()
    except TimeoutError:
        await _end(proc)
        return CommandResult(argv, proc.returncode, b"", b"", time.monotonic() - started,
                             f"timed out after {timeout:g}s (ended with SIGTERM/SIGKILL)")
    except asyncio.CancelledError:
        await _end(proc)
        raise
    result = CommandResult(argv, proc.returncode, stdout[:MAX_OUTPUT], stderr[:MAX_OUTPUT],
                           time.monotonic() - started)
    if proc.returncode != 0:
        result.error = f"exit {proc.returncode}: {error_line(stderr or stdout)}"
    return result


def error_line(output: bytes) -> str:
    """The line that says what went wrong: py-spy prints "Error: ..." then a Rust backtrace."""
    lines = [l.strip() for l in output.decode("utf-8", "replace").splitlines() if l.strip()]
    for line in lines:
        if line.lower().startswith("error"):
            return line
    return lines[0] if lines else "no output"


async def _end(proc: asyncio.subprocess.Process) -> None:
    """SIGTERM the tool (its whole session), then SIGKILL if it does not go within 2 s."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        if proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # the tool's own session: started above with start_new_session
        except ProcessLookupError:
            return
        try:
            async with asyncio.timeout(wait):
                await proc.wait()
        except TimeoutError:
            continue
