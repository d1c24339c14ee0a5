"""``mlxwatch replay BUNDLE``: send a bundle's recorded requests again (``mlxwatch.replay``).

Exit 0 the hang came back, 1 it did not, 2 the replay could not run (a bad bundle or flag, no
server to send to): what ``git bisect run`` and ddmin scripts expect, so it composes with them.
Anything that keeps the replay from running, a bug included, is exit 2, never 1: a script
must not read "could not test" as "fixed".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from mlxwatch.cli.common import EXIT_USAGE, err_console, url_arg
from mlxwatch.errors import MlxwatchError, UsageError

DEBUG_ENV = "MLXWATCH_DEBUG"


def cmd_replay(args: argparse.Namespace, out: Console) -> int:
    err = err_console()
    try:
        return _replay(args, out, err)
    except (MlxwatchError, OSError) as exc:
        where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
        text = f"{where}{exc.strerror or exc}" if isinstance(exc, OSError) else str(exc)
        err.print(f"mlxwatch: {text if text.startswith('replay: ') else 'replay: ' + text}", markup=False)
        return EXIT_USAGE
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as exc:  # a bug: one line, exit 2 (could not run), never 1 (not reproduced)
        if os.environ.get(DEBUG_ENV):
            raise
        err.print(f"mlxwatch: replay: internal error: {type(exc).__name__}: {exc} (please report it; "
                  f"{DEBUG_ENV}=1 shows the traceback)", markup=False)
        return EXIT_USAGE


def _replay(args: argparse.Namespace, out: Console, err: Console) -> int:
    from mlxwatch.config import ProbeConfig
    from mlxwatch.output.replay import render_outcome, render_shrunk, render_start, render_trial
    from mlxwatch.replay.options import Budget, ReplayOptions
    from mlxwatch.replay.run import exit_code, plan_replay, run_replay
    from mlxwatch.replay.shrink import shrink

    if args.shrink and args.to:
        raise UsageError("replay: --shrink starts a fresh server for each trial (from the recorded command line); "
                         "it cannot use --to")
    if not args.shrink and (args.max_trials or args.max_time):
        raise UsageError("replay: --max-trials and --max-time bound --shrink; give --shrink too")
    if args.shrink and args.repeat:
        raise UsageError("replay: --repeat and --shrink do not go together (each trial sends the sequence once)")
    if not (args.to or args.launch or args.shrink):
        raise UsageError("replay: say where to send the requests: --to URL, or --launch (a server started from "
                         "the bundle's recorded command line)")
    to = url_arg("replay", args.to, "--to") if args.to else None
    bundle = Path(args.bundle)
    if not bundle.is_dir():
        hint = (" (an exported archive: extract it first, `tar xzf`; it holds the bodies only if exported "
                "--with-request-bodies)" if bundle.name.endswith((".tar.gz", ".tgz")) and bundle.is_file() else "")
        raise UsageError(f"replay: {bundle} is not a bundle directory{hint}")
    plan = plan_replay(bundle, to=to, launch=not to, allow_bundle_url=args.allow_bundle_url)
    base = ReplayOptions()
    opts = replace(base, speed=args.speed or base.speed, repeat=args.repeat or base.repeat,
                   stall_timeout=args.stall_timeout or base.stall_timeout)
    startup = args.startup_timeout or ProbeConfig.startup_timeout
    out_dir = Path(args.out) if args.out else bundle.resolve().parent
    if out_dir.exists() and not out_dir.is_dir():  # mkdir's own word for it is "File exists"
        raise UsageError(f"replay: --out {out_dir} is not a directory: give a directory for the replay's bundle")
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.shrink:
        budget = Budget(trials=args.max_trials or Budget.trials, seconds=args.max_time or Budget.seconds)
        if not args.json:
            render_start(err, plan, None, shrinking=True)
        found = asyncio.run(shrink(plan, opts, budget, startup_timeout=startup,
                                   on_trial=None if args.json else lambda t, n: render_trial(err, t, n)))
        if not found.reproduced:
            render_shrunk(out, found, None, as_json=args.json)
            return 1
        final = asyncio.run(run_replay(plan, opts, out_dir, startup_timeout=startup, requests=found.requests))
        render_shrunk(out, found, final, as_json=args.json)
        return exit_code(final)
    if not args.json:
        render_start(err, plan, to, shrinking=False)
    report = asyncio.run(run_replay(plan, opts, out_dir, startup_timeout=startup,
                                    on_round=None if args.json or opts.repeat == 1 else
                                    lambda n: err.print(f"replay: round {n} of {opts.repeat}", markup=False)))
    if args.json:
        out.print(json.dumps(_json(report), indent=2, default=str), markup=False, highlight=False, soft_wrap=True)
    else:
        render_outcome(out, report, len(plan.requests))
    return exit_code(report)


def _json(report) -> dict:
    o = report.outcome
    return {"reproduced": o.hung, "reason": o.reason, "sent": o.sent, "rounds": o.rounds, "after_seq": o.after_seq,
            "in_flight": list(o.in_flight), "verdict_after_s": o.verdict_after_s, "quiet_s": o.quiet_s,
            "url": report.url, "launched": report.launched, "bundle": str(report.bundle) if report.bundle else None,
            "kind": report.kind, "confidence": report.confidence, "capture_error": report.capture_error}
