"""A supervisor as launchd's ``KeepAlive``: start a command again whenever it exits.

    python tests/lab/keepalive.py [--pause 0.5] -- mlx.launch -n 2 ... -- mlx_lm.server ...

It prints ``keepalive: started PID N`` for each start (the group's log names every launcher).
On Linux it is a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): the ranks a killed
launcher leaves behind are re-parented to it, as they are to launchd (PID 1 on macOS), not to
init, so it can reap them and end them. On SIGTERM (or SIGINT) it stops starting, sends SIGCONT
and SIGTERM to every process below it, by PID (read from ``/proc``), SIGKILL after ``--grace``,
reaps them all and exits: a test ends everything a group ever started by ending this one PID.
Stdlib only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


class Stop(Exception):
    """SIGTERM or SIGINT: end everything."""


def _stop(signum: int, frame: object) -> None:
    raise Stop


def _subreaper() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _parents() -> dict[int, int]:
    """PID -> parent PID of every process (``/proc``)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                out[int(name)] = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(root: int) -> list[int]:
    parents, found, todo = _parents(), [], [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        todo += children
    return found


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_all(grace: float) -> None:
    """Every process below this one: SIGCONT and SIGTERM, SIGKILL after ``grace``, reaped."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pid in descendants(os.getpid()):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    while descendants(os.getpid()) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    for pid in descendants(os.getpid()):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10.0
    while descendants(os.getpid()) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    _reap()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/lab/keepalive.py")
    parser.add_argument("--pause", type=float, default=0.5, help="seconds between an exit and the next start")
    parser.add_argument("--grace", type=float, default=5.0, help="SIGTERM -> SIGKILL when ending")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    _subreaper()
    try:
        while True:
            child = subprocess.Popen(command)
            print(f"keepalive: started PID {child.pid}", flush=True)
            while True:  # reap adopted orphans too, until the command itself exits
                pid, _ = os.waitpid(-1, 0)
                if pid == child.pid:
                    child.returncode = 0  # reaped here: Popen must not wait for it again
                    break
            print(f"keepalive: PID {child.pid} exited; starting it again", flush=True)
            time.sleep(args.pause)
    except Stop:
        end_all(args.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
