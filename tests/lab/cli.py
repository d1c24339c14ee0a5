"""Start or relaunch a test lab server from a shell or a watchdog restart hook::

    python tests/lab/cli.py start PYTHON WORKDIR   # make the model, start, print "URL PID"
    python tests/lab/cli.py relaunch WORKDIR       # stop the recorded PID, clear the fault, start again

``relaunch`` stops the server recorded in ``WORKDIR/lab.json`` (by that PID and create time
only) and starts it again on the same port with the same arguments and shim; exit 0 once it
generates, 1 otherwise, 2 on bad usage. It first appends a line to ``WORKDIR/relaunches``
(``relaunches_started``), so a test can tell that the hook is running, not only that the daemon
has said it is about to run it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: `lab` is tests/lab

from lab.server import RELAUNCHES, LabServer

USAGE = "usage: python tests/lab/cli.py start PYTHON WORKDIR | relaunch WORKDIR"


def main(argv: list[str]) -> int:
    if argv[:1] == ["start"] and len(argv) == 3:
        server = LabServer.start(argv[1], Path(argv[2]))
        print(server.url, server.pid, flush=True)
        return 0
    if argv[:1] == ["relaunch"] and len(argv) == 2:
        with open(Path(argv[1]) / RELAUNCHES, "a") as marks:
            marks.write(f"relaunch started by PID {os.getpid()}\n")
        server = LabServer.load(Path(argv[1]))
        try:
            server.relaunch()
        except (RuntimeError, OSError) as exc:
            print(f"relaunch: {exc}", file=sys.stderr)
            return 1
        print(f"relaunched pid {server.pid} at {server.url}")
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
