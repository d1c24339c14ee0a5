"""The exceptions mlxwatch raises, one tree so callers can catch at the depth they need::

    MlxwatchError
    ├── ConfigError        a config file or value is wrong (CLI exit 2)
    ├── UsageError         a command-line value is wrong (CLI exit 2)
    ├── ProcessGoneError   the target PID does not exist (CLI exit 1)
    ├── RestartError       a restart method could not run or failed
    ├── StateError         the state dir is held by another daemon or unusable (CLI exit 2)
    ├── BundleError        a path is not a bundle or archive, or it cannot be read or exported (CLI exit 2)
    └── FrontError         the front door cannot start (its address is taken or cannot be bound)

``Terminated`` (a KeyboardInterrupt: SIGTERM turned into one so that cleanup runs; CLI exit
143) is outside the tree, beside the KeyboardInterrupt it is.

Library code raises these; only ``mlxwatch.cli`` turns them into messages and exit codes.
Probe failures are not exceptions: a probe always returns a result that says what went wrong.
"""

from __future__ import annotations


class MlxwatchError(Exception):
    """Base of every error mlxwatch raises on purpose."""


class ConfigError(MlxwatchError):
    """A config value is wrong. ``str()`` is one line naming file, key path and value."""

    def __init__(self, file: str, key_path: str, message: str) -> None:
        self.file = file
        self.key_path = key_path
        self.message = message
        where = f"{file}: {key_path}" if key_path else file
        super().__init__(f"{where}: {message}")


class UsageError(MlxwatchError):
    """A command-line argument is wrong."""


class ProcessGoneError(MlxwatchError):
    """The process to inspect or restart does not exist (or is not the one we recorded)."""


class RestartError(MlxwatchError):
    """A restart method failed to run, timed out, or exited non-zero."""


class StateError(MlxwatchError):
    """The state directory cannot be used: another daemon holds it, or a file there is not a file."""


class BundleError(MlxwatchError):
    """A path is not a bundle (or an exported archive of one), or it cannot be read or exported."""


class FrontError(MlxwatchError):
    """The front door cannot serve: ``str()`` is one line naming the address and why."""


class ReplayError(MlxwatchError):
    """A replay cannot run (no server to send to, a server that will not start): exit 2, as
    ``git bisect run`` reads "could not test"; ``str()`` is one line."""


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while a command that must clean up ran (``mlxwatch demo``); exit 143."""
