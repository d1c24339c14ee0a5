"""The test lab's server: the demo's lab server plus what only tests and benchmarks use.

``mlxwatch._lab.server.LabServer`` starts the stock ``mlx_lm.server`` on a tiny model with
the switchable fault; this subclass adds extra server arguments (``extra_args``), a start through
``mlxwatch launch`` with the shim loaded (``shim=()`` or launch options such as
``("--exit-on-thread-death",)``; the PID and command line are still the server's) and a slow
load (``launch(load_delay=)``)::

    server = LabServer.start(sys.executable, tmp_path / "lab", shim=())
    server.set_fault("spin")   # the next batch step livelocks
    big = LabServer.start(sys.executable, tmp_path / "big", start_fault="prefill 12",
                          extra_args=("--prefill-step-size", "512"))  # a big model's speed, from its start
    server.relaunch()          # stop our PID, clear the fault, start again on the same port
    server.stop()

A watchdog ``command:`` restart relaunches it with ``relaunch_argv(workdir)`` (``cli.py``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mlxwatch

from mlxwatch._lab.server import INJECT_DIR
from mlxwatch._lab.server import LabServer as DemoLabServer
from mlxwatch._lab.server import make_tiny_model, server_version

__all__ = ["LabServer", "make_tiny_model", "relaunch_argv", "server_version"]

CLI = Path(__file__).resolve().with_name("cli.py")
DELAY_INJECT_DIR = Path(__file__).resolve().with_name("inject")  # sleeps, then runs INJECT_DIR's


RELAUNCHES = "relaunches"  # in a workdir: a line per relaunch hook started (tests/lab/cli.py)


def relaunches_started(workdir: Path) -> int:
    """How many relaunch hooks have started in ``workdir`` (finished or not)."""
    try:
        return len((workdir / RELAUNCHES).read_text().splitlines())
    except FileNotFoundError:
        return 0


def relaunch_argv(workdir: Path) -> tuple[str, ...]:
    """A watchdog restart command that relaunches the lab server recorded in ``workdir``."""
    return (sys.executable, str(CLI), "relaunch", str(workdir))


@dataclass
class LabServer(DemoLabServer):
    """A lab server with extra arguments, an optional shim and an optional slow load."""

    extra_args: tuple[str, ...] = ()
    shim: tuple[str, ...] | None = None  # None: no shim; else `mlxwatch launch` options
    _load_delay: float = field(default=0.0, repr=False, compare=False)

    def __post_init__(self) -> None:  # lab.json holds lists
        self.extra_args = tuple(self.extra_args)
        self.shim = tuple(self.shim) if self.shim is not None else None

    def command(self) -> list[str]:
        launch = [] if self.shim is None else [sys.executable, "-m", "mlxwatch", "launch", *self.shim, "--"]
        return [*launch, *super().command(), *self.extra_args]

    def launch(self, ready_timeout: float = 120.0, load_delay: float = 0.0) -> None:
        """As the demo's, and ``load_delay`` keeps the server from listening that long, like a big
        model's load (a relaunch loads at once again)."""
        self._load_delay = load_delay
        super().launch(ready_timeout)

    def environment(self) -> dict[str, str]:
        env = super().environment()
        if self._load_delay > 0:
            env.update(PYTHONPATH=str(DELAY_INJECT_DIR), MLXWATCH_LAB_LOAD_DELAY=str(self._load_delay),
                       MLXWATCH_LAB_NEXT_SITECUSTOMIZE=str(INJECT_DIR / "sitecustomize.py"))
        if self.shim is not None:  # `python -m mlxwatch launch` runs the mlxwatch under test (a worktree's,
            # not whichever the venv has installed), and so loads that one's shim; last, after the fault hook
            env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(Path(mlxwatch.__file__).resolve().parent.parent)])
        return env
