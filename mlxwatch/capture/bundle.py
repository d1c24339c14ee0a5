"""An evidence bundle on disk: built in a hidden temp dir beside its final place, then renamed.

A bundle is a directory ``<label>-<UTC time>-<id>`` (label = instance name or ``pid-N``) with
``manifest.json`` (format, steps, files with sha256, classification), ``summary.md`` and the
evidence files. Directories are 0700 and files 0600: logs and stacks can hold private prompts.
Names are never reused and nothing is overwritten; a capture killed midway leaves a
``.<name>.partial`` dir that ``adopt_partials`` renames to ``<name>-incomplete`` so it is kept
and visible. A partial dir holds a ``.writer`` file (PID, process create time, host) naming the
process that writes it: a partial whose writer is gone is adopted at once, one whose writer is
alive is another capture in progress and is left alone. ``prune`` keeps the newest ``keep``
bundles within ``max_bytes``.

The writer's methods are plain blocking file I/O (every file is fsynced): the async collector
calls them through ``asyncio.to_thread``, possibly several at once, so they are thread-safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from mlxwatch.process import ProcessIdentity
from mlxwatch.storage import fsync_dir, private_dir, write_new

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUMMARY = "summary.md"
WRITER = ".writer"  # in a partial dir only: who is writing it (never listed, removed on finish)
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def bundle_name(label: str, now: float | None = None) -> str:
    stamp = datetime.fromtimestamp(now or time.time(), timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{_SAFE.sub('_', label)[:60]}-{stamp}-{uuid.uuid4().hex[:6]}"


class BundleWriter:
    """Collects files into a partial bundle; ``finish`` makes it whole and visible at once."""

    def __init__(self, root: Path, label: str) -> None:
        self.root = private_dir(root)
        self.name = bundle_name(label)
        self.partial = self.root / f".{self.name}.partial"
        self.partial.mkdir(mode=0o700)
        write_new(self.partial / WRITER, json.dumps(_this_writer()).encode())
        self.files: dict[str, dict[str, Any]] = {}
        self.manifest: dict[str, Any] = {}
        self._lock = threading.Condition()
        self._busy = 0  # writes in progress (worker threads)
        self._closed = False

    def _begin(self, relname: str) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"bundle {self.name} is finished; {relname} not written")
            self._busy += 1

    def _end(self) -> None:
        with self._lock:
            self._busy -= 1
            self._lock.notify_all()

    def write(self, relname: str, data: bytes | str) -> Path:
        if isinstance(data, str):
            data = data.encode("utf-8")
        self._begin(relname)
        try:
            path = self.partial / relname
            private_dir(path.parent)
            write_new(path, data)
            with self._lock:
                self.files[relname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            return path
        finally:
            self._end()

    def write_json(self, relname: str, value: Any) -> Path:
        return self.write(relname, json.dumps(value, indent=2, sort_keys=True, default=str))

    def adopt(self, relname: str) -> None:
        """Register a file a tool wrote itself inside the partial bundle (py-spy's siblings:
        ``sample -f``, ``spindump -o``): private mode, listed with its hash."""
        path = self.partial / relname
        if path.exists():
            os.chmod(path, 0o600)
            data = path.read_bytes()
            with self._lock:
                self.files[relname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def tool_output(self, relname: str) -> Path:
        """Where a tool should write ``relname`` (its directory made private)."""
        path = self.partial / relname
        private_dir(path.parent)
        return path

    def copy(self, relname: str, source: Path, max_bytes: int = 16 * 1024 * 1024) -> Path:
        with open(source, "rb") as fh:
            return self.write(relname, fh.read(max_bytes))

    def finish(self, manifest: dict[str, Any], summary: str, drain: float = 5.0) -> Path:
        """Write summary and manifest (which lists every file), then rename into place.
        The manifest as written stays in ``self.manifest``. Writes still running in other
        threads (a step cut off at the ceiling) get ``drain`` seconds to end; later ones are refused."""
        self.write(SUMMARY, summary)
        with self._lock:
            self._lock.wait_for(lambda: self._busy == 0, timeout=drain)
            self._closed = True
            files = dict(sorted(self.files.items()))
        manifest = {**manifest, "format_version": FORMAT_VERSION, "name": self.name, "files": files}
        data = json.dumps(manifest, indent=2, sort_keys=True, default=str).encode()
        write_new(self.partial / MANIFEST, data)
        self.files[MANIFEST] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self.manifest = manifest
        try:
            os.unlink(self.partial / WRITER)
        except FileNotFoundError:
            pass
        fsync_dir(self.partial)
        final = self.root / self.name
        if final.exists():  # names carry a random id; this would be a bug, and we never overwrite
            raise FileExistsError(final)
        os.rename(self.partial, final)
        fsync_dir(self.root)
        return final


def load_manifest(bundle: Path) -> dict[str, Any]:
    return json.loads((bundle / MANIFEST).read_text())


def list_bundles(root: Path) -> list[Path]:
    """Complete bundles under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def prune(root: Path, keep: int, max_bytes: int, protect: Path | None = None) -> list[Path]:
    """Delete the oldest complete bundles beyond ``keep`` or ``max_bytes``; never ``protect``."""
    bundles = list_bundles(root)
    sizes = {b: _size(b) for b in bundles}
    total = sum(sizes.values())
    removed = []
    for bundle in bundles:
        if len(bundles) - len(removed) <= keep and total <= max_bytes:
            break
        if protect is not None and bundle.resolve() == protect.resolve():
            continue
        shutil.rmtree(bundle, ignore_errors=True)
        total -= sizes[bundle]
        removed.append(bundle)
    return removed


def _this_writer() -> dict[str, Any]:
    return {"pid": os.getpid(), "create_time": psutil.Process().create_time(), "host": socket.gethostname()}


def partial_writer_alive(partial: Path) -> bool | None:
    """Is the process that writes this partial bundle still running? None when it cannot be
    told: no readable ``.writer`` file (a capture from before this rule, or killed before it
    wrote one), or a writer on another host (a shared directory)."""
    try:
        writer = json.loads((partial / WRITER).read_text())
        pid, create_time, host = int(writer["pid"]), float(writer["create_time"]), writer.get("host")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host is not None and host != socket.gethostname():
        return None
    return ProcessIdentity(pid, create_time, ()).alive()


def adopt_partials(root: Path, older_than: float = 300.0) -> list[Path]:
    """Rename partial bundles left by a killed capture to ``<name>-incomplete``; never delete them.

    A partial whose writer (PID and create time from its ``.writer`` file) is no longer running
    is adopted whatever its age; one whose writer is alive is another capture in progress and is
    left alone. Without a usable ``.writer`` file, a partial is adopted once it is ``older_than``
    seconds old."""
    adopted = []
    if not root.is_dir():
        return adopted
    for partial in root.glob(".*.partial"):
        try:
            alive = partial_writer_alive(partial)
            if alive or (alive is None and time.time() - partial.stat().st_mtime < older_than):
                continue  # another capture may still be writing it
            target = root / (partial.name[1:-len(".partial")] + "-incomplete")
            os.rename(partial, target)
            adopted.append(target)
        except OSError:
            continue
    return adopted
