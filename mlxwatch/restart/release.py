"""Never relaunch into held memory: after a server stopped, wait until its memory is given back.

A restart that starts the next server while the old one's memory is still held can leave both
short, or strand the old one's wired memory (in one peer, 381 GB stayed held until a reboot).
Before the restart method starts the next server, mlxwatch waits, at most
``memory.release_timeout``:

- **Linux**: until the old process is gone. A process being killed frees its pages as it exits
  and stays in /proc until it has (a big address space takes seconds); a zombie holds none.
- **macOS**: until it is gone *and* the GPU's in-use system memory (``ioreg``'s
  ``PerformanceStatistics`` of the ``IOAccelerator`` class, ``"In use system memory"``) is back
  down by most of what the server held (its last physical footprint), or stops falling.
  Not run on a Mac here (docs/verified.md).

A wait past ``SLOW_RELEASE`` is journaled (``memory_held``) by the watcher from the result::

    released = wait_released(identity, timeout=60.0, held=footprint)   # Released(waited=0.4, released=True, ...)
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable

from mlxwatch.host.gpu import read_gpu_now
from mlxwatch.host.process import ProcessIdentity

POLL = 0.2
SLOW_RELEASE = 5.0  # seconds: a wait longer than this is journaled
RELEASED_SHARE = 0.8  # macOS: the GPU's in-use memory down by this share of what the server held


@dataclass(frozen=True)
class Released:
    waited: float  # seconds
    released: bool  # False: the bound passed with the memory still held
    detail: str

    @property
    def slow(self) -> bool:
        return self.waited >= SLOW_RELEASE or not self.released


def gpu_in_use() -> int | None:
    """The GPU's in-use system memory now (macOS; the busiest accelerator's), or None where it
    cannot be read."""
    return read_gpu_now().in_use_bytes


def wait_released(identity: ProcessIdentity, timeout: float, held: int | None = None, *,
                  macos: bool | None = None, gpu: Callable[[], int | None] = gpu_in_use,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> Released:
    """Wait until the old server's memory is given back, at most ``timeout`` s (blocking: run it
    in a worker thread). ``held``: its last footprint, bytes (macOS: how far the GPU's in-use
    memory must fall)."""
    macos = sys.platform.startswith("darwin") if macos is None else macos
    start = clock()
    before = gpu() if macos else None
    while identity.alive():
        if clock() - start >= timeout:
            return Released(clock() - start, False, f"process {identity.pid} still exiting after {timeout:g}s")
        sleep(POLL)
    gone = clock() - start
    if not macos or before is None or not held:
        return Released(gone, True, f"process {identity.pid} gone after {gone:.1f}s")
    target = before - RELEASED_SHARE * held
    last = before
    while True:
        now = gpu()
        waited = clock() - start
        if now is None:
            return Released(waited, True, f"process {identity.pid} gone; the GPU's memory could not be read")
        if now <= target:
            return Released(waited, True, f"process {identity.pid} gone; the GPU's in-use memory fell "
                                          f"{(before - now) / 2**20:.0f} MiB in {waited:.1f}s")
        if waited >= timeout:
            return Released(waited, False, f"the GPU still held {(now - target) / 2**20:.0f} MiB more than expected "
                                           f"after {timeout:g}s")
        if now >= last and waited - gone >= 2.0:  # no longer falling: what is left is not ours
            return Released(waited, True, f"process {identity.pid} gone; the GPU's in-use memory stopped falling "
                                          f"at {(before - now) / 2**20:.0f} MiB down")
        last = now
        sleep(POLL)
