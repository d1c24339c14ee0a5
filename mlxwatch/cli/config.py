"""``mlxwatch config validate|init|example``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from mlxwatch.cli.common import EXIT_OK, EXIT_UNHEALTHY, err_console
from mlxwatch.config import load_runnable_config, resolve_config_path
from mlxwatch.errors import UsageError


def cmd_config(args: argparse.Namespace, out: Console) -> int:
    return {"validate": cmd_config_validate, "init": cmd_config_init,
            "example": cmd_config_example}[args.config_command](args, out)


def cmd_config_validate(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.output.config import render_validated

    config = load_runnable_config(resolve_config_path(args.path or args.config))  # what `run` accepts, no more
    if args.json:
        from dataclasses import asdict

        data = {"path": str(config.path), "valid": True, **{k: v for k, v in asdict(config).items() if k != "path"}}
        print(json.dumps(data, indent=2, default=str))
        return EXIT_OK
    render_validated(config, out)
    return EXIT_OK


def cmd_config_init(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.host.discover import find_servers, starter_config
    from mlxwatch.output.config import render_written
    from mlxwatch.storage import write_new

    if args.print_only and args.out:  # --print wrote nothing and ignored --out, exit 0
        raise UsageError("config init: --out and --print contradict each other: --out FILE writes the config, "
                         "--print only shows it; give one of them")
    path = Path(args.out).expanduser() if args.out else resolve_config_path(args.config)
    if not args.print_only and path.is_dir():
        raise UsageError(f"config init: {path} is a directory; name the file to write (e.g. --out {path / 'config.yaml'})")
    if not args.print_only and path.exists():
        raise UsageError(f"config init: {path} exists; not overwriting (`mlxwatch config validate {path}` checks it; "
                         "--out FILE writes elsewhere, --print shows the new one)")
    if not args.print_only and args.out and not path.parent.is_dir():
        raise UsageError(f"config init: --out {path}: no such directory {path.parent} (create it first)")
    servers = find_servers()
    if not servers:
        err_console().print("mlxwatch: config init: no mlx-lm server is running, so there is nothing to watch yet "
                            "(start your server first, or start from `mlxwatch config example`)", markup=False)
        return EXIT_UNHEALTHY
    text = starter_config(servers)
    if args.print_only:
        sys.stdout.write(text)
        return EXIT_OK
    created = not path.parent.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # the default ~/.config/mlxwatch is normally missing
        write_new(path, text.encode())
    except FileExistsError:
        raise UsageError(f"config init: {path} exists; not overwriting") from None
    except OSError as exc:
        raise UsageError(f"config init: cannot write {path}: {exc.strerror or exc}") from None
    render_written(path, created, servers, out, f" --config {path}" if args.out else "")
    return EXIT_OK


def cmd_config_example(args: argparse.Namespace, out: Console) -> int:
    from importlib import resources

    sys.stdout.write(resources.files("mlxwatch").joinpath("data/mlxwatch.example.yaml").read_text(encoding="utf-8"))
    return EXIT_OK
