"""Thread stacks as data, in py-spy's JSON shape: what py-spy and the launch shim's faulthandler
dumps both become, so capture, classification and the shim share one model.

Frames are innermost first, as both tools print them. A stack's ``signature`` is what "the thread
did not move between two snapshots" compares.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The server's generation thread: "Thread-1 (_generate)" in 0.31, "(_run_generate)" in 0.32.
GENERATION_FUNCTIONS = ("_generate", "_run_generate")


@dataclass
class Frame:
    name: str
    filename: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.name} ({Path(self.filename).name}:{self.line})"


@dataclass
class ThreadStack:
    """One thread in one dump. Frames innermost first, as py-spy prints them."""

    name: str
    os_thread_id: int | None
    active: bool
    owns_gil: bool
    frames: list[Frame] = field(default_factory=list)

    @property
    def is_generation(self) -> bool:
        if any(f"({fn})" in self.name for fn in GENERATION_FUNCTIONS):
            return True
        return any(f.name.rsplit(".", 1)[-1] in GENERATION_FUNCTIONS and "mlx_lm" in f.filename for f in self.frames)

    def signature(self, depth: int = 12) -> tuple[tuple[str, int], ...]:
        """The innermost frames as (function, line): equal signatures = the thread did not move."""
        return tuple((f.name, f.line) for f in self.frames[:depth])


def parse_dump_json(text: str) -> list[ThreadStack]:
    """Parse ``py-spy dump --json``. Raises ValueError on output that is not a thread list."""
    data: Any = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("py-spy JSON is not a list of threads")
    threads = []
    for item in data:
        frames = [
            Frame(str(f.get("name", "?")), str(f.get("filename", "?")), int(f.get("line") or 0))
            for f in item.get("frames", [])
        ]
        threads.append(ThreadStack(
            name=str(item.get("thread_name") or f"thread {item.get('thread_id')}"),
            os_thread_id=item.get("os_thread_id"),
            active=bool(item.get("active")),
            owns_gil=bool(item.get("owns_gil")),
            frames=frames,
        ))
    return threads


def generation_thread(threads: list[ThreadStack]) -> ThreadStack | None:
    return next((t for t in threads if t.is_generation), None)
