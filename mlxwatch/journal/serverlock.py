"""One daemon per server: an exclusive ``flock`` per watched address, in the per-user runtime dir.

The state-dir lock (``lock.py``) stops two daemons on one state dir. Two daemons with different
state dirs (a launchd agent, and a ``run`` in a terminal with another config) watching the same
URL were not noticed: both probed it, and both would capture it and restart it, each taking the
other's restart for a crash (found by a new user). So a daemon also takes, for each instance,
``<runtime dir>/servers/<address>.lock`` (the runtime dir is the launch shim's, per user and the
same in every environment: ``mlxwatch.shim.layout``); a second daemon on the same server is
refused, naming the first's PID, state dir and instance. The kernel drops the lock however
its holder dies, so it is never stale; the small files stay, as ``daemon.lock`` does.

An address is its port and its host, every loopback spelling being one host (``localhost``,
``127.0.0.1`` and ``[::1]`` on one port count as one server: a config may say either). Daemons
of different users do not see each other's locks (each user has a runtime dir of their own).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
from pathlib import Path
from urllib.parse import urlsplit

from mlxwatch.config import url_port
from mlxwatch.errors import StateError
from mlxwatch.shim.layout import ensure_private_dir, runtime_dir
from mlxwatch.storage import NOFOLLOW

SERVERS_DIR = "servers"


def address_key(url: str) -> str:
    """The lock file's name for the server at ``url``: ``loopback-8080``, ``10.0.0.5-8080``."""
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    try:
        ip = ipaddress.ip_address(host)
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        loopback = ip.is_loopback or (mapped is not None and mapped.is_loopback)
        host = str(mapped or ip)
    except ValueError:
        loopback = host == "localhost"
    name = "loopback" if loopback else "".join(c if c.isalnum() or c in ".-" else "_" for c in host)
    return f"{name}-{url_port(url)}"


class ServerLocks:
    """The addresses this daemon watches, each held by an open, flocked file."""

    def __init__(self, state_dir: Path, directory: str | None = None) -> None:
        self.state_dir = state_dir
        self.directory = Path(directory or runtime_dir()) / SERVERS_DIR
        self.held: dict[str, int] = {}  # address key -> the locked file's descriptor
        self.unavailable: str | None = None  # why no lock can be taken here (then none is checked)
        self.checked = False

    def take(self, url: str, instance: str) -> None:
        """Hold ``url``'s address for ``instance`` (already held: nothing to do), or raise
        ``StateError`` naming the daemon that holds it. Where the runtime dir cannot be used,
        nothing is checked and ``unavailable`` says why (the caller says it once)."""
        key = address_key(url)
        if key in self.held or self._unusable():
            return
        path = self.directory / f"{key}.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
        except OSError as exc:
            self.unavailable = f"{path}: {'a symbolic link' if exc.errno == errno.ELOOP else exc.strerror or exc}"
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise StateError(
                f"{url} is already watched by another mlxwatch daemon ({holder}): two daemons would both "
                "capture and restart it; stop that daemon, or remove this instance from one of the two configs"
            ) from None
        record = {"pid": os.getpid(), "state_dir": str(self.state_dir), "instance": instance, "url": url}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self.held[key] = fd

    def keep_only(self, urls: list[str]) -> None:
        """Release every address not among ``urls`` (instances removed by a reload)."""
        wanted = {address_key(u) for u in urls}
        for key in [k for k in self.held if k not in wanted]:
            os.close(self.held.pop(key))

    def release(self) -> None:
        self.keep_only([])

    def _unusable(self) -> bool:
        if not self.checked:  # made 0700 each, the runtime dir first: makedirs would not make it so
            self.checked = True
            self.unavailable = ensure_private_dir(str(self.directory.parent)) or ensure_private_dir(str(self.directory))
        return self.unavailable is not None


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote: PID, state dir and instance."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        return f"PID {int(record['pid'])}, state dir {record['state_dir']}, instance {record['instance']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a daemon that has not said which"
