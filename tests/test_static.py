"""Output for people comes from one place: ``mlxwatch/cli/`` and ``mlxwatch/output/`` (CONTRIBUTING).

An AST scan of every other module for what writes to a terminal: ``print``/``pprint`` calls, a
rich ``Console(...)`` made, ``.print``/``.print_json``/``.log`` called on a console, and writes to
``sys.stdout``/``sys.stderr``. The core returns typed values and logs through ``logging``; a line
printed from it would bypass ``--json``, the console the CLI was given, and the tests' capture.
The few modules that run as processes of their own are allowed below, each with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlxwatch"

# Packages that render for people: the scan does not look inside them.
RENDERERS = ("cli/", "output/")

# Modules outside them that may write to a terminal, and why. Each must still do so (a stale
# entry fails the test, so the list never grows silently).
ALLOWED = {
    "shim/agent.py": "runs inside the server (stdlib only): its one-line notes go to the server's stderr",
    "shim/boot/sitecustomize.py": "runs at the server's interpreter start, before mlxwatch exists there: stderr only",
    "_lab/inject/sitecustomize.py": "the lab server's fault hook: a lab without its fault says so on the server's stderr",
    "_lab/fault_server.py": "runs inside the lab server (stdlib only): a fault's onset stamp goes to the server's log",
    "_lab/relaunch.py": "a script of its own (`python -m mlxwatch._lab.relaunch`), run as a separate process",
    "_lab/tiny_model.py": "a script of its own (writes the demo's tiny model), run as a separate process",
}

CONSOLE_METHODS = {"print", "print_json", "log"}


def terminal_writes(source: str) -> list[tuple[int, str]]:
    """(line, what) for each write to a terminal in ``source``; docstrings and strings are not code."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("print", "pprint", "Console"):
            found.append((node.lineno, f"{func.id}(...)"))
        elif isinstance(func, ast.Attribute):
            owner = ast.unparse(func.value)
            if func.attr == "Console" or (func.attr in CONSOLE_METHODS and "console" in owner.lower()):
                found.append((node.lineno, f"{owner}.{func.attr}(...)"))
            elif func.attr == "print" or (func.attr == "write" and owner in ("sys.stdout", "sys.stderr")):
                found.append((node.lineno, f"{owner}.{func.attr}(...)"))
    return sorted(found)


def test_the_scan_finds_each_kind_of_write_and_ignores_text():
    source = '''
"""A docstring: print(result) is an example, not code."""
import sys
from rich.console import Console
import rich.console
print("x")
err = Console(stderr=True)
also = rich.console.Console()
err.print("y")
self_console.log("z")
sys.stderr.write("w")
sys.stdout.write("v")
log.info("a log line is fine")
logger.log(20, "so is this")
text = "print('in a string')"
'''
    assert [what for _, what in terminal_writes(source)] == [
        "print(...)", "Console(...)", "rich.console.Console(...)", "err.print(...)",
        "self_console.log(...)", "sys.stderr.write(...)", "sys.stdout.write(...)"]


def test_nothing_prints_for_people_outside_cli_and_output():
    offenders, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(RENDERERS):
            continue
        writes = terminal_writes(path.read_text(encoding="utf-8"))
        if rel in ALLOWED:
            if writes:
                used.add(rel)
            continue
        offenders += [f"mlxwatch/{rel}:{line}: {what}" for line, what in writes]
    assert not offenders, ("output for people belongs in mlxwatch/output/ (printed by mlxwatch/cli/); "
                           "return a value or log instead:\n" + "\n".join(offenders))
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allowed to print but no longer does (remove from ALLOWED): {stale}"
