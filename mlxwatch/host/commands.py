"""Run external diagnostic tools (py-spy, sample, spindump) with a hard timeout each.

A diagnostic tool must never hang the capture (on a Mac py-spy's attach is unreliable,
"Operation timed out (os error 60)" in py-spy #242 and #754; ``sample`` and ``spindump`` sample
for seconds by design), so on timeout the tool gets SIGTERM, then SIGKILL, and the step is
recorded as timed out. Output is bounded while it is read (a tool or hook
spewing gigabytes must not grow the daemon), and the excess is drained so the child never
blocks on a full pipe. The runner is injectable so tests can check command construction.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

MAX_OUTPUT = 8 * 1024 * 1024
_CHUNK = 64 * 1024


@dataclass
class CommandResult:
    """What one tool run produced. ``error`` is set when it did not run to a clean exit 0.

    ``truncated``: stdout or stderr was longer than MAX_OUTPUT; only its first MAX_OUTPUT bytes
    are kept.
    """

    argv: list[str]
    returncode: int | None
    stdout: bytes = field(repr=False)  # megabytes: a repr (a log line, a task repr) must not copy them x4
    stderr: bytes = field(repr=False)
    duration: float
    error: str | None = None
    truncated: bool = False
    pid: int | None = None  # the tool's PID, which also names its session (start_new_session)

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
            stdout, stderr = await communicate_bounded(proc, MAX_OUTPUT)
    except TimeoutError:
        await end_process(proc)
        return CommandResult(argv, proc.returncode, b"", b"", time.monotonic() - started,
                             f"timed out after {timeout:g}s (ended with SIGTERM/SIGKILL)")
    except asyncio.CancelledError:
        await end_process(proc)
        raise
    truncated = stdout.truncated or stderr.truncated
    result = CommandResult(argv, proc.returncode, stdout.data, stderr.data,
                           time.monotonic() - started, truncated=truncated, pid=proc.pid)
    if proc.returncode != 0:
        result.error = f"exit {proc.returncode}: {error_line(stderr.data or stdout.data)}"
        if truncated:
            result.error += f" (output truncated at {MAX_OUTPUT} bytes)"
    return result


@dataclass
class Bounded:
    """At most a cap of what a stream carried; ``total`` is how much it carried in all."""

    data: bytes = b""
    total: int = 0

    @property
    def truncated(self) -> bool:
        return self.total > len(self.data)


async def read_bounded(stream: asyncio.StreamReader | None, cap: int, *, tail: bool = False) -> Bounded:
    """Read ``stream`` to EOF keeping only its first ``cap`` bytes (its last with ``tail``).

    The rest is read and dropped rather than left in the pipe: a writer blocked on a full pipe
    would never exit.
    """
    if stream is None:
        return Bounded()
    buf = bytearray()
    total = 0
    while chunk := await stream.read(_CHUNK):
        total += len(chunk)
        if tail:
            buf += chunk
            if len(buf) > cap:
                del buf[:len(buf) - cap]
        elif len(buf) < cap:
            buf += chunk[:cap - len(buf)]
    return Bounded(bytes(buf), total)


async def communicate_bounded(proc: asyncio.subprocess.Process, cap: int, *, stdin_data: bytes = b"",
                              tail: bool = False) -> tuple[Bounded, Bounded]:
    """``proc.communicate(stdin_data)`` keeping at most ``cap`` bytes per stream (see read_bounded).

    Both pipes are read at once, as communicate does, so a child filling one while we wait on
    the other cannot deadlock. Cancelling it cancels the reads; ending the process is the
    caller's job.
    """
    async def feed() -> None:
        if proc.stdin is None:
            return
        try:
            if stdin_data:
                proc.stdin.write(stdin_data)
                await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the child exited or closed stdin without reading it all: as communicate does
        finally:
            proc.stdin.close()

    reading = asyncio.ensure_future(asyncio.gather(
        feed(), read_bounded(proc.stdout, cap, tail=tail), read_bounded(proc.stderr, cap, tail=tail)))
    exited = asyncio.ensure_future(_exited(proc))
    try:
        either: set[asyncio.Future[Any]] = {reading, exited}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not reading.done():
            # The child exited, but a process it started (a hook's `server &`) holds its pipes:
            # take what is buffered for a moment, then close them so the reads end with it.
            await asyncio.wait({reading}, timeout=PIPE_GRACE)
            if not reading.done():
                _close_pipes(proc)
        _, out, err = await reading
    finally:
        exited.cancel()
        if not reading.done():
            reading.cancel()
            reading.add_done_callback(_retrieve)
    await proc.wait()
    return out, err


PIPE_GRACE = 0.5  # seconds to read what an exited child left in its pipes


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Until the child has exited. ``proc.wait()`` would also wait for its pipes to close
    (Python 3.11), which a grandchild may keep open for good; the return code is set at exit."""
    while proc.returncode is None:
        await asyncio.sleep(0.05)


def _retrieve(future: asyncio.Future) -> None:
    """Mark a cancelled gather's outcome as seen (else asyncio logs "exception was never retrieved")."""
    if not future.cancelled():
        future.exception()


def error_line(output: bytes) -> str:
    """The line that says what went wrong: py-spy prints "Error: ..." then a Rust backtrace."""
    lines = [l.strip() for l in output.decode("utf-8", "replace").splitlines() if l.strip()]
    for line in lines:
        if line.lower().startswith("error"):
            return line
    return lines[0] if lines else "no output"


TERM_THEN_KILL = ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0))


async def end_process(proc: asyncio.subprocess.Process,
                      steps: Sequence[tuple[int, float]] = TERM_THEN_KILL) -> None:
    """Signal the child's whole session with each (signal, grace) step until it has exited.

    Its output is drained meanwhile: ``wait()`` only returns once the pipes close, and a
    child killed with output still unread would otherwise never get there. The pipes are
    closed at the end, whatever holds them.
    """
    drain = asyncio.gather(read_bounded(proc.stdout, 0), read_bounded(proc.stderr, 0))
    try:
        for sig, wait in steps:
            if proc.returncode is not None:
                break
            try:
                os.killpg(proc.pid, sig)  # the child's own session: started with start_new_session
            except ProcessLookupError:
                break
            try:
                async with asyncio.timeout(wait):
                    await proc.wait()
            except TimeoutError:
                continue
    finally:
        drain.cancel()
        drain.add_done_callback(_retrieve)
        _close_pipes(proc)


def _close_pipes(proc: asyncio.subprocess.Process) -> None:
    """Close the pipes now rather than when the garbage collector finds them (a grandchild
    that escaped the session may hold them open for good)."""
    transport = getattr(proc, "_transport", None)  # asyncio's Process has no public close
    if transport is not None:
        transport.close()
