"""All-thread stack dumps taken by a Python thread in the server, on request. Stdlib only.

Why not the stack signal alone: faulthandler dumps from the signal handler, without the GIL,
walking every thread's frames while those threads run; a busy server whose threads start and
end (``http.server`` starts one per request) can crash part way through (python/cpython#116008;
seen in this repository's CI on mlx-lm 0.31.3, and reproduced by ``tests/test_shim.py``). This
thread dumps under the GIL (``sys._current_frames``), while no other thread runs Python, so
nothing moves under it. It cannot answer while a native call holds the GIL; the reader sends
the stack signal only on evidence of that (no heartbeat either:
``mlxwatch.shim.heartbeat.request_stacks``), and faulthandler's walk is safe in exactly that
case, since no other thread can run Python either.

The protocol, both files in the private runtime dir (``layout``)::

    <pid>.ask       a FIFO: a reader writes one line, a token of hex digits
    <pid>.answers   one append per batch of requests, in a single write:
                        (an empty line)
                        # mlxwatch shim dump for: TOKEN [TOKEN ...]
                        (faulthandler's text for every thread but this one)
                        # end of dump

The thread keeps a write end of the FIFO open itself, so its blocking read waits (GIL
released) between requests instead of reading end-of-file. A reader starts its line with a
newline (a partial line someone left cannot swallow its token). The answers file is emptied
when it passes ``MAX_ANSWERS`` and no answer was written for ``QUIET_BEFORE_EMPTYING`` (so no
reader still waits for one), or at four times that size.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

HEADER = "# mlxwatch shim dump for:"
FOOTER = "# end of dump\n"
MAX_DEPTH = 100  # frames per thread, as faulthandler
MAX_THREADS = 100
MAX_ANSWERS = 4 * 1024 * 1024  # bytes of answers kept before the file is emptied...
QUIET_BEFORE_EMPTYING = 30.0  # ...once no answer was written for this long (no reader still reads one)
_TOKEN = re.compile(rb"[0-9a-f]{1,64}")
_NONBLOCK_NOFOLLOW = os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)


def format_threads(frames: dict[int, FrameType], skip: int | None = None, first: int | None = None) -> str:
    """``sys._current_frames()`` in faulthandler's all-thread format (innermost frame first),
    so one parser reads both (``mlxwatch.shim.stacks.parse_dump``). ``first`` (the generation
    thread) goes first, so ``MAX_THREADS`` never leaves it out."""
    idents = sorted((i for i in frames if i != skip), key=lambda i: i != first)
    out = []
    for n, ident in enumerate(idents):
        if n >= MAX_THREADS:
            out.append("...\n")
            break
        out.append(f"Thread 0x{ident:016x} (most recent call first):\n")
        depth = 0
        f: FrameType | None = frames[ident]
        while f is not None:
            if depth >= MAX_DEPTH:
                out.append("  ...\n")
                break
            code = f.f_code
            out.append(f'  File "{code.co_filename}", line {f.f_lineno or 0} in {code.co_name}\n')
            f, depth = f.f_back, depth + 1
        out.append("\n")
    return "".join(out)


def open_regular(path: str, flags: int, mode: int = 0o600) -> int:
    """Open ``path`` as a regular file of ours: never a link, and never blocking on a FIFO put
    in its place. Raises OSError."""
    fd = os.open(path, flags | _NONBLOCK_NOFOLLOW, mode)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


class Dumper:
    """One FIFO, one answers file, one daemon thread answering on them. ``first`` names the
    thread to put first in a dump (the generation thread, once known)."""

    def __init__(self, ask_path: str, answers_path: str, first: Callable[[], int | None] = lambda: None) -> None:
        self.ask_path = ask_path
        self.answers_path = answers_path
        self.first = first
        self.rfd = self.wfd = self.afd = -1
        self.ask_ino: int | None = None
        self.answers_ino: int | None = None
        self.retired = False
        self.lock = threading.Lock()  # the fds: closed by the thread, written to by retire()
        self.thread: threading.Thread | None = None
        self.answered_at = 0.0

    def open(self) -> None:
        """Make the FIFO (replacing one a process of the same PID left) and the answers file,
        and start the thread. Raises OSError; then nothing is left open."""
        try:
            try:
                os.unlink(self.ask_path)
            except FileNotFoundError:
                pass
            os.mkfifo(self.ask_path, 0o600)
            self.rfd = os.open(self.ask_path, os.O_RDONLY | _NONBLOCK_NOFOLLOW)
            if not stat.S_ISFIFO(os.fstat(self.rfd).st_mode):
                raise OSError(f"{self.ask_path} is not a FIFO")
            self.wfd = os.open(self.ask_path, os.O_WRONLY | _NONBLOCK_NOFOLLOW)
            os.set_blocking(self.rfd, True)
            self.afd = open_regular(self.answers_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.fchmod(self.afd, 0o600)
            self.ask_ino = os.fstat(self.rfd).st_ino
            self.answers_ino = os.fstat(self.afd).st_ino
        except OSError:
            self.close()
            raise
        self.thread = threading.Thread(target=self.serve, name="mlxwatch-shim-dumps", daemon=True)
        self.thread.start()

    def serving(self) -> bool:
        """Does its thread answer on files that are still ours? (A /tmp cleaner may remove
        them, a full disk may end the thread: the agent then opens a new dumper.)"""
        if self.retired or self.thread is None or not self.thread.is_alive():
            return False
        try:
            return (os.stat(self.ask_path).st_ino == self.ask_ino
                    and os.stat(self.answers_path).st_ino == self.answers_ino)
        except OSError:
            return False

    def retire(self) -> None:
        """Ask the thread to end (it closes the files); from any thread. Not in band: no line
        written to the FIFO can end it."""
        with self.lock:
            self.retired = True
            if self.wfd >= 0:
                try:
                    os.write(self.wfd, b"\n")  # wakes its read
                except OSError:
                    pass

    def close(self) -> None:
        with self.lock:
            for name in ("rfd", "wfd", "afd"):
                fd = getattr(self, name)
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                    setattr(self, name, -1)

    def serve(self) -> None:
        pending = b""
        try:
            while not self.retired:
                data = os.read(self.rfd, 65536)  # blocks with the GIL released
                if not data or self.retired:
                    return
                lines = (pending + data).split(b"\n")
                pending = lines.pop()[-64:]
                tokens = [t.decode() for t in lines if _TOKEN.fullmatch(t)]
                if tokens:
                    self.answer(tokens)
        except Exception:  # a full disk, a closed fd: the agent sees the thread gone and opens a new one
            return
        finally:
            self.close()

    def answer(self, tokens: list[str]) -> None:
        text = format_threads(sys._current_frames(), skip=threading.get_ident(), first=self.first())
        # the first newline puts the header on a line of its own after a block a full disk cut
        block = f"\n{HEADER} {' '.join(tokens)}\n{text}{FOOTER}".encode("utf-8", "backslashreplace")
        size, now = os.fstat(self.afd).st_size, time.monotonic()
        if size > 4 * MAX_ANSWERS or (size > MAX_ANSWERS and now - self.answered_at > QUIET_BEFORE_EMPTYING):
            os.ftruncate(self.afd, 0)
        os.write(self.afd, block)
        self.answered_at = now
