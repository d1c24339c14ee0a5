"""The ``mlxwatch`` command line: parse arguments, call the core, print, exit.

Exit codes: 0 success / healthy, 1 unhealthy or target missing, 2 usage or config error.
Only this module prints to stderr or calls ``sys.exit``. Every error is one line on stderr
naming the file, field or value and what to do; no traceback reaches the user (set
``MLXWATCH_DEBUG=1`` to see one for an internal error). Defaults shown by ``--help`` are read
from the config dataclasses (``ProbeConfig``, ``CaptureConfig``), never retyped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console

from mlxwatch import __version__
from mlxwatch.config import (
    MAX_COUNT,
    STACK_SOURCES,
    CaptureConfig,
    Config,
    InstanceConfig,
    ProbeConfig,
    bundles_dir_for,
    load_config,
    load_runnable_config,
    resolve_config_path,
    state_dir_for,
)
from mlxwatch.durations import (
    DURATION_FORM,
    NOT_A_DURATION,
    format_duration,
    human_duration,
    parse_duration,
)
from mlxwatch.errors import (
    ConfigError,
    MlxwatchError,
    ProcessGoneError,
    StateError,
    UsageError,
)

EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE = 0, 1, 2
EXIT_PIPE = 141  # stdout closed by the reader (`| head`): what a shell reports for SIGPIPE
DEBUG_ENV = "MLXWATCH_DEBUG"

_PROBE, _CAPTURE = ProbeConfig(), CaptureConfig()  # the one source of every default shown in --help


_human_duration = human_duration  # a default in --help, as a config file would say it


def _duration_arg(text: str) -> float:
    """A positive duration, refused in the words the config file uses (``-5s`` is not a duration)."""
    try:
        seconds = parse_duration(text)
    except ValueError as exc:
        why = DURATION_FORM if str(exc) == NOT_A_DURATION else str(exc)
        raise argparse.ArgumentTypeError(f"{why} (got {text!r})") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive duration (got {text!r})")
    return seconds


def _count_arg(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number: {text!r}") from None
    if not 0 < value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_COUNT}: {text!r}")
    return value


MAX_PID = 2**31 - 1


def _pid_arg(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a PID is a positive whole number (got {text!r})") from None
    if not 0 < value <= MAX_PID:
        raise argparse.ArgumentTypeError(f"a PID is a positive whole number (got {text!r})")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        where = self.prog.removeprefix("mlxwatch").strip()
        sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None and "the following arguments are required" in message:
            kind = "a subcommand" if where else "a command"
            message = f"give {kind}: {', '.join(sub.choices)}"
        raise UsageError(f"{where + ': ' if where else ''}{message} (see `{self.prog} --help`)")


def _leaf(sub: Any, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand that takes ``--config`` after its name too (``mlxwatch run --config X``).
    SUPPRESS: given here it wins; not given, the top-level ``--config`` stays."""
    parser = sub.add_parser(name, help=help, description=description or help[:1].upper() + help[1:] + ".")
    parser.add_argument("--config", default=argparse.SUPPRESS, metavar="FILE", help=CONFIG_HELP)
    return parser


CONFIG_DEFAULT = "$MLXWATCH_CONFIG, else ~/.config/mlxwatch/config.yaml"
CONFIG_HELP = f"config file (default: {CONFIG_DEFAULT})"


def build_parser() -> argparse.ArgumentParser:
    P, C = _PROBE, _CAPTURE
    d = _human_duration
    parser = _Parser(prog="mlxwatch", description="Watchdog and hang diagnostics for mlx_lm.server.")
    parser.add_argument("--version", action="version", version=f"mlxwatch {__version__}")
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)

    check = _leaf(sub, "check", "probe a server once (or until healthy with --wait); exit 0 healthy, 1 unhealthy")
    check.add_argument("url", nargs="?", help="server base URL, e.g. http://127.0.0.1:8080")
    check.add_argument("--instance", metavar="NAME", help="take the URL and probe settings from this config instance")
    check.add_argument("--timeout", type=_duration_arg, metavar="DURATION",
                       help=f"limit for the whole probe (default {d(P.timeout)}; with --instance its probe.timeout)")
    check.add_argument("--first-token-timeout", type=_duration_arg, metavar="DURATION",
                       help=f"limit for the first token (default {d(P.first_token_timeout)}, at most --timeout; "
                            "with --instance its probe.first_token_timeout)")
    check.add_argument("--max-tokens", type=_count_arg, metavar="N",
                       help=f"tokens to ask for (default {P.max_tokens}; with --instance its probe.max_tokens)")
    check.add_argument("--wait", type=_duration_arg, metavar="DURATION",
                       help="probe again (every second after a quick failure) until one probe is healthy or "
                            "DURATION has passed: for a server still loading in CI; a probe started in time "
                            "may run its own --timeout past DURATION")
    check.add_argument("--json", action="store_true", help="print the full report as JSON")

    cap = _leaf(sub, "capture", "capture an evidence bundle from a running mlx-lm server now")
    cap.add_argument("pid", nargs="?", type=_pid_arg, metavar="PID",
                     help="the mlx-lm server's process ID (with --instance: default the instance's server)")
    cap.add_argument("--instance", metavar="NAME", help="take the URL, log and server process from this config instance")
    cap.add_argument("--url", help="server base URL (default: the address PID listens on): adds /health, "
                                   "/v1/models and a generation probe")
    cap.add_argument("--log", metavar="FILE", help="the server's log file: adds the tail and markers")
    cap.add_argument("--out", metavar="DIR|FILE.tar.gz",
                     help="an existing directory to write the bundle in, or a new FILE.tar.gz to also write it "
                          "as an archive (default: capture.dir, else <state dir>/bundles)")
    cap.add_argument("--snapshots", type=_count_arg, metavar="N",
                     help=f"py-spy dumps (default {C.snapshots}, or the config's capture.snapshots)")
    cap.add_argument("--spacing", type=_duration_arg, metavar="DURATION",
                     help=f"time between dumps (default {d(C.spacing)}, or capture.spacing)")
    cap.add_argument("--ceiling", type=_duration_arg, metavar="DURATION",
                     help=f"hard limit for the whole capture (default {d(C.ceiling)}, or capture.ceiling)")
    cap.add_argument("--force", action="store_true",
                     help="capture PID even though it is not the mlx-lm server listening at the URL")
    cap.add_argument("--stacks", choices=STACK_SOURCES,
                     help="Python stacks from: auto (the launch shim if the server has it, else py-spy), pyspy, "
                          "shim (faulthandler via `mlxwatch launch`, no root) or sample (none; macOS sample only) "
                          "(default: capture.stacks, else auto)")
    cap.add_argument("--json", action="store_true", help="print the manifest as JSON, no progress display")

    bundle = sub.add_parser("bundle", help="list, show or export evidence bundles",
                            description="List, show or export evidence bundles.")
    bundle_sub = bundle.add_subparsers(dest="bundle_command", metavar="SUBCOMMAND", required=True, parser_class=_Parser)
    listing = _leaf(bundle_sub, "list", "list bundles, newest first")
    listing.add_argument("--dir", metavar="DIR", help="where to look (default: capture.dir, else <state dir>/bundles)")
    listing.add_argument("--instance", metavar="NAME", help="only this instance's bundles")
    listing.add_argument("--json", action="store_true", help="print the list as JSON")
    show = _leaf(bundle_sub, "show", "print a bundle's summary (a directory, a .tar.gz, or a name from bundle list)")
    show.add_argument("bundle", metavar="BUNDLE", help="bundle directory, exported .tar.gz, or bundle name")
    show.add_argument("--json", action="store_true", help="print the manifest as JSON instead")
    export = _leaf(bundle_sub, "export", "write a bundle as a .tar.gz (never overwrites)")
    export.add_argument("bundle", metavar="BUNDLE", help="bundle directory or bundle name")
    export.add_argument("--redact", action=argparse.BooleanOptionalAction, default=True,
                        help="remove secrets, message contents, environment values and home paths, for a public "
                             "issue (the default); --no-redact exports the bundle as captured (keep it private)")
    export.add_argument("--out", metavar="DIR|FILE.tar.gz",
                        help="an existing directory, or a new FILE.tar.gz (default: beside the bundle)")

    run_p = _leaf(sub, "run", "run the watchdog daemon in the foreground")
    run_p.add_argument("--state-dir", metavar="DIR", help="journal and state (default: config state_dir, else the platform's)")
    run_p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                       help="log detail (default INFO: one line per event)")

    status = _leaf(sub, "status", "show each instance's state, last probe and last incident; exit 0 all healthy, "
                                  "1 some instance not healthy or no daemon running")
    status.add_argument("--state-dir", metavar="DIR", help="state to read (default: config state_dir, else the platform's)")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--watch", nargs="?", const=2.0, type=_duration_arg, metavar="INTERVAL",
                        help="show it again every INTERVAL (default 2s) until Ctrl-C")
    status.add_argument("--count", type=_count_arg, metavar="N", help="with --watch: stop after N updates")

    resume = _leaf(sub, "resume", "allow restarts again for an instance that was given up")
    resume.add_argument("name", metavar="NAME", help="the instance's name in the config")
    resume.add_argument("--state-dir", metavar="DIR", help="state dir (default: config state_dir, else the platform's)")
    resume.add_argument("--json", action="store_true", help="print the request as JSON")

    doctor = _leaf(sub, "doctor", "check that mlxwatch can do its job here, one line per check with a fix; "
                                  "exit 0 all good, 1 something to fix")
    doctor.add_argument("--instance", metavar="NAME", help="check only this instance")
    doctor.add_argument("--state-dir", metavar="DIR", help="state dir (default: config state_dir, else the platform's)")
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")

    cfg = sub.add_parser("config", help="write, check or show a config file", description="Write, check or show a config file.")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="SUBCOMMAND", required=True, parser_class=_Parser)
    validate = _leaf(cfg_sub, "validate", "check a config file and print what it watches")
    validate.add_argument("path", nargs="?", metavar="PATH", help="config file (default: as --config)")
    validate.add_argument("--json", action="store_true", help="print the validated config as JSON")
    init = _leaf(cfg_sub, "init", "write a starter config for the mlx-lm servers running now (never overwrites)")
    init.add_argument("--out", metavar="FILE", help="where to write it (default: as --config)")
    init.add_argument("--print", dest="print_only", action="store_true", help="print it instead of writing a file")
    _leaf(cfg_sub, "example", "print the commented example config")

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
    demo = _leaf(sub, "demo", "watch a tiny real mlx_lm.server through a livelock and its recovery")
    demo.add_argument("--keep", action="store_true", help="keep the demo's model and server log too")
    return parser


def _err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _explicit_config(args: argparse.Namespace) -> bool:
    from mlxwatch.config import CONFIG_ENV

    return bool(args.config or os.environ.get(CONFIG_ENV))


def _load_optional(args: argparse.Namespace) -> Config:
    """The config if one exists at the resolved path; defaults if the user has none. A config
    named by --config or $MLXWATCH_CONFIG must exist."""
    path = resolve_config_path(args.config)
    if _explicit_config(args) or path.exists():
        return load_config(path)
    return Config()


def bundles_dir(config: Config, override: str | None = None) -> Path:
    """--out, else where the daemon keeps its bundles for this config."""
    if override:
        return Path(override).expanduser()
    return bundles_dir_for(config, state_dir_for(config))


def _load(args: argparse.Namespace, path: str | None = None) -> Config:
    return load_config(resolve_config_path(path or args.config))


def _out_target(text: str, command: str) -> tuple[Path | None, Path | None]:
    """``--out`` means the same for every command: a directory, or a new file whose name ends in
    ``.tar.gz``. A missing directory (the archive's too) is made with its parents, like
    ``mkdir -p``, by ``_make_out_dir`` once the command is sure to write; here it is only checked
    that it can be. Returns (directory, archive): one of them."""
    path = Path(text).expanduser()
    if path.name.endswith(".tar.gz"):
        if path.exists() or path.is_symlink():
            raise UsageError(f"{command}: --out {path} exists; not overwriting (give a new name)")
        _check_out_dir(path.parent, command, path)
        return None, path
    if path.exists() and not path.is_dir():
        raise UsageError(f"{command}: --out {path} is a file, not a directory "
                         "(give a directory, or a new file name ending in .tar.gz)")
    if not path.exists() and path.suffix.lower() in (".zip", ".tar", ".gz", ".tgz", ".bz2", ".xz", ".zst", ".7z"):
        raise UsageError(f"{command}: --out {path}: archives are gzip tarballs, so the name must end in .tar.gz")
    _check_out_dir(path, command, path)
    return path, None


def _check_out_dir(directory: Path, command: str, given: Path) -> None:
    """Refuse, naming the user's ``--out``, a directory that cannot be written or made."""
    existing = next(p for p in (directory, *directory.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        raise UsageError(f"{command}: --out {given}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write in" if existing == directory else "create a directory in"
        raise UsageError(f"{command}: --out {given}: cannot {what} {existing} (permission denied); "
                         "give a directory you can write")


def _make_out_dir(directory: Path, command: str, given: str) -> None:
    """Make a missing ``--out`` directory with its parents (and say so on stderr)."""
    if directory.is_dir():
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{command}: --out {given}: cannot create {directory}: {exc.strerror or exc}") from None
    _err().print(f"mlxwatch: {command}: created {directory}", markup=False)


def _unwritable(exc: OSError, directory: Path, command: str, given: str | None) -> UsageError | None:
    """An ``OSError`` from writing in ``directory`` as the user's problem: their ``--out`` (or
    capture.dir) named, not the hidden ``.partial`` path the writer was making. None: another file."""
    where = Path(exc.filename) if exc.filename else None
    if where is None or not (where == directory or directory in where.parents):
        return None
    why = exc.strerror or str(exc)
    if given is not None:
        return UsageError(f"{command}: --out {given}: cannot write there: {why}; give a directory you can write")
    return UsageError(f"{command}: cannot write a bundle in {directory}: {why} "
                      "(set capture.dir in the config, or give --out DIR)")


def _url_arg(command: str, text: str, field: str = "--url") -> str:
    from mlxwatch.config import parse_base_url  # the same URL rule as the config file

    try:
        return parse_base_url(text)
    except ValueError as exc:
        raise UsageError(f"{command}: {field + ' ' if field else ''}{exc} (got {text!r})") from None


def cmd_config(args: argparse.Namespace, out: Console) -> int:
    return {"validate": cmd_config_validate, "init": cmd_config_init,
            "example": cmd_config_example}[args.config_command](args, out)


def cmd_config_validate(args: argparse.Namespace, out: Console) -> int:
    config = load_runnable_config(resolve_config_path(args.path or args.config))  # what `run` accepts, no more
    if args.json:
        from dataclasses import asdict

        data = {"path": str(config.path), "valid": True, **{k: v for k, v in asdict(config).items() if k != "path"}}
        print(json.dumps(data, indent=2, default=str))
        return EXIT_OK
    out.print(f"{config.path}: ok, {len(config.instances)} instance(s)", markup=False, highlight=False)
    for inst in config.instances:
        p, r = inst.probe, inst.restart
        out.print(
            f"  {inst.name}: {inst.url} probe every {p.interval:g}s, first token {p.first_token_timeout:g}s, "
            f"total {p.timeout:g}s, verdict after {p.failures} failures; restart {r.method} {r.target or ' '.join(r.argv)}".rstrip(),
            markup=False, highlight=False,
        )
    return EXIT_OK


def cmd_config_init(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.host.discover import find_servers, starter_config
    from mlxwatch.storage import write_new

    path = Path(args.out).expanduser() if args.out else resolve_config_path(args.config)
    if not args.print_only and path.exists():
        raise UsageError(f"config init: {path} exists; not overwriting (`mlxwatch config validate {path}` checks it; "
                         "--out FILE writes elsewhere, --print shows the new one)")
    if not args.print_only and args.out and not path.parent.is_dir():
        raise UsageError(f"config init: --out {path}: no such directory {path.parent} (create it first)")
    servers = find_servers()
    if not servers:
        _err().print("mlxwatch: config init: no mlx-lm server is running, so there is nothing to watch yet "
                     "(start your server first, or start from `mlxwatch config example`)", markup=False)
        return EXIT_UNHEALTHY
    text = starter_config(servers)
    if args.print_only:
        sys.stdout.write(text)
        return EXIT_OK
    created = not path.parent.exists()
    path.parent.mkdir(parents=True, exist_ok=True)  # the default ~/.config/mlxwatch is normally missing
    try:
        write_new(path, text.encode())
    except FileExistsError:
        raise UsageError(f"config init: {path} exists; not overwriting") from None
    out.print(f"wrote {path}" + (f" (created {path.parent})" if created else "") + f": {len(servers)} instance(s)",
              markup=False, highlight=False)
    for s in servers:
        restart = (f"launchd {s.launchd_label}" if s.launchd_label else f"systemd {s.systemd_unit}"
                   if s.systemd_unit else "none (edit restart:)")
        out.print(f"  {s.name}: {s.url} (PID {s.pid}); log {s.log or 'not found'}; restart {restart}",
                  markup=False, highlight=False)
    hint = f" --config {path}" if args.out else ""
    out.print(f"next: `mlxwatch{hint} doctor`, then `mlxwatch{hint} run`", markup=False, highlight=False)
    return EXIT_OK


def cmd_config_example(args: argparse.Namespace, out: Console) -> int:
    from importlib import resources

    sys.stdout.write(resources.files("mlxwatch").joinpath("data/mlxwatch.example.yaml").read_text(encoding="utf-8"))
    return EXIT_OK


def _check_target(args: argparse.Namespace) -> tuple[str, ProbeConfig]:
    if args.instance and args.url:
        raise UsageError("check: give a URL or --instance, not both")
    if args.instance:
        inst: InstanceConfig = _load(args).instance(args.instance)
        return inst.url, inst.probe
    if not args.url:
        raise UsageError("check: give a URL (e.g. http://127.0.0.1:8080) or --instance NAME")
    return _url_arg("check", args.url, ""), ProbeConfig()


def cmd_check(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.output.reports import render_check
    from mlxwatch.probes import make_client, run_check

    url, probe = _check_target(args)
    timeout = args.timeout or probe.timeout
    first = args.first_token_timeout or min(probe.first_token_timeout, timeout)
    if first > timeout:
        raise UsageError(f"check: --first-token-timeout ({first:g}s) exceeds --timeout ({timeout:g}s)")
    max_tokens = args.max_tokens or probe.max_tokens
    err = _err()

    async def go():
        async with make_client() as client:
            loop = asyncio.get_running_loop()
            started, probes, said = loop.time(), 0, None
            while True:
                began = loop.time()
                probes += 1
                report = await run_check(
                    client, url, first_token_timeout=first, timeout=timeout,
                    max_tokens=max_tokens, endpoint_timeout=min(probe.endpoint_timeout, timeout),
                )
                waited = loop.time() - started
                if report.healthy or args.wait is None or waited >= args.wait:
                    return report, waited, probes
                if report.reason != said:  # one line per change, not one per probe
                    said = report.reason
                    err.print(f"waiting for {url} ({format_duration(waited)} of {format_duration(args.wait)}): "
                              f"{report.reason}", markup=False)
                pause = min(1.0 - (loop.time() - began), args.wait - waited)  # quick failures: once a second
                if pause > 0:
                    await asyncio.sleep(pause)

    report, waited, probes = asyncio.run(go())
    if args.json:
        data = report.to_dict()
        if args.wait is not None:
            data["waited"] = {"seconds": round(waited, 3), "probes": probes}
        print(json.dumps(data, indent=2))
    else:
        render_check(report, out, waited=(waited, probes) if args.wait is not None else None)
    return EXIT_OK if report.healthy else EXIT_UNHEALTHY


def _lookup(inst: InstanceConfig):
    from mlxwatch.host.process import lookup_instance

    return lookup_instance(inst)


def _listening_url(pid: int, cmdline: tuple[str, ...]) -> str | None:
    """Where a server process listens, as a URL a local client would use (None: nowhere yet)."""
    from mlxwatch.host.discover import _url
    from mlxwatch.host.process import own_listeners, server_port

    listeners = own_listeners(pid)
    if not listeners:
        return None
    wanted = server_port(cmdline)
    return _url([a for a in listeners if a[1] == wanted] or listeners)


def _not_the_server(pid: int, cmdline: tuple[str, ...], url: str | None, inst: InstanceConfig | None) -> str | None:
    """Why ``pid`` is not the mlx-lm server at ``url`` (proven as the daemon proves it), or None."""
    from mlxwatch.host.process import is_mlx_server, lookup_server, short_cmdline

    if url is None:
        if is_mlx_server(cmdline):
            return None
        return f"PID {pid} is not an mlx-lm server ({short_cmdline(cmdline)})"
    found = _lookup(inst) if inst is not None and inst.url == url else lookup_server(url)
    if found.identity is not None and found.identity.pid == pid:
        return None
    what = f"PID {pid} ({short_cmdline(cmdline)}) is not the mlx-lm server listening at {url}"
    if found.identity is not None:
        return f"{what}: that is {found.identity.describe()}"
    return f"{what}: {found.stranger or found.detail or 'nothing listens there'}"


def _instance_at(config: Config, pid: int, url: str | None) -> tuple[InstanceConfig | None, Path | None]:
    """The configured instance whose server ``pid`` is, and the log its lookup found (a launchd
    job's): the instance at ``url`` when given, else the one at an address ``pid`` listens on,
    proven as the daemon proves its server. (None, None): no instance is this process's."""
    from mlxwatch.host.process import own_listeners, url_port

    if url is not None:
        return next((i for i in config.instances if i.url == url), None), None
    ports = {port for _, port in own_listeners(pid)}
    for inst in config.instances:
        if url_port(inst.url) in ports:
            found = _lookup(inst)
            if found.identity is not None and found.identity.pid == pid:
                return inst, found.log
    return None, None


def cmd_capture(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.capture import CaptureRequest, capture_bundle, capture_probe_timeouts, export_bundle
    from mlxwatch.host.process import ProcessIdentity
    from mlxwatch.output.reports import CaptureProgress, render_capture

    config = _load_optional(args)
    inst = config.instance(args.instance) if args.instance else None
    url = _url_arg("capture", args.url) if args.url else inst.url if inst else None
    given_log = _log_arg(args.log) if args.log else None
    out_dir, archive = _out_target(args.out, "capture") if args.out else (None, None)
    err = _err()
    if args.pid is None:
        if inst is None:
            raise UsageError("capture: give the server's PID, or --instance NAME to capture the server of a "
                             "config instance")
        found = _lookup(inst)
        if found.identity is None:
            raise ProcessGoneError(f"capture: no mlx-lm server proven for {inst.name} at {inst.url}: {found.detail} "
                                   "(give its PID to capture another process, with --force)")
        pid, found_log, problem = found.identity.pid, found.log, None
    else:
        ident = ProcessIdentity.of(args.pid)  # a PID that does not exist: one line, exit 1
        pid, found_log = ident.pid, None
        if inst is None:  # the config's instance at this PID's address (or --url): its name, log, probe
            inst, found_log = _instance_at(config, pid, url)
            if inst is not None:
                err.print(f"mlxwatch: capture: PID {pid} is {inst.name} in {config.path}: its URL, log and "
                          "probe settings are used", markup=False)
                url = url or inst.url
        problem = _not_the_server(pid, ident.cmdline, url, inst)
        if problem and not args.force:
            raise UsageError(f"capture: {problem}; check the PID{' and the URL' if url else ''}, "
                             "or add --force to capture it anyway")
        if problem:
            err.print(f"mlxwatch: capture --force: {problem}; capturing it anyway", markup=False)
            if not args.instance:  # the instance at that URL is not this process: none of its settings
                inst, found_log = None, None
        if url is None and not problem:
            url = _listening_url(pid, ident.cmdline)
            if url:
                err.print(f"mlxwatch: capture: probing {url}, where PID {pid} listens", markup=False)
    label = inst.name if inst is not None and not problem else None
    log = given_log or (inst.log if inst else None) or found_log
    cap = config.capture
    probe = inst.probe if inst is not None else ProbeConfig()
    target_dir = out_dir or bundles_dir(config)
    if args.out:
        _make_out_dir(archive.parent if archive else target_dir, "capture", args.out)
    request = CaptureRequest(
        pid=pid, out_dir=target_dir, label=label, url=url, log=log,
        snapshots=args.snapshots or cap.snapshots, spacing=args.spacing or cap.spacing,
        ceiling=args.ceiling or cap.ceiling, sudo=cap.sudo, log_tail_lines=cap.log_tail_lines,
        keep=cap.keep, max_bytes=cap.max_bytes, keep_days=cap.keep_days, min_free_bytes=cap.min_free_bytes,
        stacks=args.stacks or cap.stacks, redact=cap.redact,
        **capture_probe_timeouts(probe),
    )
    try:
        if args.json:
            bundle = asyncio.run(capture_bundle(request))
        else:
            with CaptureProgress(out) as progress:
                bundle = asyncio.run(capture_bundle(request, on_step=progress.update))
                progress.finish(bundle.manifest.get("steps") or [])
        written = export_bundle(bundle.path, archive) if archive else None
    except OSError as exc:  # the bundle (or archive) could not be written where the user asked
        places = [(target_dir, args.out if out_dir else None)] + ([(archive.parent, args.out)] if archive else [])
        refusal = next(filter(None, (_unwritable(exc, d, "capture", given) for d, given in places)), None)
        if refusal is None:
            raise
        raise refusal from None
    hint = _stacks_hint(bundle.manifest, cap.sudo)
    if args.json:
        print(json.dumps({"path": str(bundle.path), "archive": str(written) if written else None,
                          **bundle.manifest}, indent=2, default=str))
    else:
        render_capture(bundle.classification, bundle.path, written, out)
    if hint:
        err.print(f"mlxwatch: capture: no Python stacks: {hint}", markup=False)
    return EXIT_OK


def _stacks_hint(manifest: dict[str, Any], sudo: bool) -> str | None:
    """What to do when py-spy was refused the server (ptrace rights, root on macOS)."""
    from mlxwatch.doctor import pyspy_hint, read_ptrace_scope

    step = next((s for s in manifest.get("steps") or [] if s.get("name") == "stacks"), None)
    if not step or not step.get("error"):
        return None
    return pyspy_hint(step["error"], sys.platform, os.geteuid(), sudo, read_ptrace_scope())


def _log_arg(text: str) -> Path:
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


def _find_bundle(text: str, args: argparse.Namespace, command: str) -> Path:
    """A bundle directory or archive given by path, or by name inside the bundles dir."""
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text and "/" not in text and text not in (".", ".."):
        candidate = bundles_dir(_load_optional(args)) / text
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
    from mlxwatch.output.reports import render_bundle_list

    root = Path(args.dir).expanduser() if args.dir else bundles_dir(_load_optional(args))
    if args.dir and not root.is_dir():
        raise UsageError(f"bundle list: --dir {root}: no such directory")
    entries = [e for e in bundle_entries(root) if not args.instance or e["instance"] == args.instance]
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
    from mlxwatch.errors import BundleError

    path = _find_bundle(args.bundle, args, "export")
    if not path.is_dir():
        raise BundleError(f"bundle export: {path} is not a bundle directory")
    out_dir, archive = _out_target(args.out, "bundle export") if args.out else (None, None)
    target_dir = archive.parent if archive else out_dir
    if target_dir is not None and not (target_dir.resolve() == path.resolve() or path.resolve() in target_dir.resolve().parents):
        _make_out_dir(target_dir, "bundle export", args.out)  # (inside the bundle: export_bundle refuses it)
    skipped: list[str] = []
    try:
        written = export_bundle(path, archive or out_dir, redact=args.redact, on_skip=skipped.append)
    except FileExistsError as exc:
        raise UsageError(f"bundle export: {exc} (give --out a new name or another directory)") from None
    except OSError as exc:
        refusal = _unwritable(exc, target_dir, "bundle export", args.out) if target_dir is not None else None
        if refusal is None:
            raise
        raise refusal from None
    if skipped:
        _err().print(f"mlxwatch: bundle export: {len(skipped)} file(s) listed in the manifest are missing from "
                     f"the bundle and were left out: {', '.join(skipped[:5])}", markup=False)
    print(written)
    _err().print("mlxwatch: bundle export: " + (
        "redacted for sharing (secrets, environment values, prompts and message texts, home paths removed; "
        "--no-redact exports the bundle as captured)" if args.redact else
        "NOT redacted (--no-redact): it holds what the capture read; keep it private"), markup=False)
    return EXIT_OK


def _state_dir(config: Config, override: str | None) -> Path:
    return state_dir_for(config, Path(override).expanduser() if override else None)


class _HeldSignals:
    """SIGTERM, SIGINT and SIGHUP that arrive while ``run`` starts, before its event loop takes
    them, are remembered, not acted on: SIGHUP's default action would kill the daemon (exit
    129), SIGTERM's would skip its clean stop. The handlers only append; ``go`` replays them."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.arrived: list[int] = []
        self.previous = {signum: signal.signal(signum, self._remember) for signum in self.SIGNALS}

    def _remember(self, signum: int, frame: object) -> None:
        self.arrived.append(signum)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def cmd_run(args: argparse.Namespace, out: Console) -> int:
    held = _HeldSignals()  # first: the imports and the config read below can take seconds on a busy Mac
    try:
        return _run_daemon(args, held)
    finally:
        held.restore()


def _run_daemon(args: argparse.Namespace, held: _HeldSignals) -> int:
    import logging

    from mlxwatch.daemon.selflog import RotatingStderr
    from mlxwatch.daemon.supervisor import Daemon

    path = resolve_config_path(args.config)
    if not path.exists() and not _explicit_config(args):
        raise UsageError(f"no config at {path}: nothing to watch. Write one with `mlxwatch config init` "
                         "(finds running mlx-lm servers) or see `mlxwatch config example`; "
                         "`mlxwatch demo` shows the watchdog work on a tiny local server")
    config = load_runnable_config(path)
    handler = RotatingStderr()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler], force=True)
    if args.log_level != "DEBUG":  # httpx logs every request at INFO: three lines per probe, not events
        for noisy in ("httpx", "httpcore"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    daemon = Daemon(config, _state_dir(config, args.state_dir))

    async def go() -> None:
        loop = asyncio.get_running_loop()
        stop, reload = asyncio.Event(), asyncio.Event()
        for signum in held.SIGNALS:  # the loop takes them from here on
            loop.add_signal_handler(signum, (reload if signum == signal.SIGHUP else stop).set)
        log = logging.getLogger("mlxwatch.watchdog")
        for signum in dict.fromkeys(held.arrived):
            if signum == signal.SIGHUP:
                log.info("SIGHUP arrived while starting: the config is read again once the daemon is ready")
                reload.set()
            else:
                log.info("%s arrived while starting: stopping before the daemon starts", signal.Signals(signum).name)
                stop.set()
        if stop.is_set():
            return
        announce = asyncio.create_task(_announce_watch(daemon, config, logging.getLogger("mlxwatch.run")))
        try:
            await daemon.run(stop, reload, load_config=lambda: load_runnable_config(path))
        finally:
            announce.cancel()

    asyncio.run(go())
    return EXIT_OK


async def _announce_watch(daemon: Any, config: Config, log: Any) -> None:
    """One INFO line per fact a first run would otherwise wait minutes to learn (reports.watch_plan),
    said once the daemon holds its state dir and has started its watchers (before their first
    probe, which comes 0-5 s later): a daemon refused at start still says one line only."""
    from mlxwatch.output.reports import watch_plan

    while not daemon.tasks:
        await asyncio.sleep(0.05)
    for line in await asyncio.to_thread(watch_plan, config.instances, _lookup, time.time()):
        log.info("%s", line)


def cmd_status(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.daemon.status import (
        collect_status,
        render_status,
        status_exit_code,
        status_lines,
    )

    if args.count is not None and args.watch is None:
        raise UsageError("status: --count needs --watch")
    config = _load_optional(args)
    state_dir = _state_dir(config, args.state_dir)

    def once() -> tuple[dict, int]:
        status = collect_status(config, state_dir)
        return status, status_exit_code(status)

    if args.watch is None:
        status, code = once()
        if args.json:
            print(json.dumps({**status, "exit_code": code}, indent=2, default=str))
        else:
            render_status(status, out)
        return code
    code, shown = EXIT_UNHEALTHY, 0
    live = None
    if not args.json and out.is_terminal:
        from rich.console import Group
        from rich.live import Live
        from rich.text import Text

        live = Live(console=out, auto_refresh=False, transient=False)
        live.start()
    try:
        while True:
            status, code = once()
            shown += 1
            if args.json:
                print(json.dumps({**status, "exit_code": code}, default=str), flush=True)
            elif live is not None:
                stamp = time.strftime("%H:%M:%S")
                lines = status_lines(status, out.width)
                live.update(Group(Text(f"every {format_duration(args.watch)}, at {stamp} (Ctrl-C stops)"), *lines),
                            refresh=True)
            else:
                if shown > 1:
                    out.print()
                out.print(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}", markup=False, highlight=False)
                render_status(status, out)
                out.file.flush()
            if args.count is not None and shown >= args.count:
                return code
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return code  # the last status's code: a watch stopped by hand still says how things were
    finally:
        if live is not None:
            live.stop()


def cmd_resume(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.journal.lock import lock_holder
    from mlxwatch.journal.state import load_state, request_resume

    path = resolve_config_path(args.config)
    if not _explicit_config(args) and not path.exists():
        raise UsageError(f"resume: no config at {path}, so no instance is known; give --config FILE "
                         "(the config the daemon runs with)")
    config = load_config(path)
    inst = config.instance(args.name)  # an unknown name is a config error, not a silent no-op
    state_dir = _state_dir(config, args.state_dir)
    saved, _ = load_state(state_dir)
    record = saved.get("instances", {}).get(inst.name, {})
    state = record.get("state") if isinstance(record.get("state"), str) else None
    holder = lock_holder(state_dir)
    request = request_resume(state_dir, inst.name)
    if args.json:
        print(json.dumps({"instance": inst.name, "request": str(request), "state": state,
                          "daemon_running": holder is not None, "state_dir": str(state_dir)}, indent=2))
        return EXIT_OK
    when = ("the daemon applies it at its next probe" if holder is not None else
            f"no daemon runs on {state_dir} now: the next one applies it when it starts")
    out.print(f"resume requested for {inst.name} ({request}); {when}", markup=False, highlight=False)
    if state != "gave_up":
        out.print(f"note: {inst.name} is not given up (state {state or 'not recorded yet'}); resuming only clears its "
                  "restart history", markup=False, highlight=False)
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.doctor import diagnose, exit_code, render_findings

    path = resolve_config_path(args.config)
    config, problem = None, None
    if _explicit_config(args) or path.exists():
        try:
            config = load_config(path)
        except ConfigError as exc:
            problem = str(exc)
    if args.instance and config is not None:
        config.instance(args.instance)  # an unknown name: one line, exit 2
    state_dir = _state_dir(config or Config(), args.state_dir)
    bundles = bundles_dir_for(config, state_dir) if config is not None else None
    findings = asyncio.run(diagnose(config, path, problem, state_dir, bundles, only=args.instance))
    if args.json:
        print(json.dumps({"ok": exit_code(findings) == 0, "config": str(path), "state_dir": str(state_dir),
                          "findings": [f.to_dict() for f in findings]}, indent=2))
    else:
        render_findings(findings, out, path, state_dir)
    return exit_code(findings)


def cmd_launchd(args: argparse.Namespace, out: Console) -> int:
    from mlxwatch.daemon import agent as launchd

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
    if args.launchd_command == "plist":  # an agent whose config `run` refuses would exit 2 every ThrottleInterval
        load_runnable_config(config)
        sys.stdout.write(launchd.render(config.resolve(), label).decode())
        return EXIT_OK
    done = launchd.install(config, label, force=args.force, validate=load_runnable_config)
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
    from mlxwatch.shim.launcher import launch

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
    "config": cmd_config,
    "check": cmd_check,
    "capture": cmd_capture,
    "bundle": cmd_bundle,
    "run": cmd_run,
    "status": cmd_status,
    "resume": cmd_resume,
    "doctor": cmd_doctor,
    "demo": cmd_demo,
    "launchd": cmd_launchd,
    "launch": cmd_launch,
}


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run(argv))


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command that was run: follow each subparsers action's choice."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if chosen not in (sub.choices if sub is not None else {}):
            return parser
        parser = sub.choices[chosen]


def _silence_stdout() -> None:
    """The reader of stdout went away (`| head`): later writes, and the interpreter's own flush
    at exit, go to /dev/null instead of raising BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a captured or closed stdout
        pass


def _options_with_values(parser: argparse.ArgumentParser) -> set[str]:
    """Every ``--option`` of every (sub)command that takes a value."""
    found = {o for a in parser._actions if a.nargs != 0 for o in a.option_strings if o.startswith("--")}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options_with_values(sub)
    return found


def _attach_negative_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``--timeout -5s`` read as ``--timeout=-5s``: argparse takes a word that starts with ``-``
    (other than a plain negative number) for an option and would say "expected one argument"
    instead of why -5s is refused. Nothing after ``--`` or ``launch`` (a server's command) changes."""
    takes_value, words, out = _options_with_values(parser), list(argv), []
    while words:
        word = words.pop(0)
        if word in ("--", "launch"):
            return [*out, word, *words]
        if word in takes_value and words and words[0][:1] == "-" and words[0][1:2].isdigit():
            word = f"{word}={words.pop(0)}"
        out.append(word)
    return out


def _refuse_empty_config(args: argparse.Namespace) -> None:
    """``--config ""`` (an unset shell variable, often) must not fall back to the default file."""
    for dest in ("config", "launchd_config"):
        if getattr(args, dest, None) == "":
            raise UsageError(f"--config is empty: give a config file, or leave --config out (then {CONFIG_DEFAULT})")


def run(argv: Sequence[str] | None = None, out: Console | None = None) -> int:
    """Run one command and return its exit code (tests call this directly)."""
    out = out or Console(highlight=False, soft_wrap=True)
    err = _err()
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(_attach_negative_values(parser, sys.argv[1:] if argv is None else argv))
        if extra:  # reported by the subcommand that was given them, so its --help is the one named
            _leaf_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
        _refuse_empty_config(args)
        return COMMANDS[args.command](args, out)
    except (ConfigError, UsageError, StateError) as exc:
        err.print(f"mlxwatch: {exc}", markup=False)
        return EXIT_USAGE
    except ProcessGoneError as exc:
        err.print(f"mlxwatch: {exc}", markup=False)
        return EXIT_UNHEALTHY
    except MlxwatchError as exc:
        from mlxwatch.errors import BundleError

        err.print(f"mlxwatch: {exc}", markup=False)
        return EXIT_USAGE if isinstance(exc, BundleError) else EXIT_UNHEALTHY
    except KeyboardInterrupt:
        err.print("mlxwatch: interrupted")
        return 130
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_PIPE
    except OSError as exc:  # a file or directory the command needed: named, one line
        where = f"{exc.filename}: " if exc.filename else ""
        err.print(f"mlxwatch: {where}{exc.strerror or exc}", markup=False)
        return EXIT_UNHEALTHY
    except Exception as exc:  # a bug: still one line; the traceback on request
        if os.environ.get(DEBUG_ENV):
            raise
        err.print(f"mlxwatch: internal error: {type(exc).__name__}: {exc} "
                  f"(please report it; {DEBUG_ENV}=1 shows the traceback)", markup=False)
        return EXIT_UNHEALTHY
