"""Clients in processes of their own (``lab/app.py``, ``lab/agent.py``): the daemon under test
sees their connections as someone else's (its kernel sight leaves its own out). Each prints
one JSON line a finished request::

    proc = client(AGENT, url, "--stream")
    ...
    end(proc)            # ended if still running (by its Popen: ours alone)
    lines = printed(proc)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def client(script: Path, url: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), url, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)


def printed(proc: subprocess.Popen) -> list[dict]:
    """What the client printed: one JSON line a finished request (it has exited or been ended)."""
    out = proc.stdout.read() if proc.stdout and not proc.stdout.closed else ""
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def end(proc: subprocess.Popen) -> None:
    """SIGTERM, SIGKILL after 10 s; its output pipe closed."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()
