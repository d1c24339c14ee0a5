"""Versions as the *server's* interpreter has them, not as mlxwatch's own environment does.

The server often runs from another venv (uv tool, pipx, Homebrew). Its interpreter is read from
its command line, and package versions from that interpreter's site-packages metadata
(``*.dist-info`` names), without running anything in the server's environment.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path

PACKAGES = ("mlx", "mlx_lm", "mlx_metal", "mlx_cpu", "transformers", "tokenizers")
_DIST = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<version>[^-]+)\.dist-info$")


def _interpreter(cmdline: list[str], exe: str | None) -> Path | None:
    """cmdline[0] keeps the venv path (exe() resolves symlinks to the base interpreter)."""
    if cmdline and "python" in Path(cmdline[0]).name and Path(cmdline[0]).is_absolute():
        return Path(cmdline[0])
    if len(cmdline) > 1 and Path(cmdline[1]).is_file():  # a console script: read its shebang
        try:
            first = Path(cmdline[1]).read_text(errors="replace").splitlines()[0]
            if first.startswith("#!") and "python" in first:
                return Path(first[2:].strip().split()[0])
        except (OSError, IndexError):
            pass
    return Path(exe) if exe else None


def server_versions(cmdline: list[str], exe: str | None) -> dict:
    """{'interpreter', 'python', 'packages': {name: version}, 'os', 'machine'} for the server."""
    interpreter = _interpreter(cmdline, exe)
    result: dict = {
        "interpreter": str(interpreter) if interpreter else None,
        "python": None,
        "packages": {},
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "mac_ver": platform.mac_ver()[0] or None,
    }
    if interpreter is None:
        return result
    prefix = interpreter.parent.parent
    cfg = prefix / "pyvenv.cfg"
    if cfg.exists():
        m = re.search(r"^version(?:_info)?\s*=\s*(\S+)", cfg.read_text(errors="replace"), re.M)
        result["python"] = m.group(1) if m else None
    for site in sorted(prefix.glob("lib/python3*/site-packages")):
        result["python"] = result["python"] or site.parent.name.replace("python", "")
        for dist in site.glob("*.dist-info"):
            m = _DIST.match(dist.name)
            if m and m.group("name").lower().replace("-", "_") in PACKAGES:
                result["packages"][m.group("name").lower().replace("_", "-")] = m.group("version")
    return result
