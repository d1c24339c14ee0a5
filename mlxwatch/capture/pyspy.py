"""py-spy stack dumps: which command to run on this OS, and what the JSON says.

Facts this module encodes (py-spy 0.4): ``--native`` works on Linux and Windows, not macOS, and
not with ``--nonblocking``; a SIGSTOPped target makes a normal dump fail at once ("Failed to
suspend process") while ``--nonblocking`` still reads it; macOS needs root (``sudo -n`` when the
config allows). ``--locals`` is never used: locals hold prompts.

Python 3.13 support came in py-spy 0.4.0 (#708) and 3.14 in 0.4.2 (#833); older versions print
"Unsupported version of Python", hence the ``py-spy>=0.4.2`` floor (Homebrew and uv install
3.13/3.14 now). On a Mac py-spy is best-effort even as root: on Apple silicon it often cannot
attach ("Operation timed out (os error 60)", py-spy #242, #754) or cannot find the interpreter in
Homebrew/uv Pythons ("Failed to find python version from target process", #726). Those failures
do not go away by trying again within one capture (``hopeless``); ``sample``'s native call graph
is the stack source there (``mlxwatch.capture.macos``).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from mlxwatch.stacks import ThreadStack, parse_dump_json  # noqa: F401  (what a dump parses into)


def find_py_spy() -> str | None:
    """py-spy on PATH, else beside this interpreter (a venv's bin/ that is not on PATH)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else None


# Failures that another dump in the same capture will not fix, and what they mean (the message
# texts are py-spy's own: src/python_spy.rs, src/python_process_info.rs).
KNOWN_FAILURES = (
    ("os error 60", "py-spy cannot attach to this process on this Mac (py-spy #242, #754, Apple silicon); "
                    "the native stacks are in native/sample.txt"),
    ("failed to find python version", "py-spy cannot find the interpreter in this process (py-spy #726, "
                                      "Homebrew/uv Pythons); on macOS the native stacks are in native/sample.txt"),
    ("unsupported version of python", "this py-spy is too old for the server's Python (3.13 needs py-spy "
                                      ">= 0.4.0, 3.14 needs >= 0.4.2): upgrade py-spy"),
)


def explain(output: str) -> str | None:
    """What a py-spy failure means, from its whole output (the reason is on a "Reason:" line
    after the "Error:" line), or None when it is not a known one."""
    text = output.lower()
    return next((meaning for marker, meaning in KNOWN_FAILURES if marker in text), None)


def hopeless(output: str) -> bool:
    """Will more dumps in this capture fail the same way?"""
    return explain(output) is not None


def native_supported(platform: str = sys.platform) -> bool:
    return not platform.startswith("darwin")


def needs_root(platform: str = sys.platform, euid: int | None = None) -> bool:
    """macOS py-spy needs root; Linux needs ptrace rights, which the same user normally has."""
    euid = os.geteuid() if euid is None else euid
    return platform.startswith("darwin") and euid != 0


def dump_command(
    py_spy: str, pid: int, *, as_json: bool, native: bool, nonblocking: bool = False, sudo: bool = False
) -> list[str]:
    """The argv for one dump. ``native`` is dropped with ``nonblocking`` (py-spy refuses both)."""
    argv = ["sudo", "-n"] if sudo else []
    argv += [py_spy, "dump", "--pid", str(pid)]
    if as_json:
        argv.append("--json")
    if nonblocking:
        argv.append("--nonblocking")
    elif native:
        argv.append("--native")
    return argv
