"""``mlxwatch capture``: an evidence bundle from a running server, now."""

from __future__ import annotations

import argparse
import asyncio
import json

from rich.console import Console

from mlxwatch.cli.common import (
    EXIT_OK,
    bundles_dir,
    err_console,
    load,
    load_optional,
    log_arg,
    make_out_dir,
    out_target,
    url_arg,
    writing_in,
)
from mlxwatch.config import ProbeConfig


def cmd_capture(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.capture import CaptureRequest, capture_bundle, capture_probe_timeouts, export_bundle
    from mlxwatch.capture.target import choose_target
    from mlxwatch.doctor import stacks_hint
    from mlxwatch.output.capture import CaptureProgress, render_capture, render_stacks_hint, render_target_notes

    config = load(args) if args.instance else load_optional(args)  # an instance needs the config that names it
    inst = config.instance(args.instance) if args.instance else None
    url = url_arg("capture", args.url) if args.url else inst.url if inst else None
    given_log = log_arg(args.log) if args.log else None
    out_dir, archive = out_target(args.out, "capture") if args.out else (None, None)
    err = err_console()
    target = choose_target(config.instances, args.pid, inst, url, args.force)
    render_target_notes(err, target, config.path)
    inst = target.instance
    cap = config.capture
    probe = inst.probe if inst is not None else ProbeConfig()
    target_dir = out_dir or bundles_dir(config)
    if args.out:
        make_out_dir(archive.parent if archive else target_dir, "capture", args.out)
    request = CaptureRequest(
        pid=target.pid, out_dir=target_dir, label=target.label, url=target.url,
        log=given_log or (inst.log if inst else None) or target.log,
        snapshots=args.snapshots or cap.snapshots, spacing=args.spacing or cap.spacing,
        ceiling=args.ceiling or cap.ceiling, sudo=cap.sudo, log_tail_lines=cap.log_tail_lines,
        keep=cap.keep, max_bytes=cap.max_bytes, keep_days=cap.keep_days, min_free_bytes=cap.min_free_bytes,
        stacks=args.stacks or cap.stacks, redact=cap.redact, kernel=inst is None or inst.kernel != "off",
        **capture_probe_timeouts(probe),
    )
    # A bundle or an archive that cannot be written where the user asked is their problem (exit
    # 2), told for the directory that step wrote in: a full disk's error names no file.
    with writing_in(target_dir, "capture", args.out if out_dir else None):
        if args.json:
            bundle = asyncio.run(capture_bundle(request))
        else:
            with CaptureProgress(out) as progress:
                bundle = asyncio.run(capture_bundle(request, on_step=progress.update))
                progress.finish(bundle.manifest.get("steps") or [])
    with writing_in(archive.parent if archive else None, "capture", args.out):
        written = export_bundle(bundle.path, archive) if archive else None
    hint = stacks_hint(bundle.manifest, cap.sudo)
    if args.json:
        print(json.dumps({"path": str(bundle.path), "archive": str(written) if written else None,
                          **bundle.manifest}, indent=2, default=str))
    else:
        render_capture(bundle.classification, bundle.path, written, out)
    if hint:
        render_stacks_hint(err, hint)
    return EXIT_OK
