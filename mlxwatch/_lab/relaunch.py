"""Restart hook for lab servers: ``python -m mlxwatch._lab.relaunch WORKDIR``.

A watchdog ``command:`` restart runs this; it stops the server recorded in ``WORKDIR/lab.json``
(by that PID and create time only), clears the fault and starts it again on the same port.
Exit 0 once the new server generates, 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mlxwatch._lab.server import LabServer


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m mlxwatch._lab.relaunch WORKDIR", file=sys.stderr)
        return 2
    server = LabServer.load(Path(argv[0]))
    try:
        server.relaunch()
    except (RuntimeError, OSError) as exc:
        print(f"relaunch: {exc}", file=sys.stderr)
        return 1
    print(f"relaunched pid {server.pid} at {server.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
