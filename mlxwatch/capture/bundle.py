"""An evidence bundle on disk: built in a hidden temp dir beside its final place, then renamed.

A bundle is a directory ``<label>-<UTC time>-<id>`` (label = instance name or ``pid-N``) with
``manifest.json`` (format, steps, files with sha256, classification), ``summary.md`` and the
evidence files. Directories are 0700 and files 0600: logs and stacks can hold private prompts.
Names are never reused and nothing is overwritten; a capture killed midway leaves a
``.<name>.partial`` dir that ``adopt_partials`` renames to ``<name>-incomplete`` so it is kept
and visible. A partial dir holds a ``.writer`` file (PID, process create time, host) naming the
process that writes it: a partial whose writer is gone is adopted at once, one whose writer is
alive is another capture in progress and is left alone.

Retention (``prune``, after each capture): the newest ``keep`` bundles within ``max_bytes``
and ``keep_days``. ``-incomplete`` bundles and unfinished partials whose writer is gone count
and go like complete ones; a partial still being written counts toward the bytes but is never
deleted, nor is the bundle just written. A bundle's time is the UTC stamp in its name (copies
keep it), else its mtime. Links in the bundles dir are never followed, counted or deleted.

Disk floor: ``BundleWriter`` refuses to start a bundle (``LowDiskSpace``, one line) when less
than ``min_free_bytes`` is free where it would go, and refuses any file that would take the
free space below it: a capture never takes a nearly full disk's last bytes. A disk that fills
anyway (the floor is a guess from ``statvfs``; other writers share the disk): a write refused
with ENOSPC or EDQUOT gives the bundle up, its partial dir is removed at once (a daemon lives
on, and adoption waits for its next start) and every later write or ``finish`` raises the same
one-line ``LowDiskSpace`` naming the bundles dir. The watchdog journals that line
(``capture_failed``) and restarts the server all the same.

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
import stat
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from mlxwatch.errors import BundleError
from mlxwatch.host.process import ProcessIdentity, start_stamp, this_boot
from mlxwatch.storage import free_bytes, fsync_dir, no_space, private_dir, write_new

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SUMMARY = "summary.md"
WRITER = ".writer"  # in a partial dir only: who is writing it (never listed, removed on finish)
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_STAMP = re.compile(r"-(\d{8}T\d{6}Z)-[0-9a-f]{6}(?:-incomplete)?$")
PARTIAL_GRACE = 300.0  # a partial without a readable .writer is another capture's for this long
DAY = 86400.0


class LowDiskSpace(BundleError):
    """Less free disk than ``capture.min_free_bytes`` where the bundle would go, or a write of
    the bundle refused for lack of space (ENOSPC, EDQUOT): then the partial bundle is gone."""


def _amount(n: int) -> str:
    if n >= 1024**3:
        return f"{n / 1024**3:.2f} GiB"
    return f"{n / 1024**2:.0f} MiB" if n >= 10 * 1024**2 else f"{n / 1024**2:.2f} MiB"


def _sizes(free: int, floor: int) -> tuple[str, str]:
    """Free space and the floor as figures that differ when the amounts do (bytes when rounding
    would print the same figure twice: '2 MiB free, below … (2 MiB)' was measured)."""
    shown = _amount(free), _amount(floor)
    return shown if shown[0] != shown[1] or free == floor else (f"{free:,} bytes", f"{floor:,} bytes")


def bundle_name(label: str, now: float | None = None) -> str:
    stamp = datetime.fromtimestamp(now or time.time(), timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{_SAFE.sub('_', label)[:60]}-{stamp}-{uuid.uuid4().hex[:6]}"


class BundleWriter:
    """Collects files into a partial bundle; ``finish`` makes it whole and visible at once."""

    def __init__(self, root: Path, label: str, min_free_bytes: int = 0,
                 free_space: Callable[[Path], int] = free_bytes) -> None:
        self.root = private_dir(root)
        self.min_free_bytes = min_free_bytes
        self.free_space = free_space  # injectable: tests simulate a full disk
        self._check_floor(0, "no bundle written")
        self.name = bundle_name(label)
        self.partial = self.root / f".{self.name}.partial"
        self.files: dict[str, dict[str, Any]] = {}
        self.manifest: dict[str, Any] = {}
        self._lock = threading.Condition()
        self._busy = 0  # writes in progress (worker threads)
        self._closed = False
        self._full: str | None = None  # why the bundle was given up for lack of space (then nothing more is written)
        self._removed = False
        with self._space_checked(WRITER):
            self.partial.mkdir(mode=0o700)
            write_new(self.partial / WRITER, json.dumps(_this_writer()).encode())

    def _check_floor(self, size: int, what: str) -> None:
        if not self.min_free_bytes:
            return
        free = self.free_space(self.root)
        if free - size < self.min_free_bytes:
            left, floor = _sizes(free - size, self.min_free_bytes)
            after = f" after {size:,} bytes" if size else ""
            raise LowDiskSpace(f"{self.root}: {left} free{after}, below capture.min_free_bytes "
                               f"({floor}); {what}: free some space or lower the floor")

    def _out_of_space(self, exc: OSError, relname: str) -> LowDiskSpace:
        """A write refused for lack of space gives the bundle up: the partial directory is
        removed (at once, or when the last write still running ends), so a daemon that lives on
        does not keep its bytes until its next start, and nothing more of it is written.
        Returns the one-line error to raise (the same one for every later write)."""
        with self._lock:
            if self._full is None:
                why = (exc.strerror or os.strerror(exc.errno or 0)).lower()
                self._full = (f"{self.root}: {why} writing {relname}; the unfinished bundle was removed "
                              "to give its space back: free some space, or raise capture.min_free_bytes "
                              f"(now {self.min_free_bytes:,} bytes) so that a capture stops short of a full disk")
            self._remove_if_idle()
            return LowDiskSpace(self._full)

    def _remove_if_idle(self) -> None:
        """With ``self._lock`` held: remove the given-up partial once no write is in it."""
        if self._full is not None and self._busy == 0 and not self._removed:
            self._removed = True
            shutil.rmtree(self.partial, ignore_errors=True)

    @contextmanager
    def _space_checked(self, relname: str) -> Iterator[None]:
        """A write of ``relname`` refused for lack of space gives the bundle up (``_out_of_space``)."""
        try:
            yield
        except OSError as exc:
            if no_space(exc):
                raise self._out_of_space(exc, relname) from None
            raise

    @contextmanager
    def _writing(self, relname: str) -> Iterator[None]:
        """One write into the partial bundle: counted as in progress (see ``_begin``), space checked."""
        self._begin(relname)
        try:
            with self._space_checked(relname):
                yield
        finally:
            self._end()

    def _refuse_if_full(self) -> None:
        with self._lock:
            if self._full is not None:
                raise LowDiskSpace(self._full)

    def _begin(self, relname: str) -> None:
        with self._lock:
            if self._full is not None:
                raise LowDiskSpace(self._full)
            if self._closed:
                raise RuntimeError(f"bundle {self.name} is finished; {relname} not written")
            self._busy += 1

    def _end(self) -> None:
        with self._lock:
            self._busy -= 1
            self._remove_if_idle()
            self._lock.notify_all()

    def write(self, relname: str, data: bytes | str) -> Path:
        if isinstance(data, str):
            data = data.encode("utf-8")
        self._refuse_if_full()
        if relname != SUMMARY:  # the summary (kilobytes) is what says why the rest is missing
            self._check_floor(len(data), f"{relname} not written")
        with self._writing(relname):
            path = self.partial / relname
            private_dir(path.parent)
            write_new(path, data)
            with self._lock:
                self.files[relname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            return path

    def write_json(self, relname: str, value: Any) -> Path:
        return self.write(relname, json.dumps(value, indent=2, sort_keys=True, default=str))

    def adopt(self, relname: str) -> None:
        """Register a file a tool wrote itself inside the partial bundle (py-spy's siblings:
        ``sample -file``): private mode, listed with its hash."""
        path = self.partial / relname
        if path.exists():
            os.chmod(path, 0o600)
            data = path.read_bytes()
            with self._lock:
                self.files[relname] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def tool_output(self, relname: str) -> Path:
        """Where a tool should write ``relname`` (its directory made private)."""
        with self._writing(relname):  # a given-up (or finished) bundle's directory is never made again
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
        with self._space_checked(MANIFEST):
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


MAX_MANIFEST_BYTES = 16 * 1024 * 1024  # a manifest is kilobytes; anything bigger is not ours


def load_manifest(bundle: Path) -> dict[str, Any]:
    """The bundle's manifest. Raises ``BundleError`` (one line) if it is missing or unreadable."""
    from mlxwatch.errors import BundleError

    path = bundle / MANIFEST
    try:
        data = read_bounded(path, MAX_MANIFEST_BYTES)
        manifest = json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{bundle} is not a bundle (no {MANIFEST})") from None
    except OSError as exc:
        raise BundleError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # not JSON, not UTF-8, or too large
        raise BundleError(f"{path}: unreadable ({exc})") from None
    if not isinstance(manifest, dict):
        raise BundleError(f"{path}: unreadable (not a JSON object)")
    return manifest


def read_bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes, at most ``limit`` (ValueError beyond); never opens a FIFO or device."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{path.name} is larger than {limit} bytes")
    return data


def bundle_entries(root: Path) -> list[dict[str, Any]]:
    """Every bundle under ``root`` for a listing, newest first: complete ones with their
    classification, and ``-incomplete`` ones (a capture that was killed) marked as such.

    Each entry: ``name``, ``path``, ``created_at`` (ISO, UTC), ``ts``, ``instance`` (the label,
    or ``pid-N`` for a manual capture), ``pid``, ``kind``, ``confidence``, ``watchdog`` (True
    when a watchdog verdict led to it), ``size`` (bytes) and ``state`` (complete | incomplete
    | unreadable)."""
    from mlxwatch.errors import BundleError

    if not root.is_dir():
        return []
    entries = []
    for path in root.iterdir():
        try:
            if path.name.startswith(".") or not path.is_dir() or path.is_symlink():
                continue
            has_manifest = (path / MANIFEST).is_file()
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if not has_manifest and not path.name.endswith("-incomplete"):
            continue  # not ours
        entry: dict[str, Any] = {"name": path.name, "path": str(path), "ts": mtime, "instance": None, "pid": None,
                                 "kind": None, "confidence": None, "watchdog": None, "size": _size(path)}
        if not has_manifest:
            entry["state"] = "incomplete"
        else:
            try:
                manifest = load_manifest(path)
                entry["state"] = "complete"
            except BundleError:
                manifest, entry["state"] = {}, "unreadable"
            target = manifest.get("target")
            target = target if isinstance(target, dict) else {}
            c = manifest.get("classification")
            c = c if isinstance(c, dict) else {}
            entry.update(pid=target.get("pid"), kind=c.get("kind"), confidence=c.get("confidence"),
                         watchdog=manifest.get("verdict") is not None if manifest else None)
            entry["instance"] = target.get("label") or (f"pid-{target['pid']}" if target.get("pid") else None)
            created = manifest.get("created_at")
            if isinstance(created, str):
                try:
                    entry["ts"] = datetime.fromisoformat(created).timestamp()
                except ValueError:
                    pass
        if entry["instance"] is None:  # <label>-<UTC time>-<id>[-incomplete]
            entry["instance"] = path.name.removesuffix("-incomplete").rsplit("-", 2)[0]
        entry["created_at"] = datetime.fromtimestamp(entry["ts"], timezone.utc).isoformat()
        entries.append(entry)
    return sorted(entries, key=lambda e: e["ts"], reverse=True)


def list_bundles(root: Path) -> list[Path]:
    """Complete bundles under ``root``, oldest first (links are not bundles)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if not p.is_symlink() and p.is_dir() and not p.name.startswith(".")
             and (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: p.stat().st_mtime)


def _size(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_size
        except OSError:  # removed meanwhile (pruned, or a capture finishing)
            continue
    return total


def bundle_time(path: Path) -> float:
    """When a bundle was made: the UTC stamp in its name, else its mtime."""
    name = path.name[1:-len(".partial")] if path.name.endswith(".partial") else path.name
    m = _STAMP.search(name)
    if m:
        return datetime.strptime(m.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc).timestamp()
    return path.lstat().st_mtime


@dataclass
class _Held:
    """One directory retention counts: deletable unless a capture is still writing it."""

    path: Path
    at: float
    size: int
    deletable: bool
    mtime: float = 0.0


def _retained(root: Path, now: float) -> list[_Held]:
    """Complete, ``-incomplete`` and partial bundles under ``root``, oldest first."""
    held = []
    for path in root.iterdir():
        try:
            if path.is_symlink() or not path.is_dir():
                continue
            name = path.name
            if name.startswith(".") and name.endswith(".partial"):
                alive = partial_writer_alive(path)
                busy = alive or (alive is None and now - path.stat().st_mtime < PARTIAL_GRACE)
                held.append(_Held(path, bundle_time(path), _size(path), not busy, path.lstat().st_mtime))
            elif not name.startswith(".") and (name.endswith("-incomplete") or (path / MANIFEST).is_file()):
                held.append(_Held(path, bundle_time(path), _size(path), True, path.lstat().st_mtime))
        except OSError:
            continue
    return sorted(held, key=lambda h: (h.at, h.mtime))  # a name's stamp is to the second: mtime breaks ties


def prune(root: Path, keep: int, max_bytes: int, protect: Path | None = None,
          keep_days: float | None = None, now: float | None = None) -> list[Path]:
    """Delete the oldest bundles beyond ``keep``, ``max_bytes`` or ``keep_days`` (complete,
    incomplete and abandoned partial ones alike); never ``protect`` or a partial being written."""
    if not root.is_dir():
        return []
    now = time.time() if now is None else now
    held = _retained(root, now)
    count, total = len(held), sum(h.size for h in held)
    oldest_kept = now - keep_days * DAY if keep_days else None
    protected = protect.resolve() if protect is not None else None
    removed = []
    for h in held:
        too_old = oldest_kept is not None and h.at < oldest_kept
        if count <= keep and total <= max_bytes and not too_old:
            continue  # not `break`: an old bundle later in the list may still be past keep_days
        if not h.deletable or (protected is not None and h.path.resolve() == protected):
            continue
        shutil.rmtree(h.path, ignore_errors=True)
        if h.path.exists():
            continue
        count, total = count - 1, total - h.size
        removed.append(h.path)
    return removed


def _this_writer() -> dict[str, Any]:
    me = psutil.Process()
    return {"pid": me.pid, "create_time": me.create_time(), "started": start_stamp(me), "boot": this_boot(),
            "host": socket.gethostname()}


def partial_writer_alive(partial: Path) -> bool | None:
    """Is the process that writes this partial bundle still running? None when it cannot be
    told: no readable ``.writer`` file (a capture from before this rule, or killed before it
    wrote one), or a writer on another host (a shared directory)."""
    try:
        writer = json.loads((partial / WRITER).read_text())
        identity = ProcessIdentity.from_dict({**writer, "cmdline": (), "address": None})
    except (OSError, ValueError, KeyError, TypeError):
        return None
    host = writer.get("host")
    if host is not None and host != socket.gethostname():
        return None
    return identity.alive()


def adopt_partials(root: Path, older_than: float = 300.0) -> list[Path]:
    """Rename partial bundles left by a killed capture to ``<name>-incomplete``; never delete them.

    A partial whose writer (PID and create time from its ``.writer`` file) is no longer running
    is adopted whatever its age; one whose writer is alive is another capture in progress and is
    left alone. Without a usable ``.writer`` file, a partial is adopted once it is ``older_than``
    seconds old."""
    adopted: list[Path] = []
    if not root.is_dir():
        return adopted
    for partial in root.glob(".*.partial"):
        try:
            if partial.is_symlink() or not partial.is_dir():
                continue  # not ours: never renamed, followed or deleted
            alive = partial_writer_alive(partial)
            if alive or (alive is None and time.time() - partial.stat().st_mtime < older_than):
                continue  # another capture may still be writing it
            target = root / (partial.name[1:-len(".partial")] + "-incomplete")
            os.rename(partial, target)
            adopted.append(target)
        except OSError:
            continue
    return adopted
