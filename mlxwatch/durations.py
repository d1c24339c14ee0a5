"""Parse and print durations: config files say ``30s`` or ``5m``; code uses float seconds."""

from __future__ import annotations

import math
import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")

MAX_DURATION = 365 * 86400.0  # a year: longer is a typo, and too long for some timers
NOT_A_DURATION = "not a duration"
DURATION_FORM = "must be a duration such as 30, 30s, 5m or 1h"  # what a person is told for NOT_A_DURATION
NOT_FINITE = "must be a finite duration"
TOO_LONG = "must be at most 365d"


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as ``"90"``, ``"30s"``, ``"5m"``, ``"1.5h"``.

    Raises ``ValueError`` for anything else (booleans included: YAML's ``yes`` is not a time):
    ``NOT_A_DURATION`` for a value of the wrong form, ``NOT_FINITE`` for NaN and infinities (YAML's
    ``.nan`` and ``.inf`` are floats) and ``TOO_LONG`` for more than ``MAX_DURATION`` either way.
    Zero and negative numbers are returned as they are: whether they make sense is the caller's call.
    """
    if isinstance(value, bool):
        raise ValueError(NOT_A_DURATION)
    if isinstance(value, int):
        if abs(value) > MAX_DURATION:  # compared as int: float() of a huge int overflows
            raise ValueError(TOO_LONG)
        return float(value)
    if isinstance(value, float):
        seconds = value
    elif isinstance(value, str) and (match := _PATTERN.match(value)):
        seconds = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    else:
        raise ValueError(NOT_A_DURATION)
    if math.isnan(seconds):
        raise ValueError(NOT_FINITE)
    if math.isinf(seconds) and isinstance(value, float):
        raise ValueError(NOT_FINITE)
    if abs(seconds) > MAX_DURATION:  # a string of many digits is a number too big, not "infinite"
        raise ValueError(TOO_LONG)
    return seconds


def format_duration(seconds: float) -> str:
    """A short human form: ``850ms``, ``12.3s``, ``4m05s``, ``2h10m``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def human_duration(seconds: float) -> str:
    """A setting as a config file would say it: ``90s``, ``10m``, ``1h``, ``500ms``."""
    if seconds < 1:
        return f"{seconds * 1000:g}ms"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
