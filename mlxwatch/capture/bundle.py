"""An evidence bundle on disk: built in a hidden temp dir beside its final place, then renamed.

A bundle is a directory ``<label>-<UTC time>-<id>`` (label = instance name or ``pid-N``) with
``manifest.json`` (format, steps, files with sha256, classification), ``summary.md`` and the
evidence files. Directories are 0700 and files 0600: logs and stacks can hold private prompts.
Names are never reused and nothing is overwritten; a capture killed midway leaves a
``.<name>.partial`` dir that ``adopt_partials`` renames to ``<name>-incomplete`` so it is kept
and visible. ``prune`` keeps the newest ``keep`` bundles within ``max_bytes``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mlxwatch.storage import fsync_dir, private_dir, write_new

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUMMARY = "summary.md"
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
        self.files: dict[str, dict[str, Any]] = {}
        self.manifest: dict[str, Any] = {}

    def write(self, relname: str, data: bytes | str) -> Path:
        if isinstance(data, str):
            data = data.encode("utf-8")
        path = self.partial / relname
        private_dir(path.parent)
        write_new(path, data)
        self.files[relname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        return path

    def write_json(self, relname: str, value: Any) -> Path:
        return self.write(relname, json.dumps(value, indent=2, sort_keys=True, default=str))

    def adopt(self, relname: str) -> None:
        """Register a file a tool wrote itself inside the partial bundle (py-spy's siblings:
        ``sample -f``, ``spindump -o``): private mode, listed with its hash."""
        path = self.partial / relname
        if path.exists():
            os.chmod(path, 0o600)
            data = path.read_bytes()
            self.files[relname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def tool_output(self, relname: str) -> Path:
        """Where a tool should write ``relname`` (its directory made private)."""
        path = self.partial / relname
        private_dir(path.parent)
        return path

    def copy(self, relname: str, source: Path, max_bytes: int = 16 * 1024 * 1024) -> Path:
        with open(source, "rb") as fh:
            return self.write(relname, fh.read(max_bytes))

    def finish(self, manifest: dict[str, Any], summary: str) -> Path:
        """Write summary and manifest (which lists every file), then rename into place.
        The manifest as written stays in ``self.manifest``."""
        self.write(SUMMARY, summary)
        manifest = {**manifest, "format_version": FORMAT_VERSION, "name": self.name, "files": dict(sorted(self.files.items()))}
        self.write(MANIFEST, json.dumps(manifest, indent=2, sort_keys=True, default=str))
        self.manifest = manifest
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


def adopt_partials(root: Path, older_than: float = 300.0) -> list[Path]:
    """Rename partial bundles left by a killed capture to ``<name>-incomplete``; never delete them."""
    adopted = []
    if not root.is_dir():
        return adopted
    for partial in root.glob(".*.partial"):
        try:
            if time.time() - partial.stat().st_mtime < older_than:
                continue  # another capture may still be writing it
            target = root / (partial.name[1:-len(".partial")] + "-incomplete")
            os.rename(partial, target)
            adopted.append(target)
        except OSError:
            continue
    return adopted
