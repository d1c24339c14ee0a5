"""All-thread stack dumps taken by a Python thread in the server, on request. Stdlib only.

Why not the stack signal alone: faulthandler dumps from the signal handler, without the GIL,
walking every thread's frames while those threads run; a busy server whose threads start and
end (``http.server`` starts one per request) can crash part way through (python/cpython#116008;
seen in this repository's CI on mlx-lm 0.31.3, and reproduced by ``tests/test_shim.py``). This
thread dumps under the GIL (``sys._current_frames``), while no other thread runs Python, so
nothing moves under it. It cannot answer while a native call holds the GIL; the reader then
sends the stack signal (``mlxwatch.shim.heartbeat.request_stacks``), and faulthandler's walk
is safe in exactly that case, since no other thread can run Python either.

The protocol, both files in the private runtime dir (``layout``)::

    <pid>.ask       a FIFO: a reader writes one line, a token of hex digits
    <pid>.answers   one append per batch of requests, in a single write:
                        # mlxwatch shim dump for: TOKEN [TOKEN ...]
                        (faulthandler's text for every thread but this one)
                        # end of dump

The thread keeps a write end of the FIFO open itself, so its blocking read waits (GIL
released) between requests instead of reading end-of-file.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import threading
from types import FrameType

HEADER = "# mlxwatch shim dump for:"
FOOTER = "# end of dump\n"
QUIT = b"quit\n"  # from the agent, through the thread's own write end: a replaced dumper ends
MAX_DEPTH = 100  # frames per thread, as faulthandler
MAX_THREADS = 100
_TOKEN = re.compile(rb"[0-9a-f]{1,64}")


def format_threads(frames: dict[int, FrameType], skip: int | None = None) -> str:
    """``sys._current_frames()`` in faulthandler's all-thread format (innermost frame first),
    so one parser reads both (``mlxwatch.shim.stacks.parse_dump``)."""
    out = []
    for n, (ident, frame) in enumerate(frames.items()):
        if ident == skip:
            continue
        if n >= MAX_THREADS:
            out.append("...\n")
            break
        out.append(f"Thread 0x{ident:016x} (most recent call first):\n")
        depth = 0
        f: FrameType | None = frame
        while f is not None:
            if depth >= MAX_DEPTH:
                out.append("  ...\n")
                break
            code = f.f_code
            out.append(f'  File "{code.co_filename}", line {f.f_lineno or 0} in {code.co_name}\n')
            f, depth = f.f_back, depth + 1
        out.append("\n")
    return "".join(out)


class Dumper:
    """One FIFO, one answers file, one daemon thread answering on them."""

    def __init__(self, ask_path: str, answers_path: str) -> None:
        self.ask_path = ask_path
        self.answers_path = answers_path
        self.rfd = self.wfd = self.afd = -1
        self.ask_ino: int | None = None
        self.answers_ino: int | None = None

    def open(self) -> None:
        """Make the FIFO (replacing one a process of the same PID left) and the answers file,
        and start the thread. Raises OSError; then nothing is left open."""
        try:
            try:
                os.unlink(self.ask_path)
            except FileNotFoundError:
                pass
            os.mkfifo(self.ask_path, 0o600)
            self.rfd = os.open(self.ask_path, os.O_RDONLY | os.O_NONBLOCK)
            self.wfd = os.open(self.ask_path, os.O_WRONLY | os.O_NONBLOCK)
            os.set_blocking(self.rfd, True)
            self.afd = os.open(self.answers_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0),
                               0o600)
            if not stat.S_ISREG(os.fstat(self.afd).st_mode):
                raise OSError(f"{self.answers_path} is not a regular file")
            os.fchmod(self.afd, 0o600)
            self.ask_ino = os.fstat(self.rfd).st_ino
            self.answers_ino = os.fstat(self.afd).st_ino
        except OSError:
            self.close()
            raise
        threading.Thread(target=self.serve, name="mlxwatch-shim-dumps", daemon=True).start()

    def intact(self) -> bool:
        """Are both files still ours? (A /tmp cleaner may remove them: the agent then opens a
        new dumper and retires this one.)"""
        try:
            return (os.stat(self.ask_path).st_ino == self.ask_ino
                    and os.stat(self.answers_path).st_ino == self.answers_ino)
        except OSError:
            return False

    def retire(self) -> None:
        """Ask the thread to end (it closes the files); from any thread."""
        try:
            os.write(self.wfd, QUIT)
        except OSError:
            pass

    def close(self) -> None:
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
            while True:
                data = os.read(self.rfd, 4096)  # blocks with the GIL released
                if not data:
                    return
                lines = (pending + data).split(b"\n")
                pending = lines.pop()[-64:]
                if b"quit" in lines:
                    return
                tokens = [t.decode() for t in lines if _TOKEN.fullmatch(t)]
                if tokens:
                    self.answer(tokens)
        except OSError:
            return
        finally:
            self.close()

    def answer(self, tokens: list[str]) -> None:
        text = format_threads(sys._current_frames(), skip=threading.get_ident())
        block = f"{HEADER} {' '.join(tokens)}\n{text}{FOOTER}".encode("utf-8", "backslashreplace")
        os.write(self.afd, block)
