"""The package layout is the data flow: every import points down CONTRIBUTING.md's list, and there
are no cycles, module-level or hidden in a function.

CONTRIBUTING.md's layout block is the one statement of the order; this test reads it, so the
document and the code cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mlxwatch"


def documented_order() -> list[str]:
    """Units (a subpackage or a top-level module of mlxwatch), top of the list first."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    units = []
    for line in block.splitlines():
        m = re.match(r"^mlxwatch/(\w+)(?:/|\.py)\s", line + " ")
        if m:
            units.append(m.group(1))
    return units


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports() -> list[tuple[str, str, int]]:
    """(importer module, imported module, line) for every mlxwatch import, wherever it stands."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "boot" in path.relative_to(PACKAGE).parts:  # loaded by path inside the server: stdlib only
            continue
        me = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("mlxwatch"):
                for alias in node.names:
                    candidate = f"{node.module}.{alias.name}"
                    target = candidate if _is_module(candidate) else node.module
                    found.append((me, target, node.lineno))
            elif isinstance(node, ast.Import):
                found += [(me, a.name, node.lineno) for a in node.names if a.name.startswith("mlxwatch")]
    return found


def _is_module(dotted: str) -> bool:
    base = ROOT / dotted.replace(".", "/")
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def test_every_unit_is_placed_in_the_documented_layout():
    """A new package or top-level module must be given its place in CONTRIBUTING.md."""
    order = documented_order()
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").exists()}
    assert sorted(units - set(order)) == [], "not placed in CONTRIBUTING.md's layout"


def test_imports_point_down_the_layout():
    """A unit imports only units listed below it (function-level imports count too)."""
    rank = {u: i for i, u in enumerate(documented_order())}  # 0 = top
    upward = []
    for me, target, line in imports():
        a, b = unit_of(me), unit_of(target)
        if a == b or a in ("__init__", "__main__") or b == "__init__":
            continue
        if rank.get(b, -1) <= rank.get(a, len(rank)):
            upward.append(f"{me}:{line} imports {target} ({a} is not above {b})")
    assert upward == []


def test_no_import_cycles_between_modules():
    """No module reaches itself through imports, including imports made inside functions."""
    graph: dict[str, set[str]] = {}
    for me, target, _ in imports():
        parts = target.split(".")
        # importing a.b.c runs a/b/__init__.py first: a package's own imports are on the path too
        for target in (".".join(parts[:i]) for i in range(2, len(parts) + 1)):
            if target != me and not me.startswith(target + "."):
                graph.setdefault(me, set()).add(target)
    cycles = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []
