"""The systemd user unit the README installs on Linux: its ExecStart is a command line the CLI
accepts (`mlxwatch --config FILE run`), its reload is the SIGHUP the daemon handles, and a config
error (exit 2, documented) is not restarted in a loop.

systemd.service(5): ``ExecReload=`` "commands to execute to trigger a configuration reload";
``RestartPreventExitStatus=`` exit statuses that "will not result in automatic service
restarting"; ``%h`` is the user's home directory (systemd.unit(5), "Specifiers").
"""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

from mlxwatch.cli.parser import build_parser

UNIT = Path(__file__).resolve().parent.parent / "systemd" / "mlxwatch.service"


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def test_execstart_is_a_run_command_the_cli_accepts():
    argv = shlex.split(_unit()["Service"]["ExecStart"])
    assert Path(argv[0]).name == "mlxwatch"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "run"
    assert args.config.endswith("config.yaml")


def test_reload_is_sighup_and_config_errors_are_not_looped():
    service = _unit()["Service"]
    assert service["ExecReload"].split() == ["/bin/kill", "-HUP", "$MAINPID"]
    assert "2" in service["RestartPreventExitStatus"].split()
    assert service["Restart"] == "on-failure"
    assert _unit()["Install"]["WantedBy"] == "default.target"  # a user unit, started at login
