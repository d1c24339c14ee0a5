"""The daemon's small state file (``<state_dir>/state.json``), rewritten atomically.

``mlxwatch status`` reads it whether or not the daemon runs; the daemon reloads each instance's
restart history from it at start, so restarting the daemon does not reset the restart budget.
Resume requests are files ``<state_dir>/resume/<instance>`` so they work without IPC.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from mlxwatch.storage import private_dir, replace_atomically

STATE_NAME = "state.json"


class StateFile:
    def __init__(self, state_dir: Path) -> None:
        self.dir = private_dir(state_dir)
        self.path = state_dir / STATE_NAME
        self.data: dict[str, Any] = self.read(state_dir)
        self.data.setdefault("instances", {})

    @staticmethod
    def read(state_dir: Path) -> dict[str, Any]:
        try:
            return json.loads((state_dir / STATE_NAME).read_text())
        except (OSError, ValueError):
            return {"instances": {}}

    def set_daemon(self, **fields: Any) -> None:
        self.data["daemon"] = {**self.data.get("daemon", {}), **fields, "updated_at": time.time()}
        self.flush()

    def instance(self, name: str) -> dict[str, Any]:
        return self.data["instances"].setdefault(name, {})

    def update(self, name: str, **fields: Any) -> None:
        self.instance(name).update(fields, updated_at=time.time())
        self.data.setdefault("daemon", {})["updated_at"] = time.time()
        self.flush()

    def flush(self) -> None:
        replace_atomically(self.path, json.dumps(self.data, indent=2, sort_keys=True, default=str).encode())


def resume_dir(state_dir: Path) -> Path:
    return state_dir / "resume"


def request_resume(state_dir: Path, name: str) -> Path:
    path = private_dir(resume_dir(state_dir)) / name
    replace_atomically(path, f"{time.time()}\n".encode())
    return path


def take_resume(state_dir: Path, name: str) -> bool:
    """True (and the request consumed) if someone asked to resume ``name``."""
    path = resume_dir(state_dir) / name
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
