"""Config loading: defaults, accepted forms, and one exact line for every kind of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxwatch.cli import run
from mlxwatch.config import load_config, resolve_config_path
from mlxwatch.errors import ConfigError

GOOD = """
instances:
  - name: gemma
    url: http://127.0.0.1:8082
    log: logs/gemma.log
    probe: {interval: 5m, first_token_timeout: 45s, timeout: 90, failures: 3}
    restart: {launchd: com.example.gemma}
  - name: qwen
    url: http://127.0.0.1:8080/
    restart: {command: ["/usr/local/bin/restart-qwen", "{pid}"], timeout: 30s}
"""


def test_valid_config_fills_defaults_and_parses_durations(config_file):
    """Durations take numbers and unit strings; relative paths are relative to the config file."""
    path = config_file(GOOD)
    cfg = load_config(path)
    gemma, qwen = cfg.instances
    assert gemma.probe.interval == 300.0
    assert gemma.probe.first_token_timeout == 45.0
    assert gemma.probe.timeout == 90.0
    assert gemma.probe.failures == 3
    assert gemma.probe.max_tokens == 4
    assert gemma.log == path.parent / "logs/gemma.log"
    assert gemma.restart.method == "launchd" and gemma.restart.target == "com.example.gemma"
    assert qwen.url == "http://127.0.0.1:8080"
    assert qwen.port == 8080
    assert qwen.restart.argv == ("/usr/local/bin/restart-qwen", "{pid}")
    assert qwen.restart.timeout == 30.0
    assert qwen.probe.interval == 30.0 and qwen.probe.suspect_interval == 10.0


def test_example_config_is_valid():
    """The commented example shipped in the repository loads as it is."""
    cfg = load_config(Path(__file__).parent.parent / "mlxwatch.example.yaml")
    assert [i.name for i in cfg.instances]


BAD = [
    # (yaml text, expected message after "<file>: ")
    ("instances: [{name: a, url: 'http://127.0.0.1:1', colour: red}]",
     "instances[0].colour: unknown key (got 'red')"),
    ("bogus: 1\ninstances: []", "bogus: unknown key (got 1)"),
    ("instances:\n  - {name: a, url: 'http://127.0.0.1:1'}\n  - {name: b, url: 'http://127.0.0.1:2', probe: {timeout: -5s}}",
     "instances[1].probe.timeout: must be a duration such as 30, 30s, 5m or 1h (got '-5s')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', probe: {interval: 0}}]",
     "instances[0].probe.interval: must be a positive duration (got 0)"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', probe: {timeout: -3}}]",
     "instances[0].probe.timeout: must be a positive duration (got -3)"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', probe: {interval: soon}}]",
     "instances[0].probe.interval: must be a duration such as 30, 30s, 5m or 1h (got 'soon')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', probe: {failures: two}}]",
     "instances[0].probe.failures: must be a whole number (got 'two')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', probe: {max_tokens: 0}}]",
     "instances[0].probe.max_tokens: must be a positive whole number (got 0)"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', probe: {first_token_timeout: 5m, timeout: 1m}}]",
     "instances[0].probe.first_token_timeout: must not exceed probe.timeout (60s) (got 300s)"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', probe: 5}]",
     "instances[0].probe: must be a mapping (got 5)"),
    ("instances:\n  - {name: a, url: 'http://127.0.0.1:1'}\n  - {name: a, url: 'http://127.0.0.1:2'}",
     "instances[1].name: duplicate name 'a' (also instances[0])"),
    ("instances: [{name: a, url: 'localhost:8080'}]",
     "instances[0].url: must be a URL such as http://127.0.0.1:8080 (got 'localhost:8080')"),
    ("instances: [{name: a, url: 'ftp://127.0.0.1:21'}]",
     "instances[0].url: must be a URL such as http://127.0.0.1:8080 (got 'ftp://127.0.0.1:21')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:99999'}]",
     "instances[0].url: must be a URL such as http://127.0.0.1:8080 (got 'http://127.0.0.1:99999')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:8080/v1'}]",
     "instances[0].url: must be the server's base URL, without a path (got 'http://127.0.0.1:8080/v1')"),
    ("instances: [{url: 'http://127.0.0.1:1'}]", "instances[0].name: is required"),
    ("instances: [{name: a}]", "instances[0].url: is required"),
    ("instances: [{name: 7, url: 'http://127.0.0.1:1'}]", "instances[0].name: must be a non-empty string (got 7)"),
    ("instances: {name: a}", "instances: must be a list (got {'name': 'a'})"),
    ("instances: [oops]", "instances[0]: must be a mapping (got 'oops')"),
    ("- just\n- a list", "(top level): must be a mapping (got ['just', 'a list'])"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x, systemd: y}}]",
     "instances[0].restart: must name exactly one method of launchd, systemd, command, signal, none (got ['launchd', 'systemd'])"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {command: 'restart.sh now'}}]",
     "instances[0].restart.command: must be a non-empty list of strings (an argv, run without a shell) (got 'restart.sh now')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x, domain: root}}]",
     "instances[0].restart.domain: must be one of gui, user, system (got 'root')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {signal: SIGUSR9}}]",
     "instances[0].restart.signal: must be true or one of SIGTERM, SIGINT, SIGKILL, SIGHUP, SIGQUIT (got 'SIGUSR9')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x, budget: -1}}]",
     "instances[0].restart.budget: must be a positive whole number (got -1)"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x, timeout: yes}}]",
     "instances[0].restart.timeout: must be a duration such as 30, 30s, 5m or 1h (got True)"),
    ("capture: {snapshots: 0}", "capture.snapshots: must be a positive whole number (got 0)"),
    ("capture: {max_bytes: lots}", "capture.max_bytes: must be a positive size such as 500MB or 2GB (got 'lots')"),
    ("notify: 'mail me'", "notify: must be a non-empty list of strings (an argv, run without a shell) (got 'mail me')"),
    ("instances: [{name: a\n  url: b", "invalid YAML at line 2, column 6: expected ',' or '}', but got ':'"),
]


@pytest.mark.parametrize("text, message", BAD, ids=[m.split(":")[0] + f"#{i}" for i, (_, m) in enumerate(BAD)])
def test_bad_config_names_file_key_path_and_value(config_file, text, message):
    """Each bad input raises one ConfigError line: '<file>: <key path>: <problem> (got <value>)'."""
    path = config_file(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: {message}"
    assert "\n" not in str(info.value)


def test_missing_file_is_one_line(tmp_path):
    """A config path that does not exist says so, naming the path."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: file not found"


def test_validate_command_exits_2_with_one_line_and_no_traceback(config_file, capsys):
    """`mlxwatch config validate` on a bad file: exit 2, exactly one stderr line, no traceback."""
    path = config_file("instances: [{name: a, url: 'http://127.0.0.1:1', probe: {timeout: -5s}}]")
    assert run(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"mlxwatch: {path}: instances[0].probe.timeout: must be a duration such as 30, 30s, 5m or 1h (got '-5s')"
    ]


def test_validate_command_accepts_good_file(config_file, capsys):
    """A valid file exits 0 and lists the instances it watches."""
    path = config_file(GOOD)
    assert run(["config", "validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "2 instance(s)" in out and "gemma: http://127.0.0.1:8082" in out


def test_config_path_resolution_order(monkeypatch, tmp_path):
    """--config wins, then $MLXWATCH_CONFIG, then ~/.config/mlxwatch/config.yaml."""
    monkeypatch.setenv("MLXWATCH_CONFIG", str(tmp_path / "env.yaml"))
    assert resolve_config_path(str(tmp_path / "flag.yaml")) == tmp_path / "flag.yaml"
    assert resolve_config_path(None) == tmp_path / "env.yaml"
    monkeypatch.delenv("MLXWATCH_CONFIG")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_config_path(None) == tmp_path / ".config/mlxwatch/config.yaml"


def test_check_instance_unknown_name_is_config_error(config_file, capsys):
    """`check --instance` with a name not in the config exits 2 naming the known ones."""
    path = config_file(GOOD)
    assert run(["--config", str(path), "check", "--instance", "mistral"]) == 2
    assert "no instance named 'mistral' (known: gemma, qwen)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["check"], "check: give a URL (e.g. http://127.0.0.1:8080) or --instance NAME"),
    (["check", "127.0.0.1:8080"], "check: must be a URL such as http://127.0.0.1:8080 (got '127.0.0.1:8080')"),
    (["check", "http://127.0.0.1:1", "--timeout", "soon"], "argument --timeout: not a duration: 'soon' (try 30, 30s, 5m)"),
    (["check", "http://127.0.0.1:1", "--timeout", "5", "--first-token-timeout", "10"],
     "check: --first-token-timeout (10s) exceeds --timeout (5s)"),
])
def test_check_usage_errors_exit_2(argv, message, capsys):
    """Bad command-line values: exit 2 and one line that names the value."""
    assert run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
