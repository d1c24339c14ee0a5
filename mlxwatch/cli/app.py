"""The ``mlxwatch`` command line: parse arguments, call the core, print, exit.

Exit codes: 0 success / healthy, 1 unhealthy or target missing, 2 usage or config error.
Only the CLI prints to stderr or calls ``sys.exit``. Every error is one line on stderr
naming the file, field or value and what to do; no traceback reaches the user (set
``MLXWATCH_DEBUG=1`` to see one for an internal error). The commands live one family a
module beside this one; what they print for people is rendered by ``mlxwatch.output``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from rich.console import Console

from mlxwatch.cli.bundle import cmd_bundle
from mlxwatch.cli.capture import cmd_capture
from mlxwatch.cli.check import cmd_check
from mlxwatch.cli.common import EXIT_UNHEALTHY, EXIT_USAGE, err_console, out_console
from mlxwatch.cli.config import cmd_config
from mlxwatch.cli.daemon import cmd_resume, cmd_run, cmd_status
from mlxwatch.cli.parser import build_parser, parse
from mlxwatch.cli.replay import cmd_replay
from mlxwatch.cli.setup import cmd_demo, cmd_doctor, cmd_launch, cmd_launchd
from mlxwatch.errors import (
    BundleError,
    ConfigError,
    MlxwatchError,
    ProcessGoneError,
    ReplayError,
    StateError,
    Terminated,
    UsageError,
)

EXIT_PIPE = 141  # stdout closed by the reader (`| head`): what a shell reports for SIGPIPE
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143  # Ctrl-C, SIGTERM (demo): what a shell reports for them
DEBUG_ENV = "MLXWATCH_DEBUG"

COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {
    "config": cmd_config,
    "check": cmd_check,
    "capture": cmd_capture,
    "bundle": cmd_bundle,
    "run": cmd_run,
    "status": cmd_status,
    "resume": cmd_resume,
    "doctor": cmd_doctor,
    "demo": cmd_demo,
    "launchd": cmd_launchd,
    "launch": cmd_launch,
    "replay": cmd_replay,
}


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(argv))


def _silence_stdout() -> None:
    """The reader of stdout went away (`| head`): later writes, and the interpreter's own flush
    at exit, go to /dev/null instead of raising BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a captured or closed stdout
        pass




def run(argv: Sequence[str] | None = None, out: Console | None = None) -> int:
    """Run one command and return its exit code (tests call this directly)."""
    out = out or out_console()
    err = err_console()
    try:
        args = parse(build_parser(), sys.argv[1:] if argv is None else argv)
        return COMMANDS[args.command](args, out)
    except (ConfigError, UsageError, StateError) as exc:
        err.print(f"mlxwatch: {exc}", markup=False)
        return EXIT_USAGE
    except ProcessGoneError as exc:
        err.print(f"mlxwatch: {exc}", markup=False)
        return EXIT_UNHEALTHY
    except MlxwatchError as exc:
        err.print(f"mlxwatch: {exc}", markup=False)
        return EXIT_USAGE if isinstance(exc, (BundleError, ReplayError)) else EXIT_UNHEALTHY
    except Terminated:
        err.print("mlxwatch: terminated")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        err.print("mlxwatch: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE
    except OSError as exc:  # a file or directory the command needed: named, one line
        where = f"{exc.filename}: " if exc.filename else ""
        err.print(f"mlxwatch: {where}{exc.strerror or exc}", markup=False)
        return EXIT_UNHEALTHY
    except Exception as exc:  # a bug: still one line; the traceback on request
        if os.environ.get(DEBUG_ENV):
            raise
        err.print(f"mlxwatch: internal error: {type(exc).__name__}: {exc} "
                  f"(please report it; {DEBUG_ENV}=1 shows the traceback)", markup=False)
        return EXIT_UNHEALTHY
