"""Every relative link in the manual leads somewhere: README.md, CONTRIBUTING.md, CHANGELOG.md
and docs/ name files that exist (resolved from the page's own directory, as GitHub does), and
an anchor (``page.md#section``, ``#section``) names a heading of that page.

Measured (issue 29): four dead links, docs/shim.md -> launchd/... (resolved under docs/) and
docs/metrics.md -> docs/fleet.md, docs/alerts.yml, docs/alertmanager.yml (docs/docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    return [t for t in LINK.findall(text) if not re.match(r"[a-zA-Z][a-zA-Z+.-]*:", t)]


def test_the_pages_have_relative_links_to_check():
    """The checker finds the links it should (a regex that matched nothing would pass every page)."""
    found = {str(p.relative_to(ROOT)): relative_links(p) for p in PAGES}
    assert "docs/fleet.md" in found["README.md"] and "journal.md#retention" in found["docs/configuration.md"]
    assert sum(map(len, found.values())) > 30


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    """Each link names an existing file (from the page's directory) and, with ``#``, a heading there."""
    dead = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            dead.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not dead, f"{page.relative_to(ROOT)}: dead links: {dead}"
