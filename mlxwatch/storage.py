"""Writing files so that nothing is lost or half-written, whatever kills us, and nothing is
written through a name someone else could aim.

- ``write_new``: create a file that must not exist yet (never overwrite), fsync it.
- ``replace_atomically``: write a temp file beside the target, fsync, rename over it.
- ``append_record``: one JSON line appended and fsynced (the incident journal); a failed
  append is cut back off, so a full disk leaves no torn line.
- ``read_records`` / ``read_records_from``: the journal's whole records, all or from an offset.
- ``private_dir``: a directory only the owner can write (bundles and logs hold private prompts);
  one that others could write, or that another user owns, is refused (``UnsafeDirError``).
- ``free_bytes``: free space for an unprivileged writer under a path (the capture's floor).

No write follows a symbolic link: temp files get a random name and are created with
``O_EXCL|O_NOFOLLOW``; appends and reads open with ``O_NOFOLLOW`` (a planted link fails with
ELOOP instead of redirecting a root daemon's write to any file it names).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from mlxwatch.errors import StateError

log = logging.getLogger("mlxwatch.storage")

FILE_MODE = 0o600
DIR_MODE = 0o700
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_TEMP_TRIES = 16


class UnsafeDirError(StateError):
    """A directory mlxwatch would write in can be written by others, or is owned by another
    user: anyone who can write there can plant a link to aim our writes. ``str()`` is one line
    naming the directory and the fix."""


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can write: created 0700 if missing; an existing
    one must be owned by this user and not group- or world-writable (``UnsafeDirError``
    otherwise, naming the fix). A directory created here that still came out looser (a default
    ACL, a filesystem that ignores the mode) is tightened to 0700, with a warning."""
    for parent in reversed([p for p in path.parents if not os.path.lexists(p)]):
        with contextlib.suppress(FileExistsError):  # missing parents are made 0700 too, unlike mkdir -p's
            parent.mkdir(mode=DIR_MODE)
    try:
        path.mkdir(mode=DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    st = path.stat()  # a symlink the user made to their own directory is fine: the target is checked
    if created and stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022:
        os.chmod(path, DIR_MODE)
        log.warning("%s was created with mode %o; tightened to %o", path, stat.S_IMODE(st.st_mode), DIR_MODE)
        st = path.stat()
    problem = private_dir_problem(path, st)
    if problem is not None:
        raise UnsafeDirError(problem)
    return path


def private_dir_problem(path: Path, st: os.stat_result) -> str | None:
    """Why the existing ``path`` (``st``: its stat) cannot be a private directory, naming the
    fix; None when it can. One rule for ``private_dir`` and ``mlxwatch doctor``."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory: move it away or choose another directory"
    if st.st_uid != os.geteuid():
        return (f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}): "
                f"use a directory of your own, or `chown {os.geteuid()} {path}`")
    if st.st_mode & 0o022:
        return (f"{path} is writable by {'others' if st.st_mode & 0o002 else 'its group'} "
                f"(mode {stat.S_IMODE(st.st_mode):o}): `chmod 700 {path}` and check what is in it")
    return None


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a write refused for lack of space: the disk, or a quota


def no_space(exc: BaseException) -> bool:
    """Was ``exc`` a write refused for lack of space (ENOSPC, EDQUOT)?"""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer can still use on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


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


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data``; raise FileExistsError rather than overwrite. A write that
    fails (a full disk) removes the file it created: no cut-short file is left under the name,
    where it would look written and refuse the next try ("exists; not overwriting")."""
    fd = os.open(path, os.O_WRONLY | NOFOLLOW | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        try:
            os.unlink(path)  # ours: O_EXCL created it just now
        except OSError:
            pass
        raise


def replace_atomically(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Readers see the old content or the new, never a torn file; a failed write leaves no temp.

    The temp file is ``.<name>.<random>.tmp`` in the target's directory (hidden, and not
    matched by a reader's suffix), created with ``O_EXCL|O_NOFOLLOW``: a name planted there in
    advance, link or file, is never opened, another random name is tried. The rename replaces
    a link at ``path`` itself, never the file it points to."""
    for _ in range(_TEMP_TRIES):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, mode)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError(errno.EEXIST, f"no free temp name beside {path}")
    try:
        try:
            os.fchmod(fd, mode)  # the umask narrowed it at creation; a 0644 textfile needs it back
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
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

    An append that fails (ENOSPC part-way through the line, or at the fsync) is undone: the file
    is cut back to its size before the append, then the error is raised. If an earlier append
    was torn anyway (killed mid-write: no final newline), a newline goes first, so the torn line
    stays alone and this record is not glued to it.
    """
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | NOFOLLOW | getattr(os, "O_NONBLOCK", 0), FILE_MODE)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        size = st.st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        try:
            _write_all(fd, line)
            os.fsync(fd)
        except BaseException:
            _cut_back(fd, size)
            raise
    finally:
        os.close(fd)


def _cut_back(fd: int, size: int) -> None:
    """Undo an append that failed part-way (a full disk mid-line): the file ends at the whole
    record before it again, so no torn line is left for a JSON Lines reader (jq) to stop at, and
    a record whose fsync failed is not on disk twice once its caller writes it again. Best effort:
    if even this fails, the torn line stays and ``read_records`` skips it."""
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    except OSError as exc:
        log.warning("could not undo a failed append (%s); a torn line is left, which readers skip",
                    exc.strerror or exc)


def open_regular_fd(path: Path, *, follow_links: bool = False) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its stat, refusing anything but a regular file
    (OSError EINVAL): opened with O_NONBLOCK, since opening a FIFO without it waits for a writer
    forever (measured: it hung the daemon). Links are refused (ELOOP) unless ``follow_links``: our
    own files never come through one; a server's log often does."""
    fd = os.open(path, os.O_RDONLY | (0 if follow_links else NOFOLLOW) | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{path} is not a regular file")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: Path, *, follow_links: bool = False) -> io.BufferedReader:
    """``path`` opened for reading as a binary file object (see ``open_regular_fd``)."""
    fd, _ = open_regular_fd(path, follow_links=follow_links)
    return os.fdopen(fd, "rb")


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
        fh = open_regular(path)
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
