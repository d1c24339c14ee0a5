"""``mlxwatch bundle list|show|export``: the evidence bundles on disk."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from mlxwatch.cli.common import (
    EXIT_OK,
    bundles_dir,
    err_console,
    load_optional,
    make_out_dir,
    out_target,
    writing_in,
)
from mlxwatch.errors import UsageError


def _find_bundle(text: str, args: argparse.Namespace, command: str) -> Path:
    """A bundle directory or archive given by path, or by name inside the bundles dir."""
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text and "/" not in text and text not in (".", ".."):
        candidate = bundles_dir(load_optional(args)) / text
        if candidate.exists():
            return candidate
    raise UsageError(f"bundle {command}: {text!r}: no such bundle directory or archive "
                     "(`mlxwatch bundle list` shows the bundles)")


def cmd_bundle(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.errors import BundleError

    try:
        return {"list": _bundle_list, "show": _bundle_show, "export": _bundle_export}[args.bundle_command](args, out)
    except BundleError as exc:
        prefix = f"bundle {args.bundle_command}: "
        raise exc if str(exc).startswith(prefix) else BundleError(prefix + str(exc)) from None


def _bundle_list(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.capture.bundle import bundle_entries
    from mlxwatch.output.bundles import render_bundle_list

    root = Path(args.dir).expanduser() if args.dir else bundles_dir(load_optional(args))
    if args.dir and root.exists() and not root.is_dir():
        raise UsageError(f"bundle list: --dir {root} is a file, not a directory (give the bundles dir)")
    if args.dir and not root.is_dir():
        raise UsageError(f"bundle list: --dir {root}: no such directory")
    entries = [e for e in bundle_entries(root) if not args.instance or e["instance"] == args.instance]
    if args.instance and not entries:
        # A typo, not "no bundles" (exit 2, as for every command's --instance); an instance
        # dropped from the config still lists the bundles it left.
        names = [i.name for i in load_optional(args).instances]
        if args.instance not in names:
            raise UsageError(f"bundle list: --instance {args.instance!r}: no instance of that name in the config "
                             f"(known: {', '.join(names) or 'none'}) and no bundle of it in {root}")
    if args.json:
        print(json.dumps({"dir": str(root), "bundles": entries}, indent=2, default=str))
    else:
        render_bundle_list(str(root), entries, out)
    return EXIT_OK


MAX_SUMMARY_BYTES = 16 * 1024 * 1024


def _bundle_show(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.capture.bundle import MANIFEST, SUMMARY, load_manifest, read_bounded
    from mlxwatch.capture.export import read_archive
    from mlxwatch.errors import BundleError

    path = _find_bundle(args.bundle, args, "show")
    if path.is_dir():
        has_manifest, has_summary = (path / MANIFEST).is_file(), (path / SUMMARY).is_file()
        if not has_manifest and not has_summary:
            what = ("an incomplete bundle (its capture was interrupted); look at its files directly"
                    if path.name.endswith("-incomplete") else
                    "not a bundle (no manifest.json or summary.md); `mlxwatch bundle list` shows the bundles")
            raise BundleError(f"bundle show: {path} is {what}")
        if args.json:
            print(json.dumps(load_manifest(path), indent=2, default=str))
            return EXIT_OK
        if not has_summary:
            raise BundleError(f"bundle show: {path} has no {SUMMARY} (a damaged bundle?); "
                              f"`mlxwatch bundle show --json {path}` prints its manifest")
        try:
            text = read_bounded(path / SUMMARY, MAX_SUMMARY_BYTES).decode("utf-8", errors="replace")
        except (OSError, ValueError) as exc:
            raise BundleError(f"bundle show: {path / SUMMARY}: cannot read: {exc}") from None
        sys.stdout.write(text)
        return EXIT_OK
    if not path.is_file():
        raise BundleError(f"bundle show: {path} is not a bundle directory or a .tar.gz archive")
    view = read_archive(path)
    if args.json:
        if view.manifest is None:
            raise BundleError(f"bundle show: {path} has no {MANIFEST}")
        print(json.dumps(view.manifest, indent=2, default=str))
    elif view.summary is None:
        raise BundleError(f"bundle show: {path} has no {SUMMARY}; `mlxwatch bundle show --json {path}` prints its manifest")
    else:
        sys.stdout.write(view.summary)
    return EXIT_OK


def _bundle_export(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.capture import export_bundle
    from mlxwatch.capture.bundle import load_manifest
    from mlxwatch.errors import BundleError
    from mlxwatch.output.bundles import render_redaction, render_skipped

    path = _find_bundle(args.bundle, args, "export")
    if not path.is_dir():
        raise BundleError(f"bundle export: {path} is not a bundle directory")
    try:
        load_manifest(path)  # refused before --out's directory is made: a refusal creates nothing
    except BundleError as exc:
        raise BundleError(f"bundle export: {exc}") from None
    out_dir, archive = out_target(args.out, "bundle export") if args.out else (None, None)
    target_dir = archive.parent if archive else out_dir
    if target_dir is not None and not (target_dir.resolve() == path.resolve() or path.resolve() in target_dir.resolve().parents):
        make_out_dir(target_dir, "bundle export", args.out)  # (inside the bundle: export_bundle refuses it)
    skipped: list[str] = []
    try:
        with writing_in(target_dir, "bundle export", args.out):
            written = export_bundle(path, archive or out_dir, redact=args.redact, on_skip=skipped.append,
                                    request_bodies=args.with_request_bodies)
    except FileExistsError as exc:
        raise UsageError(f"bundle export: {exc} (give --out a new name or another directory)") from None
    if skipped:
        render_skipped(err_console(), skipped)
    print(written)
    render_redaction(err_console(), args.redact, request_bodies=args.with_request_bodies)
    return EXIT_OK
