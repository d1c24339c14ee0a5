"""Read an mlx_lm.server log: a bounded tail, and the markers that tell what happened.

Shared by capture (evidence) and the watchdog (is prompt processing advancing?). Reads at
most a few MB from the end of the file, however large it has grown; a missing or unreadable
log is "no evidence", never an error.
"""

from __future__ import annotations

import datetime
import io
import os
import re
import stat
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

from mlxwatch.storage import open_regular

RECENT_BYTES = 4 * 1024 * 1024

PROGRESS = re.compile(r"Prompt processing progress: (\d+)/(\d+)")
_STAMP = re.compile(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})[,.](\d{3})\b")  # logging's asctime
# mlx-lm's access line for a generation request: logged by send_response(200) once the batch
# loop has taken the request, before its first token. An admission, never a completion.
ADMISSION = re.compile(r'"POST /v1/(?:chat/)?completions HTTP/1\.[01]" (\d{3})')
# The one line mlx-lm writes after answering: at --log-level DEBUG, a non-streamed answer's
# "Outgoing Response: {body}" (0.31 and 0.32). At INFO, and for streams, nothing marks a completion.
ANSWERED = "Outgoing Response:"
_THREAD_EXC = re.compile(r"Exception in thread (.+?):?$")
_MISSING_PARAMS = re.compile(r"Missing (\d+) parameters")
# Other threads keep logging while a traceback is printed: access lines and timestamped lines
# can land inside it and must not end it.
_INTERLEAVED = re.compile(r"^(\d{1,3}(\.\d{1,3}){3} - - \[|\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)?(: .*)?$")
# A client that went away (a probe that gave up, a user who closed the tab): mlx-lm's next write
# to the closed socket prints one of these. mlxwatch's own probes cause them; they are never evidence.
_DISCONNECT = re.compile(r"^(?:[\w.]+\.)?(BrokenPipeError|ConnectionResetError|ConnectionAbortedError)\b")


@dataclass
class LogMarkers:
    """What the recent log says. Line texts are kept so a person can see the evidence."""

    lines_scanned: int = 0
    last_prompt_progress: str | None = None
    prompt_progress: tuple[int, int] | None = None
    progress_count: int = 0  # how many progress lines: growth between reads means work advanced
    last_admission: str | None = None  # the last POST .../completions 200: a request admitted, not answered
    admission_count: int = 0
    last_completion: str | None = None  # the last DEBUG "Outgoing Response:" (body cut off); None: none known
    thread_exceptions: list[str] = field(default_factory=list)
    last_traceback: list[str] = field(default_factory=list)
    metal_malloc: list[str] = field(default_factory=list)
    insufficient_memory: list[str] = field(default_factory=list)
    missing_parameters: list[str] = field(default_factory=list)
    generation_thread_died: list[str] = field(default_factory=list)  # mlx-lm >= 0.32 logs this
    fatal_errors: list[str] = field(default_factory=list)  # "Fatal Python error: Segmentation fault" (faulthandler)
    client_disconnects: int = 0  # BrokenPipe/ConnectionReset tracebacks skipped: a client left, not evidence

    @property
    def generation_thread_exception(self) -> bool:
        return any("_generate" in line for line in self.thread_exceptions) or bool(self.generation_thread_died)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_log(path: Path) -> io.BufferedReader:
    """A server log opened for reading: a regular file only (never a FIFO), links followed."""
    return open_regular(path, follow_links=True)


def read_recent(path: Path | None, max_bytes: int = RECENT_BYTES) -> str:
    """The last ``max_bytes`` of the log as text, starting at a whole line; "" if unreadable."""
    if path is None:
        return ""
    try:
        with open_log(path) as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read(max_bytes)
    except OSError:
        return ""
    if size > max_bytes:
        data = data[data.find(b"\n") + 1:]
    return data.decode("utf-8", errors="replace")


COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".Z", ".lz4", ".zip")
MAX_SIBLINGS = 10_000  # directory entries looked at when finding a rotated log


def rotated_from(path: Path) -> Path | None:
    """The file the log was last rotated to, if one lies beside it: the most recently modified
    regular, uncompressed file named after it (``server.log.0`` by newsyslog, ``server.log.1``
    or ``server.log-20260705`` by logrotate), other than the log itself; None if there is none."""
    try:
        here = os.stat(path)
        ident = (here.st_dev, here.st_ino)
    except OSError:
        ident = None
    best: tuple[float, Path] | None = None
    try:
        with os.scandir(path.parent) as entries:
            for n, entry in enumerate(entries):
                if n >= MAX_SIBLINGS:
                    break
                name = entry.name
                if len(name) <= len(path.name) + 1 or not name.startswith(path.name) \
                        or name[len(path.name)] not in ".-_" or name.endswith(COMPRESSED):
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) != ident \
                        and (best is None or st.st_mtime > best[0]):
                    best = (st.st_mtime, Path(entry.path))
    except OSError:
        return None
    return best[1] if best else None


def read_recent_across(path: Path, max_bytes: int = RECENT_BYTES) -> tuple[str, Path | None]:
    """``read_recent`` across a rotation: a log shorter than ``max_bytes`` is topped up with the
    end of the file it was last rotated to (its lines first), so a tail taken just after a
    rotation still shows what led to it. Returns the text and the rotated file used, if any."""
    text = read_recent(path, max_bytes)
    room = max_bytes - len(text.encode("utf-8", errors="replace"))
    rotated = rotated_from(path) if room > 0 else None
    older = read_recent(rotated, room) if rotated is not None else ""
    if not older:
        return text, None
    return (older if older.endswith("\n") else older + "\n") + text, rotated


def progress_lines(text: str) -> list[tuple[int, int]]:
    """Every ``Prompt processing progress: X/Y`` in ``text``, in order."""
    return [(int(a), int(b)) for a, b in PROGRESS.findall(text)]


def completions_ok(text: str) -> int:
    """How many ``POST /v1/(chat/)completions ... 200`` access lines ``text`` holds: requests
    admitted (see ``ADMISSION``), not answered."""
    return sum(1 for status in ADMISSION.findall(text) if status == "200")


def tail_lines(text: str, n: int) -> list[str]:
    return text.splitlines()[-n:]


SERVER_START = "Starting httpd at"
# Logged as the batch loop takes each new request, before its prompt's progress lines: what tells
# two prompts of the same size apart (a cached prompt logs "1/1" each time).
PROMPT_CACHE = "Prompt Cache:"


def prompt_advances(lines: Iterable[str], last_x: Mapping[int, int],
                    probe_totals: Collection[int]) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """The progress rule, written once (the watcher's log source, and capture over its window):
    a ``Prompt processing progress: X/Y`` line advanced when its prompt is not a probe's own
    (``probe_totals``: the Ys their keepalives showed) and X grew past the last X logged for
    that Y (``last_x``; a prompt's last chunk may be logged twice). A ``Prompt Cache:`` line
    starts a new request, so the next prompt of the same size (``1/1`` again) is new work; a
    server start line begins a new process, whose prompts start over. Returns the advances
    (X, Y) in order and the last X per Y after ``lines``; ``last_x`` itself is left as it was."""
    advances, last = logged_advances(lines, last_x, probe_totals)
    return [(x, y) for x, y, _ in advances], last


def logged_advances(lines: Iterable[str], last_x: Mapping[int, int], probe_totals: Collection[int]
                    ) -> tuple[list[tuple[int, int, float | None]], dict[int, int]]:
    """``prompt_advances``, each with the time its line was logged (``logged_at``), if it says."""
    last = dict(last_x)
    out: list[tuple[int, int, float | None]] = []
    for line in lines:
        if SERVER_START in line or PROMPT_CACHE in line:
            last.clear()
            continue
        m = PROGRESS.search(line)
        if not m:
            continue
        x, y = int(m.group(1)), int(m.group(2))
        if y in probe_totals:
            continue
        if x > last.get(y, 0):
            out.append((x, y, logged_at(line)))
        last[y] = x
    return out, last


def logged_at(line: str) -> float | None:
    """When ``line`` was logged, in seconds (its own clock: good for differences), from the
    ``2026-12-07 04:48:44,690 - INFO - ...`` stamp mlx-lm's logging puts first (0.31.3, 0.32.x);
    None for a line without one. The daemon reads the log every few seconds: two chunks read
    in one go are apart by their stamps only (measured: a 3,007-token prompt's two chunks, 1.6 s
    apart, were read together and taught nothing)."""
    m = _STAMP.match(line)
    if m is None:
        return None
    try:
        day = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    return day.replace(tzinfo=datetime.timezone.utc).timestamp() + int(m.group(2)) / 1000.0


def since_last_start(text: str) -> str:
    """The part of the log written by the current server process: a traceback from before the
    last restart is history, not evidence about the process running now."""
    at = text.rfind(SERVER_START)
    return text if at < 0 else text[text.rfind("\n", 0, at) + 1:]


def scan(text: str) -> LogMarkers:
    """Find the markers in ``text`` (typically ``since_last_start(read_recent(path))``).

    A traceback block whose exception line is ``BrokenPipeError``, ``ConnectionResetError`` or
    ``ConnectionAbortedError`` is a client disconnect (mlx-lm writing to a socket whose client
    gave up, often mlxwatch's own probe): it is counted in ``client_disconnects`` and otherwise
    skipped, so ``last_traceback`` keeps the previous real one and no thread exception is counted.
    """
    markers = LogMarkers()
    traceback: list[str] = []
    in_traceback = False
    block_thread_exc = False  # the open block began with "Exception in thread" (counted already)
    for line in text.splitlines():
        markers.lines_scanned += 1
        if (m := PROGRESS.search(line)):
            markers.last_prompt_progress = line
            markers.prompt_progress = (int(m.group(1)), int(m.group(2)))
            markers.progress_count += 1
        if (m := ADMISSION.search(line)) and m.group(1) == "200":
            markers.last_admission = line
            markers.admission_count += 1
        if (at := line.find(ANSWERED)) >= 0:
            markers.last_completion = line[:at + len(ANSWERED)]  # the body is a private answer
        if (m := _THREAD_EXC.search(line.strip())):
            markers.thread_exceptions.append(line.strip())
        if "metal::malloc" in line:
            markers.metal_malloc.append(line.strip())
        if "Insufficient Memory" in line:
            markers.insufficient_memory.append(line.strip())
        if _MISSING_PARAMS.search(line):
            markers.missing_parameters.append(line.strip())
        if "generation thread died" in line:
            markers.generation_thread_died.append(line.strip())
        if line.startswith("Fatal Python error"):
            markers.fatal_errors.append(line.strip())
        if line.startswith("Exception in thread"):
            traceback, in_traceback, block_thread_exc = [line], True, True
        elif line.startswith("Traceback (most recent call last)"):
            # Right after "Exception in thread ...:" this is the same block; otherwise a new one.
            block_thread_exc = in_traceback and block_thread_exc and len(traceback) == 1
            traceback, in_traceback = [line], True
        elif in_traceback and not _INTERLEAVED.match(line):
            traceback.append(line)
            if line and not line.startswith((" ", "\t", "Traceback")) and _EXCEPTION_LINE.match(line):
                in_traceback = False  # the exception line ends the block
                if _DISCONNECT.match(line):
                    markers.client_disconnects += 1
                    if block_thread_exc and markers.thread_exceptions:
                        markers.thread_exceptions.pop()
                else:
                    markers.last_traceback = traceback[-60:]
                block_thread_exc = False
    for name in ("thread_exceptions", "metal_malloc", "insufficient_memory", "missing_parameters",
                 "generation_thread_died", "fatal_errors"):
        setattr(markers, name, getattr(markers, name)[-5:])  # the latest few are the evidence
    return markers
