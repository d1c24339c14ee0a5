"""CONTRIBUTING's commands do what it says: the fast tier runs the promtool and nginx tests
`scripts/test.sh` made runnable (it installs those tools under `.venvs/tools/bin`).

Measured (issue 29): the fast-tier command did not put `.venvs/tools/bin` on PATH, so six
promtool tests skipped with "promtool not installed (no apt here)" on a machine that had it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
TOOLS = ".venvs/tools/bin"


def test_scripts_test_sh_installs_the_tools_where_the_fast_tier_looks():
    assert "$VENVS/tools/bin" in (ROOT / "scripts" / "test.sh").read_text()
    assert re.search(r'VENVS=.*\.venvs', (ROOT / "scripts" / "test.sh").read_text())


def test_the_fast_tier_command_puts_the_tools_on_path():
    """In CONTRIBUTING's tiers and the README's pointer to them alike."""
    for page in ("CONTRIBUTING.md", "README.md"):
        lines = [line for line in (ROOT / page).read_text().splitlines() if '-m "not real_server"' in line]
        assert lines, page
        for line in lines:
            # absolute: a test that runs promtool from docs/ (cwd) would not find a relative one
            assert f'PATH="$PWD/{TOOLS}:$PATH" ' in line, f"{page}: {line}"
