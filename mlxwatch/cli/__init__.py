"""The ``mlxwatch`` command: ``main`` is the console script, ``run`` returns the exit code.

A thin layer (watchfiles' ``cli.py`` is the model): ``parser`` reads the arguments, one module
per command family calls the core and prints through ``mlxwatch.output``, and ``app`` maps
exceptions to the documented exit codes. No decision about servers, processes or files that
the core could make is made here::

    from mlxwatch.cli import run
    code = run(["check", "http://127.0.0.1:8080"])
"""

from mlxwatch.cli.app import COMMANDS, DEBUG_ENV, EXIT_PIPE, main, run
from mlxwatch.cli.common import EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE
from mlxwatch.cli.parser import build_parser, help_duration

__all__ = ["COMMANDS", "DEBUG_ENV", "EXIT_OK", "EXIT_PIPE", "EXIT_UNHEALTHY", "EXIT_USAGE", "build_parser",
           "help_duration", "main", "run"]
