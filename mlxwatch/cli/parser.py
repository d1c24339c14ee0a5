"""The ``mlxwatch`` argument parser: commands, options, and the one-line refusal of a bad one.

Defaults shown by ``--help`` are read from the config dataclasses (``ProbeConfig``,
``CaptureConfig``), never retyped. A bad argument raises ``UsageError`` (one line, exit 2)::

    parser = build_parser()
    args = parse(parser, ["check", "http://127.0.0.1:8080", "--timeout", "30s"])
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn, Sequence

from mlxwatch import __version__
from mlxwatch.config import MAX_COUNT, STACK_SOURCES, CaptureConfig, FrontConfig, ProbeConfig, parse_size
from mlxwatch.durations import DURATION_FORM, NOT_A_DURATION, human_duration, parse_duration
from mlxwatch.errors import UsageError
from mlxwatch.replay.options import Budget, ReplayOptions

_PROBE, _CAPTURE = ProbeConfig(), CaptureConfig()  # the one source of every default shown in --help
_REPLAY, _BUDGET = ReplayOptions(), Budget()  # mlxwatch replay's (they start from the config's)

help_duration = human_duration  # a default in --help, as a config file would say it

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


def _size_arg(text: str) -> int:
    """A positive size, in the config file's words (``256MiB``)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (got {text!r})") from None


def _count_arg(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number: {text!r}") from None
    if not 0 < value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to {MAX_COUNT}: {text!r}")
    return value


MIN_SPEED = 0.001  # a thousandth: 10 minutes of recorded gaps take a week


def _speed_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number from 0.001 to 1000, such as 2 or 0.5 (got {text!r})") from None
    if not MIN_SPEED <= value <= 1000:  # 1e-300 made every gap centuries: the replay slept for ever
        raise argparse.ArgumentTypeError(f"must be a number from 0.001 to 1000 (got {text!r})")
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
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other bad input
        where = self.prog.removeprefix("mlxwatch").strip()
        sub = next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None and "the following arguments are required" in message:
            kind = "a subcommand" if where else "a command"
            message = f"give {kind}: {', '.join(sub.choices)}"
        raise UsageError(f"{where + ': ' if where else ''}{message} (see `{self.prog} --help`)")


class _OneWay(argparse.BooleanOptionalAction):
    """``--redact`` or ``--no-redact``, not both: with both, argparse let the last one win, and
    ``bundle export X --redact --no-redact`` wrote an unredacted archive, exit 0 (found by a new
    user). Giving the same form twice is harmless and allowed."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        seen = f"_given_{self.dest}"
        earlier = getattr(namespace, seen, None)
        value = not (option_string or "").startswith("--no-")
        if earlier is not None and earlier[1] != value:
            parser.error(f"{earlier[0]} and {option_string} contradict each other: give one of them")
        setattr(namespace, seen, (option_string, value))
        super().__call__(parser, namespace, values, option_string)


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
    d = help_duration
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
                     help="a directory to write the bundle in (created with its parents if missing), or a new "
                          "FILE.tar.gz to also write it as an archive (default: capture.dir, else "
                          "<state dir>/bundles)")
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
    export.add_argument("--redact", action=_OneWay, default=True,
                        help="remove secrets, message contents, environment values and home paths, for a public "
                             "issue (the default); --no-redact exports the bundle as captured (keep it private)")
    export.add_argument("--with-request-bodies", action="store_true",
                        help="also put in the front door's recorded request bodies (front.record), exact and not "
                             "redacted: the archive then holds users' words (left out by default)")
    export.add_argument("--out", metavar="DIR|FILE.tar.gz",
                        help="a directory (created with its parents if missing), or a new FILE.tar.gz "
                             "(default: beside the bundle)")

    rep = _leaf(sub, "replay", "send a bundle's recorded requests again and say whether the hang came back; "
                               "exit 0 it did, 1 it did not, 2 could not run")
    rep.add_argument("bundle", metavar="BUNDLE", help="a bundle directory holding recorded requests (front.record)")
    where = rep.add_mutually_exclusive_group()
    where.add_argument("--to", metavar="URL", help="the server to send them to, e.g. http://127.0.0.1:8090")
    where.add_argument("--launch", action="store_true",
                       help="start a server from the bundle's recorded command line on a free loopback port "
                            "(this environment inherited), replay, stop it")
    rep.add_argument("--allow-bundle-url", action="store_true",
                     help="allow --to to be the server the bundle came from, or the front door its clients used (refused by "
                          "default: it may hang that server again)")
    rep.add_argument("--speed", type=_speed_arg, metavar="X",
                     help=f"replay X times as fast: the gaps between requests divided by X (default {_REPLAY.speed:g})")
    rep.add_argument("--repeat", type=_count_arg, metavar="N",
                     help=f"send the whole sequence N times, each after the last ended, until a hang "
                          f"(default {_REPLAY.repeat})")
    rep.add_argument("--stall-timeout", type=_duration_arg, metavar="DURATION",
                     help=f"requests in flight and no token to anyone this long: the server is suspect, and a "
                          f"probe decides, as the daemon does behind a front door (default {d(_REPLAY.stall_timeout)}, "
                          "front.stall_timeout's)")
    rep.add_argument("--startup-timeout", type=_duration_arg, metavar="DURATION",
                     help=f"how long a launched server may take to answer (default {d(P.startup_timeout)})")
    rep.add_argument("--out", metavar="DIR",
                     help="where the replay's own bundle (and --shrink's) is written (default: beside BUNDLE)")
    rep.add_argument("--shrink", action="store_true",
                     help="find the fewest requests (and chat messages) that still hang a fresh server (ddmin; "
                          "one launched server per trial) and write them as a bundle")
    rep.add_argument("--max-trials", type=_count_arg, metavar="N",
                     help=f"--shrink: at most N trials (default {_BUDGET.trials})")
    rep.add_argument("--max-time", type=_duration_arg, metavar="DURATION",
                     help=f"--shrink: at most this long in all (default {d(_BUDGET.seconds)})")
    rep.add_argument("--json", action="store_true", help="print the result as JSON (no progress lines)")

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
    front = FrontConfig()
    launch.add_argument("--record", action="store_true",
                        help="keep the requests the server receives (exact bodies: users' words; off by default) "
                             "for bundles and `mlxwatch replay`, in the private runtime dir")
    launch.add_argument("--record-max-age", type=_duration_arg, metavar="DURATION",
                        help=f"--record: keep the last DURATION of requests (default {d(front.record_max_age)}, "
                             "front.record_max_age's)")
    launch.add_argument("--record-max-bytes", type=_size_arg, metavar="SIZE",
                        help=f"--record: at most SIZE of them on disk, the oldest go first (default "
                             f"{front.record_max_bytes // 1024**2}MiB, front.record_max_bytes's)")
    launch.add_argument("server_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                        help="the server command, unchanged")
    demo = _leaf(sub, "demo", "watch a tiny real mlx_lm.server through a livelock and its recovery")
    demo.add_argument("--keep", action="store_true", help="keep the demo's model and server log too")
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The arguments of one command line; anything left over is refused by the subcommand given it."""
    args, extra = parser.parse_known_args(_attach_negative_values(parser, argv))
    if extra:  # reported by the subcommand that was given them, so its --help is the one named
        _leaf_parser(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    _refuse_empty_paths(args)
    _refuse_two_configs(args)
    return args


def _refuse_two_configs(args: argparse.Namespace) -> None:
    """Two different config files for one command: one of them was silently ignored
    (`mlxwatch --config A config validate B` checked B; `config init --out B --config A` wrote B).
    ``launchd plist|install --config`` is another role (the agent's config) and may differ."""
    given = getattr(args, "config", None)
    cases = {"validate": ("path", "config validate: PATH"), "init": ("out", "config init: --out")}
    dest, name = cases.get(getattr(args, "config_command", None) or "", (None, ""))
    other = getattr(args, dest, None) if dest else None
    if given and other and Path(given).expanduser() != Path(other).expanduser():
        raise UsageError(f"{name} {other} and --config {given} name two config files: give one of them")


def _leaf_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command that was run: follow each subparsers action's choice."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if sub is None or chosen not in sub.choices:
            return parser
        parser = sub.choices[chosen]



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
    takes_value, words = _options_with_values(parser), list(argv)
    out: list[str] = []
    launching = False
    while words:
        word = words.pop(0)
        if word == "--" or (launching and not word.startswith("-")):  # the server's command begins
            return [*out, word, *words]
        launching = launching or word == "launch"
        if word in takes_value and words and words[0][:1] == "-" and words[0][1:2].isdigit():
            word = f"{word}={words.pop(0)}"
        elif launching and word in takes_value and words:  # its value, not the server's command
            out.append(word)
            word = words.pop(0)
        out.append(word)
    return out


def _refuse_empty_paths(args: argparse.Namespace) -> None:
    """An empty path (an unset shell variable, often) must not fall back to the default one:
    ``--config ""`` would read another config, ``--state-dir ""`` another journal, ``--out ""``
    write where the default puts it."""
    for dest in ("config", "launchd_config"):
        if getattr(args, dest, None) == "":
            raise UsageError(f"--config is empty: give a config file, or leave --config out (then {CONFIG_DEFAULT})")
    if getattr(args, "path", None) == "" and getattr(args, "config_command", None) == "validate":
        raise UsageError(f"config validate: PATH is empty: give a config file, or leave it out (then {CONFIG_DEFAULT})")
    for dest in ("state_dir", "dir", "out"):
        if getattr(args, dest, None) == "":
            option = "--" + dest.replace("_", "-")
            raise UsageError(f"{option} is empty: give a path, or leave {option} out for the default")
