"""``mlxwatch check``: probe a server once, or until healthy with ``--wait``."""

from __future__ import annotations

import argparse
import asyncio
import json

from rich.console import Console

from mlxwatch.cli.common import EXIT_OK, EXIT_UNHEALTHY, err_console, load, url_arg
from mlxwatch.config import InstanceConfig, ProbeConfig
from mlxwatch.errors import UsageError


def _check_target(args: argparse.Namespace) -> tuple[str, ProbeConfig]:
    if args.instance and args.url:
        raise UsageError("check: give a URL or --instance, not both")
    if args.instance:
        inst: InstanceConfig = load(args).instance(args.instance)
        return inst.url, inst.probe
    if not args.url:
        raise UsageError("check: give a URL (e.g. http://127.0.0.1:8080) or --instance NAME")
    return url_arg("check", args.url, ""), ProbeConfig()


def cmd_check(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.output.check import render_check, render_waiting
    from mlxwatch.probes import check_until_healthy

    url, probe = _check_target(args)
    timeout = args.timeout or probe.timeout
    first = args.first_token_timeout or min(probe.first_token_timeout, timeout)
    if first > timeout:
        raise UsageError(f"check: --first-token-timeout ({first:g}s) exceeds --timeout ({timeout:g}s)")
    err = err_console()
    waited = asyncio.run(check_until_healthy(
        url, first_token_timeout=first, timeout=timeout, max_tokens=args.max_tokens or probe.max_tokens,
        endpoint_timeout=min(probe.endpoint_timeout, timeout), wait=args.wait,
        on_wait=lambda seconds, reason: render_waiting(err, url, seconds, args.wait, reason),
    ))
    report = waited.report
    if args.json:
        data = report.to_dict()
        if args.wait is not None:
            data["waited"] = {"seconds": round(waited.seconds, 3), "probes": waited.probes}
        print(json.dumps(data, indent=2))
    else:
        render_check(report, out, waited=(waited.seconds, waited.probes) if args.wait is not None else None)
    return EXIT_OK if report.healthy else EXIT_UNHEALTHY
