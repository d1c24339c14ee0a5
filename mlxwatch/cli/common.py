"""What every command shares: exit codes, the config it reads, and the files its arguments name.

Only the CLI prints to stderr or exits; these helpers raise ``UsageError`` (one line, exit 2)
for an argument that cannot work, naming the argument and the value.
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rich.console import Console

from mlxwatch.config import Config, bundles_dir_for, load_config, resolve_config_path, state_dir_for
from mlxwatch.errors import UsageError
from mlxwatch.storage import no_space

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2


class PipeConsole(Console):
    """rich's Console, except when the reader goes away (`| head`): rich's own answer is
    ``SystemExit(1)``, an exit code that says "unhealthy" with no line to say why; this one
    raises ``BrokenPipeError``, which ``run`` answers with the shell's SIGPIPE code, 141."""

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is written through this console
        raise BrokenPipeError


def out_console() -> Console:
    return PipeConsole(highlight=False, soft_wrap=True)


def err_console() -> Console:
    return PipeConsole(stderr=True, highlight=False, soft_wrap=True)


def explicit_config(args: argparse.Namespace) -> bool:
    from mlxwatch.config import CONFIG_ENV

    return bool(args.config or os.environ.get(CONFIG_ENV))


def load_optional(args: argparse.Namespace) -> Config:
    """The config if one exists at the resolved path; defaults if the user has none. A config
    named by --config or $MLXWATCH_CONFIG must exist."""
    path = resolve_config_path(args.config)
    if explicit_config(args) or path.exists():
        return load_config(path)
    return Config()


def bundles_dir(config: Config, override: str | None = None) -> Path:
    """--out, else where the daemon keeps its bundles for this config."""
    if override:
        return Path(override).expanduser()
    return bundles_dir_for(config, state_dir_for(config))


def load(args: argparse.Namespace, path: str | None = None) -> Config:
    return load_config(resolve_config_path(path or args.config))


def out_target(text: str, command: str) -> tuple[Path | None, Path | None]:
    """``--out`` means the same for every command: a directory, or a new file whose name ends in
    ``.tar.gz``. A missing directory (the archive's too) is made with its parents, like
    ``mkdir -p``, by ``make_out_dir`` once the command is sure to write; here it is only checked
    that it can be. Returns (directory, archive): one of them."""
    path = Path(text).expanduser()
    if path.name.endswith(".tar.gz"):
        if path.exists() or path.is_symlink():
            raise UsageError(f"{command}: --out {path} exists; not overwriting (give a new name)")
        check_out_dir(path.parent, command, path)
        return None, path
    if path.exists() and not path.is_dir():
        raise UsageError(f"{command}: --out {path} is a file, not a directory "
                         "(give a directory, or a new file name ending in .tar.gz)")
    if not path.exists() and path.suffix.lower() in (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z"):
        raise UsageError(f"{command}: --out {path}: archives are gzip tarballs, so the name must end in .tar.gz")
    check_out_dir(path, command, path)
    return path, None


def check_out_dir(directory: Path, command: str, given: Path) -> None:
    """Refuse, naming the user's ``--out``, a directory that cannot be written or made."""
    existing = next(p for p in (directory, *directory.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise UsageError(f"{command}: --out {given}: {existing} is not a directory")
    what = "write in" if existing == directory else "create a directory in"
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{command}: --out {given}: cannot {what} {existing} (permission denied); "
                         "give a directory you can write")
    # os.access says yes to root everywhere, and knows nothing of a read-only file system or of
    # /proc: try, so that a capture is refused before it runs, not after.
    trial = existing / f".mlxwatch-try-{os.getpid()}"
    try:
        os.close(os.open(trial, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
        os.unlink(trial)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"{command}: --out {given}: cannot {what} {existing} ({exc.strerror or exc}); "
                         "give a directory you can write") from None


def make_out_dir(directory: Path, command: str, given: str) -> None:
    """Make a missing ``--out`` directory with its parents (and say so on stderr)."""
    if directory.is_dir():
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{command}: --out {given}: cannot create {directory}: {exc.strerror or exc}") from None
    err_console().print(f"mlxwatch: {command}: created {directory}", markup=False)


def unwritable(exc: OSError, directory: Path, command: str, given: str | None) -> UsageError | None:
    """An ``OSError`` from writing in ``directory`` as the user's problem: their ``--out`` (or
    capture.dir) named, not the hidden ``.partial`` path the writer was making. None: another file.

    A full disk (ENOSPC, EDQUOT) comes from ``write(2)``, which names no file: it is taken as
    ``directory``'s, so the caller passes only the directory the failing step wrote in."""
    where = Path(exc.filename) if exc.filename else None
    full = no_space(exc)
    if where is None and full:
        where = directory
    # The directory itself, a file in it, or one of its parents being made (a state dir that
    # cannot be created holds the default bundles dir).
    if where is None or not (where == directory or directory in where.parents or where in directory.parents):
        return None
    why = exc.strerror or str(exc)
    if given is not None:
        fix = "free some space there or give another directory" if full else "give a directory you can write"
        return UsageError(f"{command}: --out {given}: cannot write there: {why}; {fix}")
    fix = "free some space there, set capture.dir in the config, or give --out DIR" if full \
        else "set capture.dir in the config, or give --out DIR"
    return UsageError(f"{command}: cannot write a bundle in {directory}: {why} ({fix})")


@contextmanager
def writing_in(directory: Path | None, command: str, given: str | None) -> Iterator[None]:
    """Write in ``directory``: an ``OSError`` there is raised as the user's one-line problem
    (``unwritable``); any other goes on as it was, FileExistsError too (nothing is overwritten:
    the caller says so in its own words)."""
    try:
        yield
    except FileExistsError:
        raise
    except OSError as exc:
        refusal = unwritable(exc, directory, command, given) if directory is not None else None
        if refusal is None:
            raise
        raise refusal from None


def url_arg(command: str, text: str, field: str = "--url") -> str:
    from mlxwatch.config import ValueNotShown, parse_base_url  # the same URL rule as the config file

    try:
        return parse_base_url(text)
    except ValueNotShown as exc:  # it shows the URL itself, any secret in it masked
        raise UsageError(f"{command}: {field + ' ' if field else ''}{exc}") from None
    except ValueError as exc:
        raise UsageError(f"{command}: {field + ' ' if field else ''}{exc} (got {text!r})") from None


def state_dir(config: Config, override: str | None) -> Path:
    return state_dir_for(config, Path(override).expanduser() if override else None)



def log_arg(text: str) -> Path:
    import stat as stat_mod

    path = Path(text).expanduser()
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise UsageError(f"capture: --log {path}: no such file (give the file the server's stdout and stderr go to)") from None
    except OSError as exc:
        raise UsageError(f"capture: --log {path}: {exc.strerror or exc}") from None
    if not stat_mod.S_ISREG(mode):
        raise UsageError(f"capture: --log {path} is not a regular file (give the server's log file)")
    return path
