"""Parse and print durations: config files say ``30s`` or ``5m``; code uses float seconds."""

from __future__ import annotations

import re

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


def parse_duration(value: object) -> float:
    """Seconds from a number or a string such as ``"90"``, ``"30s"``, ``"5m"``, ``"1.5h"``.

    Raises ``ValueError`` for anything else (booleans included: YAML's ``yes`` is not a time).
    """
    if isinstance(value, bool):
        raise ValueError("not a duration")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match:
            return float(match.group(1)) * _UNITS[match.group(2) or "s"]
    raise ValueError("not a duration")


def format_duration(seconds: float) -> str:
    """A short human form: ``850ms``, ``12.3s``, ``4m05s``, ``2h10m``."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
