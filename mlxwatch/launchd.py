"""The launchd agent that runs ``mlxwatch run`` beside the servers it watches.

``mlxwatch launchd plist`` prints the agent for this installation: absolute paths to this
environment's ``mlxwatch``, a PATH that includes this environment's ``bin`` (launchd's default
PATH would not find ``py-spy``), KeepAlive so launchd restarts the watchdog itself, and the
daemon's stderr in ``~/Library/Logs/mlxwatch.log``. ``launchd/com.mlxwatch.daemon.plist`` is
the same agent as a template for editing by hand.
"""

from __future__ import annotations

import plistlib
import sys
from pathlib import Path

LABEL = "com.mlxwatch.daemon"
BASE_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def agent(config: Path, label: str = LABEL, bin_dir: Path | None = None, log: Path | None = None) -> dict:
    bin_dir = bin_dir or Path(sys.executable).parent
    log = log or Path("~/Library/Logs/mlxwatch.log").expanduser()
    return {
        "Label": label,
        "ProgramArguments": [str(bin_dir / "mlxwatch"), "--config", str(config), "run"],
        "EnvironmentVariables": {"PATH": f"{bin_dir}:/opt/homebrew/bin:/usr/local/bin:{BASE_PATH}",
                                 "PYTHONUNBUFFERED": "1"},
        "RunAtLoad": True,
        "KeepAlive": True,
        "ThrottleInterval": 30,  # if mlxwatch itself crash-loops, launchd waits between starts
        "ProcessType": "Standard",  # not Background: probes must not be throttled into false verdicts
        "StandardOutPath": str(log),
        "StandardErrorPath": str(log),
    }


def render(config: Path, label: str = LABEL, bin_dir: Path | None = None, log: Path | None = None) -> bytes:
    return plistlib.dumps(agent(config, label, bin_dir, log), sort_keys=False)
