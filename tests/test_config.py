"""Config loading: defaults, accepted forms, and one exact line for every kind of bad input."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from mlxwatch.cli import run
from mlxwatch.config import (
    MAX_CONFIG_BYTES,
    CaptureConfig,
    ProbeConfig,
    RestartConfig,
    load_config,
    parse_config,
    resolve_config_path,
    same_address,
)
from mlxwatch.durations import parse_duration
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


FIELDS = "Its fields are {name}, {pid}, {url}, {bundle}, {launcher_pid}, {pids} and {hosts}"
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
    ("instances: [{name: a, url: 'http://u:secret@127.0.0.1:8080'}]",
     "instances[0].url: must not hold a user or password (mlx-lm has no authentication) "
     "(got 'http://…@127.0.0.1:8080')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:0'}]",
     "instances[0].url: must name a real port (not 0) (got 'http://127.0.0.1:0')"),
    ("instances: [{url: 'http://127.0.0.1:1'}]", "instances[0].name: is required"),
    ("instances: [{name: a}]", "instances[0].url: is required"),
    ("instances: [{name: 7, url: 'http://127.0.0.1:1'}]", "instances[0].name: must be a non-empty string (got 7)"),
    ("instances: {name: a}", "instances: must be a list (got {'name': 'a'})"),
    ("instances: [oops]", "instances[0]: must be a mapping (got 'oops')"),
    ("- just\n- a list", "(top level): must be a mapping (got ['just', 'a list'])"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x, systemd: y}}]",
     "instances[0].restart: must name exactly one method of launchd, systemd, command, signal, none"
     " (got ['launchd', 'systemd'])"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {command: 'restart.sh now'}}]",
     "instances[0].restart.command: must be a non-empty list of strings (an argv, run without a shell) (got 'restart.sh now')"),
    # YAML's own readings, said as YAML says them (found by a new user: "got datetime.date(2001,
    # 12, 14)", "got None", "got True" for a bare `on`)
    ("instances: [{name: a, url: 'http://127.0.0.1:1', probe: {interval: 2001-12-14}}]",
     "instances[0].probe.interval: must be a duration such as 30, 30s, 5m or 1h (got the date 2001-12-14)"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', kernel: null}]",
     "instances[0].kernel: must be one of auto, off (got null)"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', kernel: on}]",
     "instances[0].kernel: must be one of auto, off "
     "(got true: YAML reads a bare on, off, yes or no as true or false)"),
    # a field in the wrong case or misspelt: refused at load, not passed to the hook as written
    # at restart time (found by a new user: {launcherpid} and an unclosed {launcher_pid passed)
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {command: [kill, '{PID}']}}]",
     "instances[0].restart.command: argument 1 has {PID}, which mlxwatch does not fill: did you mean {pid}? "
     + FIELDS + " (got ['kill', '{PID}'])"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {command: [restart, '--server={Name}']}}]",
     "instances[0].restart.command: argument 1 has {Name}, which mlxwatch does not fill: did you mean {name}? "
     + FIELDS + " (got ['restart', '--server={Name}'])"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {command: [kill, '{launcherpid}']}}]",
     "instances[0].restart.command: argument 1 has {launcherpid}, which mlxwatch does not fill: did you mean "
     "{launcher_pid}? " + FIELDS + " (got ['kill', '{launcherpid}'])"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {command: [kill, '{launcher_pid']}}]",
     "instances[0].restart.command: argument 1 has {launcher_pid, which mlxwatch does not fill: did you mean "
     "{launcher_pid}? " + FIELDS + " (got ['kill', '{launcher_pid'])"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {command: [ssh, '{hots}']}}]",
     "instances[0].restart.command: argument 1 has {hots}, which mlxwatch does not fill: did you mean "
     "{hosts}? " + FIELDS + " (got ['ssh', '{hots}'])"),
    # the config's own directory: a log the daemon could never follow
    ("instances: [{name: a, url: 'http://127.0.0.1:1', log: .}]",
     "instances[0].log: is a directory; give the file the server writes its log to (got '.')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x, domain: root}}]",
     "instances[0].restart.domain: must be one of gui, user, system (got 'root')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {signal: SIGUSR9}}]",
     "instances[0].restart.signal: must be true or one of SIGTERM, SIGINT, SIGKILL, SIGHUP, SIGQUIT (got 'SIGUSR9')"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x, budget: -1}}]",
     "instances[0].restart.budget: must be a positive whole number (got -1)"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x, timeout: yes}}]",
     "instances[0].restart.timeout: must be a duration such as 30, 30s, 5m or 1h "
     "(got true: YAML reads a bare on, off, yes or no as true or false)"),
    ("capture: {snapshots: 0}", "capture.snapshots: must be a positive whole number (got 0)"),
    ("capture: {max_bytes: lots}", "capture.max_bytes: must be a positive size such as 500MB or 2GB (got 'lots')"),
    ("notify: 'mail me'", "notify: must be a non-empty list of strings (an argv, run without a shell) (got 'mail me')"),
    ("instances: [{name: a\n  url: b", "invalid YAML at line 2, column 6: expected ',' or '}', but got ':'"),
]

# Issue 11, "Bounded everything": inputs that used to load wrongly or end in a traceback.
A = "name: a, url: 'http://127.0.0.1:1'"
LAUGHS = "lol0: &lol0 lol\n" + "".join(
    f"lol{i}: &lol{i} [{', '.join([f'*lol{i - 1}'] * 10)}]\n" for i in range(1, 10)
)
BOUNDED = [
    # duplicate keys: PyYAML keeps the last one silently
    ("instances:\n  - name: a\n    url: http://127.0.0.1:1\n    probe:\n      interval: 5\n      interval: 6\n",
     "instances[0].probe.interval: duplicate key (lines 5 and 6)"),
    ("capture: {snapshots: 1}\ncapture: {snapshots: 2}\n", "capture: duplicate key (lines 1 and 2)"),
    ("capture: {keep: 1, keep: 2}", "capture.keep: duplicate key (twice on line 1)"),
    # aliases, nesting: billion laughs and friends
    (LAUGHS, "more than 10000 values with aliases expanded at line 5, column 7"),
    ("a: &a x\nb: [" + ", ".join(["*a"] * 101) + "]\n", "more than 100 YAML aliases at line 2, column 405"),
    ("a: &a [*a]\n", "YAML alias *a refers to a value that contains it at line 1, column 8"),
    ("a: " + "[" * 40 + "]" * 40, "nested deeper than 32 levels at line 1, column 35"),
    ("a: [" + "1, " * 20000 + "]", "more than 10000 values at line 1, column 29996"),
    # durations that are not numbers of seconds a timer can use
    (f"instances: [{{{A}, probe: {{interval: .nan}}}}]", "instances[0].probe.interval: must be a finite duration (got nan)"),
    (f"instances: [{{{A}, probe: {{timeout: .inf}}}}]", "instances[0].probe.timeout: must be a finite duration (got inf)"),
    (f"instances: [{{{A}, probe: {{timeout: -.inf}}}}]", "instances[0].probe.timeout: must be a finite duration (got -inf)"),
    (f"instances: [{{{A}, probe: {{interval: -0.0}}}}]", "instances[0].probe.interval: must be a positive duration (got -0.0)"),
    (f"instances: [{{{A}, probe: {{interval: 1.0e-9}}}}]", "instances[0].probe.interval: must be at least 1ms (got 1e-09)"),
    (f"instances: [{{{A}, restart: {{launchd: x, cooldown: 400d}}}}]",
     "instances[0].restart.cooldown: must be at most 365d (got '400d')"),
    (f"instances: [{{{A}, restart: {{launchd: x, window: 100000000000000000000}}}}]",
     "instances[0].restart.window: must be at most 365d (got 100000000000000000000)"),
    (f"instances: [{{{A}, probe: {{interval: {'9' * 400}}}}}]",
     "instances[0].probe.interval: must be at most 365d (got <a 1329-bit integer>)"),
    ("capture: {spacing: '" + "9" * 400 + "s'}", "capture.spacing: must be at most 365d (got '" + "9" * 56 + "...)"),
    # two instances, one server
    ("instances:\n  - {name: a, url: 'http://127.0.0.1:8080'}\n  - {name: b, url: 'http://localhost:8080/'}",
     "instances[1].url: same address as instances[0] ('a' at http://127.0.0.1:8080) (got 'http://localhost:8080')"),
    ("instances:\n  - {name: a, url: 'http://[0:0::1]:8080'}\n  - {name: b, url: 'http://LOCALHOST.:8080'}",
     "instances[1].url: same address as instances[0] ('a' at http://[0:0::1]:8080) (got 'http://LOCALHOST.:8080')"),
    ("instances:\n  - {name: a, url: 'http://10.0.0.5'}\n  - {name: b, url: 'http://10.0.0.6'}\n"
     "  - {name: c, url: 'http://10.0.0.5:80'}",
     "instances[2].url: same address as instances[0] ('a' at http://10.0.0.5) (got 'http://10.0.0.5:80')"),
    ("instances:\n  - {name: a, url: 'http://127.0.0.1:443'}\n  - {name: b, url: 'https://127.0.0.1'}",
     "instances[1].url: same address as instances[0] ('a' at http://127.0.0.1:443) (got 'https://127.0.0.1')"),
    # keys that are not strings, values YAML itself cannot build, numbers past any use
    ("1: x", "(top level): keys must be strings (got 1)"),
    (f"instances: [{{{A}, restart: {{1: a, launchd: b}}}}]", "instances[0].restart: keys must be strings (got 1)"),
    ('"a\\nb": 1', "'a\\nb': unknown key (got 1)"),
    ("capture: {snapshots: " + "9" * 5000 + "}",
     "invalid YAML at line 1, column 22: cannot read '" + "9" * 56 + "...: integer too long"),
    ("bogus: 2001-13-45",
     "invalid YAML at line 1, column 8: cannot read '2001-13-45': not a valid date (month must be in 1..12)"),
    ("a: \x00", "invalid YAML at line 1, column 4: special characters are not allowed (#x0000)"),
    ("a: 1\n---\nb: 2",
     "invalid YAML at line 2, column 1: expected a single document in the stream, but found another document"),
    ("a: &x 1\nb: &x 2", "invalid YAML at line 2, column 4: found duplicate anchor 'x'"),
    ("capture: {keep: 10000000}", "capture.keep: must be at most 1000000 (got 10000000)"),
    ("capture: {max_bytes: '1" + "0" * 400 + "gb'}",
     "capture.max_bytes: must be at most 1024GB (got '1" + "0" * 55 + "...)"),
    ("capture: {max_bytes: 2048GB}", "capture.max_bytes: must be at most 1024GB (got '2048GB')"),
    ("state_dir: '~mlxwatch-no-such-user/x'",
     "state_dir: names an unknown home directory (got '~mlxwatch-no-such-user/x')"),
    ('state_dir: "a\\0b"', "state_dir: must not contain control characters (got 'a\\x00b')"),
    ("instances: [{name: ../x, url: 'http://127.0.0.1:1'}]",
     "instances[0].name: must be letters, digits, '.', '_' or '-' (at most 64), starting with a letter or digit"
     " (got '../x')"),
    ('instances: [{name: a, url: "http://127.0.0.1:1\\n"}]',
     "instances[0].url: must not contain control characters (got 'http://127.0.0.1:1\\n')"),
    (f"instances: [{{{A}, probe: []}}]", "instances[0].probe: must be a mapping (got [])"),
    (f"instances: [{{{A}, restart: {{signal: 9}}}}]",
     "instances[0].restart.signal: must be true or one of SIGTERM, SIGINT, SIGKILL, SIGHUP, SIGQUIT (got 9)"),
]


@pytest.mark.parametrize("text, message", BAD + BOUNDED,
                         ids=[m.split(":")[0][:40] + f"#{i}" for i, (_, m) in enumerate(BAD + BOUNDED)])
def test_bad_config_names_file_key_path_and_value(config_file, text, message):
    """Each bad input raises one ConfigError line: '<file>: <key path>: <problem> (got <value>)'."""
    path = config_file(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: {message}"
    assert "\n" not in str(info.value)


def test_a_restart_commands_own_braces_pass_as_written(config_file):
    """The shell's ${VAR} (even ${PID}) and brace expansion, awk's {print}, JSON and a word like
    no field are the command's, not fields."""
    argv = ["sh", "-c", "launchctl kickstart -k gui/${UID}/x; kill ${PID} {pid}; echo {pid,pids}", "awk '{print}'",
            '{"a": {"b": 1}}', "{nope}"]
    cfg = load_config(config_file("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {command: %s}}]"
                                  % json.dumps(argv)))
    assert list(cfg.instances[0].restart.argv) == argv


def test_missing_file_is_one_line(tmp_path):
    """A config path that does not exist says so, naming the path."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}: file not found: write one with `mlxwatch config init --out {path}` "
                               "(finds running mlx-lm servers) or see `mlxwatch config example`")


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
    (["check", "http://127.0.0.1:1", "--timeout", "soon"],
     "argument --timeout: must be a duration such as 30, 30s, 5m or 1h (got 'soon')"),
    (["check", "http://127.0.0.1:1", "--timeout", "5", "--first-token-timeout", "10"],
     "check: --first-token-timeout (10s) exceeds --timeout (5s)"),
])
def test_check_usage_errors_exit_2(argv, message, capsys):
    """Bad command-line values: exit 2 and one line that names the value."""
    assert run(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def _validate(path: Path, capsys) -> list[str]:
    """`mlxwatch --config PATH config validate`: must exit 2; returns its stderr lines."""
    assert run(["--config", str(path), "config", "validate"]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err.strip().splitlines()


BAD_FILES = [
    # (how to make the file in tmp_path, or an existing path; expected message after "<path>: ")
    ("fifo", "not a regular file (a FIFO)"),
    ("/dev/zero", "not a regular file (a character device)"),
    ("directory", "not a regular file (a directory)"),
    ("2 MiB", f"too large (more than {MAX_CONFIG_BYTES} bytes)"),
    ("1 MiB + 1", f"too large (more than {MAX_CONFIG_BYTES} bytes)"),
    ("latin-1", "not UTF-8 text at byte 19"),
    ("utf-16", "not UTF-8 text at byte 0"),
    ("superscript", "capture.max_bytes: must be a positive size such as 500MB or 2GB (got '\u00b2gb')"),
]


def _make(kind: str, tmp_path: Path) -> Path:
    if kind.startswith("/"):
        return Path(kind)
    path = tmp_path / "config.yaml"
    if kind == "fifo":
        os.mkfifo(path)  # nobody ever writes to it: opening it for reading would wait forever
    elif kind == "directory":
        path.mkdir()
    elif kind == "2 MiB":
        path.write_bytes(b"# padding\n" * (2 * 1024 * 1024 // 10))
    elif kind == "1 MiB + 1":
        path.write_bytes(b"#" * MAX_CONFIG_BYTES + b"\n")
    elif kind == "latin-1":
        path.write_bytes("instances: []\n# caf\u00e9 au lait\n".encode("latin-1"))
    elif kind == "utf-16":
        path.write_bytes("instances: []\n".encode("utf-16"))
    elif kind == "superscript":
        path.write_bytes("capture: {max_bytes: \u00b2gb}\n".encode("utf-8"))
    return path


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kind, message", BAD_FILES, ids=[k for k, _ in BAD_FILES])
def test_bad_file_is_one_line_and_quick(tmp_path, capsys, kind, message):
    """Not a regular file, too big, not UTF-8: exit 2 with one line, at once (a FIFO never hangs)."""
    if kind == "/dev/zero" and not Path(kind).exists():
        pytest.skip("no /dev/zero")
    path = _make(kind, tmp_path)
    started = time.monotonic()
    assert _validate(path, capsys) == [f"mlxwatch: {path}: {message}"]
    assert time.monotonic() - started < 5


def test_file_of_exactly_the_limit_loads(tmp_path):
    """The size limit is inclusive: a file of MAX_CONFIG_BYTES (all comment) is an empty config."""
    path = tmp_path / "config.yaml"
    path.write_bytes(b"#" * (MAX_CONFIG_BYTES - 1) + b"\n")
    assert load_config(path).instances == ()


@pytest.mark.timeout(10)
def test_billion_laughs_is_refused_quickly(config_file, capsys):
    """Ten-fold aliases nine levels deep (90 aliases, under the alias limit) stop at the size limit."""
    path = config_file(LAUGHS + "bogus: *lol9\n")
    started = time.monotonic()
    assert _validate(path, capsys) == [
        f"mlxwatch: {path}: more than 10000 values with aliases expanded at line 5, column 7"
    ]
    assert time.monotonic() - started < 5


def test_aliases_within_the_limits_still_work(config_file):
    """Sharing a probe section through an anchor is what aliases are for; merge keys too."""
    cfg = load_config(config_file("""
instances:
  - {name: a, url: 'http://127.0.0.1:1', probe: &slow {interval: 5m, timeout: 2m}}
  - {name: b, url: 'http://127.0.0.1:2', probe: *slow}
  - {name: c, url: 'http://127.0.0.1:3', probe: {<<: *slow, interval: 1m}}
"""))
    assert [i.probe.interval for i in cfg.instances] == [300.0, 300.0, 60.0]
    assert {i.probe.timeout for i in cfg.instances} == {120.0}


@pytest.mark.parametrize("a, b, same", [
    ("http://127.0.0.1:8080", "http://localhost:8080", True),
    ("http://[::1]:8080", "http://localhost:8080", True),
    ("http://127.0.0.1:8080", "http://[::1]:8080", False),  # two sockets: IPv4 and IPv6 loopback
    ("http://127.0.0.1:8080", "http://127.0.0.1:8081", False),
    ("http://127.0.0.1:8080", "http://127.0.0.2:8080", False),
    ("http://[::ffff:127.0.0.1]:8080", "http://127.0.0.1:8080", True),
    ("http://host.example:80", "http://HOST.example.", True),
    ("http://host.example", "https://host.example", False),  # default ports 80 and 443
])
def test_same_address(a, b, same):
    """Host (normalised; localhost matches either loopback) and port; the scheme only sets the default port."""
    assert same_address(a, b) is same and same_address(b, a) is same


def test_ipv4_and_ipv6_loopback_on_one_port_are_two_instances(config_file):
    cfg = load_config(config_file(
        "instances:\n  - {name: a, url: 'http://127.0.0.1:8080'}\n  - {name: b, url: 'http://[::1]:8080'}"
    ))
    assert [i.name for i in cfg.instances] == ["a", "b"]


def _self_containing() -> list:
    loop: list = []
    loop.append(loop)
    return loop


def _laughs() -> list:
    value: list = ["lol"]
    for _ in range(40):
        value = [value] * 10
    return value


@pytest.mark.parametrize("data, message", [
    (_self_containing(), "(top level): must be a mapping (got [[[[[[[[[[[[[[[[[[[[[...]]]]]]]]]]]]]]]]]]]]])"),
    ({"bogus": _laughs()}, "bogus: unknown key (got [[[[[[[[[[[[[[[[[[[[[..., ..., ..., ..., ..., ..., ..., ....)"),
    ({"capture": {"max_bytes": 10**5000}}, "capture.max_bytes: must be at most 1024GB (got <a 16610-bit integer>)"),
    ({"capture": {"spacing": 10**5000}}, "capture.spacing: must be at most 365d (got <a 16610-bit integer>)"),
    ({"instances": [{"name": "a", "url": "http://127.0.0.1:1", "restart": {"signal": 10**5000}}]},
     "instances[0].restart.signal: must be true or one of SIGTERM, SIGINT, SIGKILL, SIGHUP, SIGQUIT"
     " (got <a 16610-bit integer>)"),
    ({(1, 2): 3}, "(top level): keys must be strings (got (1, 2))"),
], ids=["self-containing", "shared-refs", "huge-size", "huge-duration", "huge-signal", "tuple-key"])
def test_parse_config_on_garbage_objects_is_one_line(data, message):
    """parse_config is handed Python objects, not text: cycles, shared references, vast ints."""
    with pytest.raises(ConfigError) as info:
        parse_config(data, "f.yaml")
    assert str(info.value) == f"f.yaml: {message}"


@pytest.mark.parametrize("value, message", [
    (float("nan"), "must be a finite duration"),
    (float("inf"), "must be a finite duration"),
    (float("-inf"), "must be a finite duration"),
    (10**400, "must be at most 365d"),
    ("366d", "must be at most 365d"),
    ("9" * 400, "must be at most 365d"),
    ("soon", "not a duration"),
    (True, "not a duration"),
])
def test_parse_duration_rejects_non_finite_and_absurd(value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        parse_duration(value)


def test_parse_duration_keeps_its_range():
    assert parse_duration("365d") == 365 * 86400.0
    assert parse_duration(-3) == -3.0 and parse_duration("500ms") == 0.5


def test_defaults_come_from_the_dataclasses(config_file):
    """A file that sets nothing gets exactly the dataclass defaults (one source of truth)."""
    cfg = load_config(config_file("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {launchd: x}}]"))
    inst = cfg.instances[0]
    assert inst.probe == ProbeConfig() and cfg.capture == CaptureConfig()
    assert inst.restart == RestartConfig(method="launchd", target="x")


@pytest.mark.parametrize("text, kernel, shim", [
    ("kernel: off, shim: off", "off", "off"),  # YAML 1.1 reads a bare off as false
    ("kernel: 'off', shim: 'off'", "off", "off"),
    ("kernel: auto, shim: required", "auto", "required"),
])
def test_off_written_bare_means_off(tmp_path, text, kernel, shim):
    """Found by a new user: `kernel: off` as the docs write it was refused, "must be one of
    auto, off (got False)": YAML had read it as a boolean. `on` is still refused (not a mode)."""
    path = tmp_path / "c.yaml"
    path.write_text(f"instances: [{{{A}, {text}}}]\n")
    inst = load_config(path).instances[0]
    assert (inst.kernel, inst.shim) == (kernel, shim)
    path.write_text(f"instances: [{{{A}, kernel: on}}]\n")
    with pytest.raises(ConfigError, match=r"instances\[0\]\.kernel: must be one of auto, off \(got true: "
                       r"YAML reads a bare on, off, yes or no as true or false\)"):
        load_config(path)


@pytest.mark.parametrize("method", ["command: [/bin/echo]", "launchd: com.example.mlx", "systemd: mlx.service",
                                    "signal: SIGTERM"])
def test_restart_grace_is_set_for_every_method(config_file, method):
    """Found by a new user: docs/distributed.md says a group's ranks still running `grace` after a
    launchd, systemd or command restart are killed, but `grace` was an unknown key for all of
    them but `signal`."""
    cfg = load_config(config_file(f"instances: [{{name: a, url: 'http://127.0.0.1:1', restart: {{{method}, grace: 5s}}}}]"))
    assert cfg.instances[0].restart.grace == 5.0


def test_restart_none_takes_no_grace(config_file):
    path = config_file("instances: [{name: a, url: 'http://127.0.0.1:1', restart: {none: true, grace: 5s}}]")
    with pytest.raises(ConfigError, match=r"restart\.grace: unknown key"):
        load_config(path)
