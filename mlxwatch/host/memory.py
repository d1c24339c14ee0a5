"""Freed memory given back to the system.

glibc's malloc keeps large freed blocks in its heap for reuse (its threshold for giving them
straight back rises with each large block freed), so a burst of big request bodies at the
front door left the daemon's resident size at its peak for good; ``malloc_trim`` returns the
free pages. macOS's malloc returns large blocks itself, and other C libraries have no such
call: there ``give_back`` does nothing::

    give_back()   # True if the C library was asked
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable, cast


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only (musl has none)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return cast(Callable[[int], int], trim)


_TRIM = _malloc_trim()


def give_back() -> bool:
    """Ask the C library to return the free pages of its heap to the system (milliseconds for
    a heap of hundreds of MB); False where there is no such call."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
