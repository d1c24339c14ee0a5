"""Writing files so that nothing is lost or half-written, whatever kills us.

- ``write_new``: create a file that must not exist yet (never overwrite), fsync it.
- ``replace_atomically``: write a temp file beside the target, fsync, rename over it.
- ``append_record``: one JSON line appended and fsynced (the incident journal).
- ``read_records`` / ``read_records_from``: the journal's whole records, all or from an offset.
- ``private_dir``: a directory only the owner can read (bundles and logs hold private prompts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    return path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_synced(path: Path, flags: int, data: bytes, mode: int = FILE_MODE) -> None:
    """Open with ``flags``, write all of ``data``, fsync, close: the one way files are written."""
    fd = os.open(path, os.O_WRONLY | flags, mode)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data``; raise FileExistsError rather than overwrite."""
    _write_synced(path, os.O_CREAT | os.O_EXCL, data)


def replace_atomically(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Readers see the old content or the new, never a torn file; a failed write leaves no temp.
    The temp file is ``.<name>.<pid>.tmp``: hidden, and not matched by a reader's suffix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_synced(tmp, os.O_CREAT | os.O_TRUNC, data, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line and fsync: after a crash the journal ends at a whole record.

    If an earlier append was torn (no final newline), a newline goes first, so the torn line
    stays alone and this record is not glued to it.
    """
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, FILE_MODE)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        _write_all(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_LINE = 1024 * 1024  # longer journal lines are garbage: only their tail is kept, to recover a record
_RECOVERY_TRIES = 256


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON record of ``path``; torn or garbage lines are skipped (see read_records_from)."""
    return read_records_from(path)[0]


def read_records_from(path: Path, start: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The records from byte ``start`` on, and the offset to pass next time to follow the file.

    Reading resynchronises at each newline, so a torn or garbage line (killed mid-write, bytes
    that are not UTF-8) costs only itself; a whole record glued after a torn line on the same
    line is recovered. An unterminated last line that is not a whole record is not consumed:
    the returned offset stays at its start, so a follower reads it again once it is complete.
    """
    records: list[dict[str, Any]] = []
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return records, start
    with fh:
        fh.seek(start)
        offset = start
        while line := fh.readline(MAX_LINE):
            length = len(line)
            if len(line) == MAX_LINE and not line.endswith(b"\n"):
                while more := fh.readline(MAX_LINE):  # oversized: keep its tail, skip to the newline
                    length += len(more)
                    line = (line + more)[-MAX_LINE:]
                    if more.endswith(b"\n"):
                        break
            record = _parse_line(line)
            if record is None and not line.endswith(b"\n"):
                break  # unterminated, maybe still being written
            if record is not None:
                records.append(record)
            offset += length
    return records, offset


def _parse_line(line: bytes) -> dict[str, Any] | None:
    """The record on ``line``, or the whole record that ends it after torn bytes, or None.

    An object right after ``[``, ``,`` or ``:`` is not taken: it is a nested value of a torn
    record (a record glued there is lost instead), and ``{}`` can be text inside a string.
    """
    text = line.decode("utf-8", "replace").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
        decoder = json.JSONDecoder()
        pos = text.rfind("{", 1)
        for _ in range(_RECOVERY_TRIES):  # from the right: the first parse reaching the end is the record
            if pos < 1:
                break
            if text[:pos].rstrip()[-1:] not in ("[", ",", ":"):
                try:
                    candidate, end = decoder.raw_decode(text, pos)
                except ValueError:
                    pass
                else:
                    if end == len(text) and isinstance(candidate, dict) and candidate:
                        value = candidate
                        break
            pos = text.rfind("{", 1, pos)
    return value if isinstance(value, dict) else None
