"""The launchd agent: what `mlxwatch launchd plist` prints, and that the hand-edit template
describes the same agent. (launchctl itself exists only on macOS; its command lines are
tested in test_watchdog_units.py.)"""

from __future__ import annotations

import plistlib
import subprocess
import sys
from pathlib import Path

from mlxwatch.launchd import agent

TEMPLATE = Path(__file__).parent.parent / "launchd" / "com.mlxwatch.daemon.plist"


def test_rendered_agent_runs_this_mlxwatch_with_the_config(tmp_path):
    """Absolute program path, the config, KeepAlive, logs; PATH finds this venv's py-spy."""
    config = tmp_path / "config.yaml"
    proc = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(config), "launchd", "plist"],
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    plist = plistlib.loads(proc.stdout)
    bin_dir = str(Path(sys.executable).parent)
    assert plist["ProgramArguments"] == [f"{bin_dir}/mlxwatch", "--config", str(config.resolve()), "run"]
    assert plist["EnvironmentVariables"]["PATH"].startswith(bin_dir + ":")
    assert plist["KeepAlive"] is True and plist["RunAtLoad"] is True
    assert plist["StandardErrorPath"].endswith("Library/Logs/mlxwatch.log")


def test_template_matches_the_rendered_agent():
    """Fill the template's placeholders the way a person would: the same keys and values."""
    text = TEMPLATE.read_text().replace("@BIN@", "/venv/bin").replace("@CONFIG@", "/c.yaml").replace("@HOME@", "/Users/me")
    template = plistlib.loads(text.encode())
    rendered = agent(Path("/c.yaml"), bin_dir=Path("/venv/bin"), log=Path("/Users/me/Library/Logs/mlxwatch.log"))
    assert template == rendered
