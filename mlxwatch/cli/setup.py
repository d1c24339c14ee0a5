"""Setting mlxwatch up on this machine: ``doctor``, ``launchd``, ``launch`` and ``demo``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from rich.console import Console

from mlxwatch.cli.common import EXIT_OK, EXIT_USAGE, err_console, explicit_config, state_dir
from mlxwatch.config import (
    Config,
    FrontConfig,
    bundles_dir_for,
    load_config,
    load_runnable_config,
    resolve_config_path,
)
from mlxwatch.errors import ConfigError, UsageError


def cmd_doctor(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.doctor import diagnose, exit_code
    from mlxwatch.output.doctor import render_findings

    path = resolve_config_path(args.config)
    config, problem = None, None
    if explicit_config(args) or path.exists():
        try:
            config = load_config(path)
        except ConfigError as exc:
            problem = str(exc)
    if args.instance and config is not None:
        config.instance(args.instance)  # an unknown name: one line, exit 2
    where = state_dir(config or Config(), args.state_dir)
    bundles = bundles_dir_for(config, where) if config is not None else None
    findings = asyncio.run(diagnose(config, path, problem, where, bundles, only=args.instance))
    if args.json:
        print(json.dumps({"ok": exit_code(findings) == 0, "config": str(path), "state_dir": str(where),
                          "findings": [f.to_dict() for f in findings]}, indent=2))
    else:
        render_findings(findings, out, path, where)
    return exit_code(findings)


def cmd_launchd(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.daemon import agent as launchd
    from mlxwatch.output.launchd import render_installed, render_uninstalled

    label = launchd.check_label(args.label)
    if args.launchd_command == "uninstall":
        render_uninstalled(launchd.uninstall(label, force=args.force), label, out)
        return EXIT_OK
    config = resolve_config_path(args.launchd_config or args.config)
    if args.launchd_command == "plist":  # an agent whose config `run` refuses would exit 2 every ThrottleInterval
        load_runnable_config(config)
        sys.stdout.write(launchd.render(config.resolve(), label).decode())
        return EXIT_OK
    render_installed(launchd.install(config, label, force=args.force, validate=load_runnable_config), label, out)
    return EXIT_OK


def cmd_launch(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.output.launchd import render_launch_warning
    from mlxwatch.shim.launcher import Record, launch

    err = err_console()
    bounds = [flag for flag, value in (("--record-max-age", args.record_max_age),
                                       ("--record-max-bytes", args.record_max_bytes)) if value is not None]
    if bounds and not args.record:  # else nothing is recorded, and nothing says so
        raise UsageError(f"launch: {bounds[0]} bounds --record; give --record too (off by default: the requests' "
                         "bodies are users' words)")
    record = Record(args.record_max_age or FrontConfig.record_max_age,
                    args.record_max_bytes or FrontConfig.record_max_bytes) if args.record else None
    try:
        launch(list(args.server_command), name=args.name, exit_on_thread_death=args.exit_on_thread_death,
               record=record, on_warning=lambda warning: render_launch_warning(err, warning))
    except OSError as exc:  # exec itself failed (the command checked out a moment ago)
        raise UsageError(f"launch: cannot run {args.server_command[-1] if args.server_command else '?'}: "
                         f"{exc.strerror or exc}") from None
    return EXIT_USAGE  # not reached: launch execs or raises


def cmd_demo(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.demo import run_demo
    from mlxwatch.output.demo import DemoView, render_demo_report

    result = run_demo(DemoView(out), keep=args.keep)
    render_demo_report(result, out)
    return 0 if result.ok else 1
