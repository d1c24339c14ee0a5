"""Writing files so that nothing is lost or half-written, whatever kills us.

- ``write_new``: create a file that must not exist yet (never overwrite), fsync it.
- ``replace_atomically``: write a temp file beside the target, fsync, rename over it.
- ``append_record``: one JSON line appended and fsynced (the incident journal).
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


def _write_synced(path: Path, flags: int, data: bytes) -> None:
    """Open with ``flags``, write all of ``data``, fsync, close: the one way files are written."""
    fd = os.open(path, os.O_WRONLY | flags, FILE_MODE)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data``; raise FileExistsError rather than overwrite."""
    _write_synced(path, os.O_CREAT | os.O_EXCL, data)


def replace_atomically(path: Path, data: bytes) -> None:
    """Readers see the old content or the new, never a torn file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    _write_synced(tmp, os.O_CREAT | os.O_TRUNC, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line and fsync: after a crash the journal ends at a whole record."""
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    _write_synced(path, os.O_CREAT | os.O_APPEND, line)


def read_records(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON line of ``path``; a torn last line (killed mid-write) is skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            records.append(value)
    return records
