"""The ``mlxwatch`` command line: parse arguments, call the core, print, exit.

Exit codes: 0 success / healthy, 1 unhealthy or target missing, 2 usage or config error.
Only this module prints to stderr or calls ``sys.exit``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from rich.console import Console

from mlxwatch import __version__
from mlxwatch.config import Config, InstanceConfig, ProbeConfig, load_config, resolve_config_path
from mlxwatch.durations import parse_duration
from mlxwatch.errors import ConfigError, MlxwatchError, ProcessGoneError, StateError, UsageError

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2


def _duration_arg(text: str) -> float:
    try:
        seconds = parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 30, 30s, 5m)") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return seconds


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        raise UsageError(f"{self.prog}: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlxwatch", description="Watchdog and hang diagnostics for mlx_lm.server.")
    parser.add_argument("--version", action="version", version=f"mlxwatch {__version__}")
    parser.add_argument("--config", help="config file (default: $MLXWATCH_CONFIG or ~/.config/mlxwatch/config.yaml)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    cfg = sub.add_parser("config", help="config file tools")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True, parser_class=_Parser)
    validate = cfg_sub.add_parser("validate", help="check a config file and print what it watches")
    validate.add_argument("path", nargs="?", help="config file (default: as --config)")

    check = sub.add_parser("check", help="probe a server once; exit 0 healthy, 1 unhealthy")
    check.add_argument("url", nargs="?", help="server base URL, e.g. http://127.0.0.1:8080")
    check.add_argument("--instance", help="take URL and probe settings from this config instance")
    check.add_argument("--timeout", type=_duration_arg, help="whole-probe limit (default 120s)")
    check.add_argument("--first-token-timeout", type=_duration_arg, help="limit for the first token (default: min(60s, --timeout))")
    check.add_argument("--max-tokens", type=int, default=None, help="tokens to ask for (default 4)")
    check.add_argument("--json", action="store_true", help="print the full report as JSON")
    cap = sub.add_parser("capture", help="capture an evidence bundle from a server process now")
    cap.add_argument("pid", type=int, help="the mlx_lm.server process ID")
    cap.add_argument("--out", help="directory for bundles (default: config capture.dir or <state dir>/bundles)")
    cap.add_argument("--url", help="server base URL: adds /health, /v1/models and a generation probe")
    cap.add_argument("--log", help="server log file: adds the tail and markers")
    cap.add_argument("--instance", help="take URL and log from this config instance")
    cap.add_argument("--snapshots", type=int, help="py-spy dumps (default 3)")
    cap.add_argument("--spacing", type=_duration_arg, help="time between dumps (default 2s)")
    cap.add_argument("--ceiling", type=_duration_arg, help="hard limit for the whole capture (default 60s)")
    cap.add_argument("--stacks", choices=("auto", "pyspy", "shim", "sample"),
                     help="Python stacks from: auto (the launch shim if the server has it, else py-spy), pyspy, "
                          "shim (faulthandler via `mlxwatch launch`, no root) or sample (none; macOS sample only) "
                          "(default: capture.stacks, else auto)")
    cap.add_argument("--json", action="store_true", help="print the manifest as JSON, no progress display")

    bundle = sub.add_parser("bundle", help="look at or export a bundle")
    bundle_sub = bundle.add_subparsers(dest="bundle_command", required=True, parser_class=_Parser)
    show = bundle_sub.add_parser("show", help="print a bundle's summary")
    show.add_argument("dir")
    export = bundle_sub.add_parser("export", help="write a bundle as .tar.gz")
    export.add_argument("dir")
    export.add_argument("--redact", action="store_true", help="remove message contents, environment values, home paths")
    export.add_argument("--out", help="output file (default: beside the bundle)")
    run_p = sub.add_parser("run", help="run the watchdog daemon in the foreground")
    run_p.add_argument("--state-dir", help="journal and state (default: config state_dir, else the platform's)")
    run_p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    status = sub.add_parser("status", help="show each instance's state and last incident")
    status.add_argument("--state-dir")
    status.add_argument("--json", action="store_true")

    resume = sub.add_parser("resume", help="allow restarts again for an instance that was given up")
    resume.add_argument("name")
    resume.add_argument("--state-dir")

    agent = sub.add_parser("launchd", help="launchd agent for the daemon (macOS)")
    agent_sub = agent.add_subparsers(dest="launchd_command", required=True, parser_class=_Parser)
    plist = agent_sub.add_parser("plist", help="print the agent plist for this installation")
    install = agent_sub.add_parser("install", help="write ~/Library/LaunchAgents/LABEL.plist and load it "
                                                   "(0 installed, 1 launchctl failed, 2 usage/config)")
    uninstall = agent_sub.add_parser("uninstall", help="unload the agent and remove its plist; state and "
                                                       "bundles stay (0, 1 launchctl failed, 2 usage)")
    for p in (plist, install, uninstall):
        p.add_argument("--label", default="com.mlxwatch.daemon", help="launchd label (default com.mlxwatch.daemon)")
    for p in (plist, install):  # its own dest: a subparser default would overwrite mlxwatch --config
        p.add_argument("--config", dest="launchd_config",
                       help="config the agent runs with (default: as mlxwatch --config)")
    for p in (install, uninstall):
        p.add_argument("--force", action="store_true", help="replace or remove a plist mlxwatch did not write")

    launch = sub.add_parser("launch", help="run a server command with the launch shim (stacks without root, a "
                                           "delivery heartbeat), as the same process (exec)",
                            description="Run the server command after -- with the launch shim loaded, as the same "
                                        "process (exec: the PID launchd knows stays). Example: mlxwatch launch "
                                        "--name big -- mlx_lm.server --model MODEL --port 8080")
    launch.add_argument("--name", help="a name shown in the heartbeat")
    launch.add_argument("--exit-on-thread-death", action="store_true",
                        help="exit with status 70 when the generation thread dies (after its traceback is "
                             "written), so launchd's KeepAlive restarts the server at once")
    launch.add_argument("server_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the server command, unchanged")
    demo = sub.add_parser("demo", help="watch a tiny real mlx_lm.server through a livelock and its recovery")
    demo.add_argument("--keep", action="store_true", help="keep the demo's model and server log too")
    return parser


def _load_optional(args: argparse.Namespace) -> Config:
    """The config if one exists at the resolved path; defaults if the user has none."""
    path = resolve_config_path(args.config)
    if args.config or path.exists():
        return load_config(path)
    return Config()


def bundles_dir(config: Config, override: str | None = None) -> Path:
    """--out, else where the daemon keeps its bundles for this config."""
    from mlxwatch.watchdog.daemon import bundles_dir_for, state_dir_for

    if override:
        return Path(override).expanduser()
    return bundles_dir_for(config, state_dir_for(config))


def _load(args: argparse.Namespace, path: str | None = None) -> Config:
    return load_config(resolve_config_path(path or args.config))


def cmd_config_validate(args: argparse.Namespace, out: Console) -> int:
    config = _load(args, args.path)
    out.print(f"{config.path}: ok, {len(config.instances)} instance(s)")
    for inst in config.instances:
        p, r = inst.probe, inst.restart
        out.print(
            f"  {inst.name}: {inst.url} probe every {p.interval:g}s, first token {p.first_token_timeout:g}s, "
            f"total {p.timeout:g}s, verdict after {p.failures} failures; restart {r.method} {r.target or ' '.join(r.argv)}".rstrip()
        )
    return EXIT_OK


def _check_target(args: argparse.Namespace) -> tuple[str, ProbeConfig]:
    if args.instance and args.url:
        raise UsageError("check: give a URL or --instance, not both")
    if args.instance:
        inst: InstanceConfig = _load(args).instance(args.instance)
        return inst.url, inst.probe
    if not args.url:
        raise UsageError("check: give a URL (e.g. http://127.0.0.1:8080) or --instance NAME")
    from mlxwatch.config import parse_base_url  # the same URL rule as the config file

    try:
        url = parse_base_url(args.url)
    except ValueError as exc:
        raise UsageError(f"check: {exc} (got {args.url!r})") from None
    return url, ProbeConfig()


def cmd_check(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.probes import make_client, run_check
    from mlxwatch.reports import render_check

    url, probe = _check_target(args)
    timeout = args.timeout or probe.timeout
    first = args.first_token_timeout or (min(probe.first_token_timeout, timeout) if args.timeout else probe.first_token_timeout)
    if first > timeout:
        raise UsageError(f"check: --first-token-timeout ({first:g}s) exceeds --timeout ({timeout:g}s)")
    max_tokens = args.max_tokens if args.max_tokens is not None else probe.max_tokens
    if max_tokens <= 0:
        raise UsageError(f"check: --max-tokens must be positive (got {max_tokens})")

    async def go():
        async with make_client() as client:
            return await run_check(
                client, url, first_token_timeout=first, timeout=timeout,
                max_tokens=max_tokens, endpoint_timeout=min(probe.endpoint_timeout, timeout),
            )

    report = asyncio.run(go())
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render_check(report, out)
    return EXIT_OK if report.healthy else EXIT_UNHEALTHY


def cmd_capture(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.capture import CaptureRequest, capture_bundle
    from mlxwatch.process import ProcessIdentity

    config = _load_optional(args)
    url, log, label = args.url, Path(args.log).expanduser() if args.log else None, None
    if args.instance:
        inst = config.instance(args.instance)
        url, log, label = url or inst.url, log or inst.log, inst.name
    if args.snapshots is not None and args.snapshots <= 0:
        raise UsageError(f"capture: --snapshots must be positive (got {args.snapshots})")
    ProcessIdentity.of(args.pid)  # a PID that does not exist: one line, exit 1
    cap = config.capture
    request = CaptureRequest(
        pid=args.pid, out_dir=bundles_dir(config, args.out), label=label, url=url, log=log,
        snapshots=args.snapshots or cap.snapshots, spacing=args.spacing or cap.spacing,
        ceiling=args.ceiling or cap.ceiling, sudo=cap.sudo, log_tail_lines=cap.log_tail_lines,
        keep=cap.keep, max_bytes=cap.max_bytes, stacks=args.stacks or cap.stacks,
    )
    if args.json:
        bundle = asyncio.run(capture_bundle(request))
        print(json.dumps({"path": str(bundle.path), **bundle.manifest}, indent=2, default=str))
        return EXIT_OK
    from mlxwatch.reports import CaptureProgress

    with CaptureProgress(out) as progress:
        bundle = asyncio.run(capture_bundle(request, on_step=progress.update))
    c = bundle.classification
    out.print(f"[bold]{c.kind}[/] ({c.confidence} confidence)")
    for line in c.evidence:
        out.print(f"  - {line}", markup=False)
    for line in c.competing:
        out.print(f"  ? {line}", markup=False)
    out.print(str(bundle.path), markup=False, highlight=False)
    return EXIT_OK


def _bundle_dir(text: str) -> Path:
    path = Path(text).expanduser()
    if not (path / "manifest.json").is_file():
        raise UsageError(f"bundle: {path} is not a bundle (no manifest.json)")
    return path


def cmd_bundle(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.capture import export_bundle

    path = _bundle_dir(args.dir)
    if args.bundle_command == "show":
        print((path / "summary.md").read_text(), end="")
        return EXIT_OK
    try:
        written = export_bundle(path, Path(args.out).expanduser() if args.out else None, redact=args.redact)
    except FileExistsError as exc:
        raise UsageError(f"bundle export: {exc}") from None
    print(written)
    return EXIT_OK


def _state_dir(config: Config, override: str | None) -> Path:
    from mlxwatch.watchdog.daemon import state_dir_for

    return state_dir_for(config, Path(override).expanduser() if override else None)


def cmd_run(args: argparse.Namespace, out: Console) -> int:
    import logging
    import signal

    from mlxwatch.watchdog.daemon import Daemon

    path = resolve_config_path(args.config)
    if not path.exists() and not args.config:
        raise UsageError(f"no config at {path}: nothing to watch. Write one (see mlxwatch.example.yaml) "
                         "or run `mlxwatch demo` to see the watchdog work on a tiny local server")
    config = load_config(path)
    if not config.instances:
        raise ConfigError(str(path), "instances", "no instances to watch")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    daemon = Daemon(config, _state_dir(config, args.state_dir))

    async def go() -> None:
        loop = asyncio.get_running_loop()
        stop, reload = asyncio.Event(), asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload.set)
        await daemon.run(stop, reload, load_config=lambda: load_config(path))

    asyncio.run(go())
    return EXIT_OK


def cmd_status(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.watchdog.status import collect_status, render_status

    config = _load_optional(args)
    status = collect_status(config, _state_dir(config, args.state_dir))
    if args.json:
        print(json.dumps(status, indent=2, default=str))
    else:
        render_status(status, out)
    return EXIT_OK


def cmd_resume(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.watchdog.state import request_resume

    config = _load_optional(args)
    if config.instances:
        config.instance(args.name)  # an unknown name is a config error, not a silent no-op
    path = request_resume(_state_dir(config, args.state_dir), args.name)
    out.print(f"resume requested for {args.name} ({path}); the daemon applies it at its next probe")
    return EXIT_OK


def cmd_launchd(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch import launchd

    label = launchd.check_label(args.label)
    if args.launchd_command == "uninstall":
        gone = launchd.uninstall(label, force=args.force)
        if not (gone.booted_out or gone.removed):
            out.print(f"nothing to uninstall: {label} is not loaded and {gone.plist} does not exist", markup=False)
        else:
            done = [w for w, did in (("unloaded", gone.booted_out), (f"removed {gone.plist}", gone.removed)) if did]
            out.print(f"{label}: {', '.join(done)}; the state dir and the bundles are kept", markup=False)
        return EXIT_OK
    config = resolve_config_path(args.launchd_config or args.config)
    if args.launchd_command == "plist":
        sys.stdout.write(launchd.render(config.resolve(), label).decode())
        return EXIT_OK
    done = launchd.install(config, label, force=args.force)
    target = f"{done.domain}/{label}"
    replaced = " (the loaded one was replaced)" if done.replaced_loaded else ""
    out.print(f"installed {label} in {done.domain}: {done.plist}{replaced}", markup=False)
    out.print(f"  runs      {' '.join(done.argv)}", markup=False)
    out.print(f"  log       {done.log}", markup=False)
    out.print(f"  reload    launchctl kill SIGHUP {target}", markup=False)
    out.print(f"  restart   launchctl kickstart -k {target}", markup=False)
    out.print(f"  remove    mlxwatch launchd uninstall --label {label}", markup=False)
    return EXIT_OK


def cmd_launch(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.launch import launch

    try:
        launch(list(args.server_command), name=args.name, exit_on_thread_death=args.exit_on_thread_death)
    except OSError as exc:  # exec itself failed (the command checked out a moment ago)
        raise UsageError(f"launch: cannot run {args.server_command[-1] if args.server_command else '?'}: "
                         f"{exc.strerror or exc}") from None
    return EXIT_USAGE  # not reached: launch execs or raises


def cmd_demo(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.demo import run_demo

    return run_demo(out, keep=args.keep)


COMMANDS: dict[str, Callable[[argparse.Namespace, Console], int]] = {
    "config": cmd_config_validate,
    "check": cmd_check,
    "capture": cmd_capture,
    "bundle": cmd_bundle,
    "run": cmd_run,
    "status": cmd_status,
    "resume": cmd_resume,
    "demo": cmd_demo,
    "launchd": cmd_launchd,
    "launch": cmd_launch,
}


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(argv))


def run(argv: Sequence[str] | None = None, out: Console | None = None) -> int:
    """Run one command and return its exit code (tests call this directly)."""
    out = out or Console(highlight=False, soft_wrap=True)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args, out)
    except (ConfigError, UsageError, StateError) as exc:
        err.print(f"mlxwatch: {exc}", markup=False)
        return EXIT_USAGE
    except ProcessGoneError as exc:
        err.print(f"mlxwatch: {exc}", markup=False)
        return EXIT_UNHEALTHY
    except MlxwatchError as exc:
        err.print(f"mlxwatch: {exc}", markup=False)
        return EXIT_UNHEALTHY
    except KeyboardInterrupt:
        err.print("mlxwatch: interrupted")
        return 130
