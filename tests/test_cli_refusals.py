"""Exit codes and messages a newcomer met that said something that was not so (issue 29, item
7), and every exit code checked against the README's table: a state dir that cannot be made is
exit 2 with a fix; `bundle list` refuses an unknown instance and a --dir that is a file in their
own words; a URL with a query string is refused naming the query, never echoing a value;
`restart: reboot` lists the valid forms; `launch` does not print the whole PATH; `capture --out`
that cannot be written refuses before the capture; `--help` says `--out` is created."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest
from rich.console import Console
from test_cli import BAD_INPUTS, _readme_commands, _setup, make_bundle, no_user_config, one_line_error  # noqa: F401 - no_user_config: autouse fixture
from test_cli_newcomer import FAST, _config, fake_server  # noqa: F401 - fake_server: a fixture

import mlxwatch.cli as cli
from mlxwatch.config import ConfigError, parse_config
from lab.ports import free_port


def _run(argv: list[str]) -> int:
    return cli.run(argv, out=Console(file=io.StringIO()))


@pytest.fixture
def unwritable(tmp_path) -> Path:
    """A directory in which nothing can be made (sysfs for root, who writes anywhere a mode allows)."""
    if os.geteuid() == 0:
        target = Path("/sys/kernel")
        if not target.is_dir():
            pytest.skip("no /sys/kernel here")
        yield target
        return
    target = tmp_path / "readonly"
    target.mkdir()
    target.chmod(0o500)
    yield target
    target.chmod(0o700)


def _unwritable_config(tmp_path: Path, port: int, log: Path | None, where: Path) -> Path:
    cfg = _config(tmp_path, port, log)
    cfg.write_text(cfg.read_text().replace(f"state_dir: {tmp_path / 'state'}", f"state_dir: {where / 'mlxwatch-state'}"))
    return cfg


def test_capture_of_an_instance_whose_state_dir_cannot_be_made_is_exit_2_with_a_fix(
        tmp_path, fake_server, unwritable, capsys):  # noqa: F811 - fake_server: a fixture
    """Measured: a state dir that cannot be created (read-only file system) was exit 1, the bare
    OS error, for `capture --instance`."""
    pid, port, log = fake_server
    cfg = _unwritable_config(tmp_path, port, log, unwritable)
    code = _run(["--config", str(cfg), "capture", "--instance", "lab", *FAST])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if ": capture: PID " not in x]
    assert code == 2 and len(lines) == 1, err
    assert str(unwritable / "mlxwatch-state") in lines[0] and "--out DIR" in lines[0], lines[0]
    assert "Traceback" not in err


def test_resume_with_a_state_dir_that_cannot_be_made_is_exit_2_with_a_fix(tmp_path, unwritable, capsys):
    """Measured: exit 1 and the bare OS error for `resume` (documented: 2)."""
    cfg = _unwritable_config(tmp_path, free_port(), None, unwritable)
    code = _run(["--config", str(cfg), "resume", "lab"])
    line = one_line_error(capsys, code, ["resume"], 2, f"resume: cannot write the request in {unwritable / 'mlxwatch-state'}")
    assert "--state-dir" in line, line


def test_bundle_list_of_an_unknown_instance_is_exit_2(tmp_path, capsys):
    """Measured: `bundle list --instance nosuch` was exit 0, "no bundles" (other commands: 2)."""
    cfg = _config(tmp_path, free_port())
    make_bundle(tmp_path / "state" / "bundles", "lab")
    code = _run(["--config", str(cfg), "bundle", "list", "--instance", "nosuch"])
    one_line_error(capsys, code, ["bundle", "list"], 2, "bundle list: --instance 'nosuch': no instance of that name")
    assert _run(["--config", str(cfg), "bundle", "list", "--instance", "lab"]) == 0


def test_bundle_list_keeps_the_bundles_of_an_instance_no_longer_configured(tmp_path, capsys):
    """An instance dropped from the config still has its evidence: its bundles are listed."""
    cfg = _config(tmp_path, free_port())
    name = make_bundle(tmp_path / "state" / "bundles", "old-server").name
    assert _run(["--config", str(cfg), "bundle", "list", "--instance", "old-server", "--json"]) == 0
    assert name in capsys.readouterr().out


def test_bundle_list_dir_that_is_a_file_says_so(tmp_path, capsys):
    """Measured: `bundle list --dir FILE` said "no such directory"."""
    (tmp_path / "f").write_text("x")
    code = _run(["bundle", "list", "--dir", str(tmp_path / "f")])
    one_line_error(capsys, code, ["bundle", "list"], 2, f"--dir {tmp_path / 'f'} is a file, not a directory")


SECRET = "sk-the-secret-value"


@pytest.mark.parametrize("url", [f"http://127.0.0.1:8080?api_key={SECRET}", f"http://127.0.0.1:8080/?api_key={SECRET}&b=1",
                                 f"http://127.0.0.1:8080#{SECRET}"])
def test_a_url_with_a_query_names_the_query_and_never_echoes_a_value(url, tmp_path, capsys):
    """Measured: `url: "http://…?api_key=…"` was refused as "without a path" and the line echoed
    the key. Now the line names the query (its keys) and shows no value; `check URL` too."""
    with pytest.raises(ConfigError) as exc:
        parse_config({"instances": [{"name": "a", "url": url}]}, "c.yaml")
    message = str(exc.value)
    assert SECRET not in message and "without a path" not in message, message
    assert ("query" if "?" in url else "fragment") in message, message
    if "?" in url:
        assert "api_key" in message, message
    line = one_line_error(capsys, _run(["check", url]), ["check"], 2, "check: ")
    assert SECRET not in line, line


def test_a_url_with_a_password_never_echoes_it(capsys):
    with pytest.raises(ConfigError) as exc:
        parse_config({"instances": [{"name": "a", "url": f"http://me:{SECRET}@127.0.0.1:8080"}]}, "c.yaml")
    assert SECRET not in str(exc.value) and "user or password" in str(exc.value)


def test_a_url_with_a_path_still_says_path():
    with pytest.raises(ConfigError, match=r"without a path \(got 'http://127.0.0.1:8080/v1'\)"):
        parse_config({"instances": [{"name": "a", "url": "http://127.0.0.1:8080/v1"}]}, "c.yaml")


@pytest.mark.parametrize("value", ["reboot", 5, ["launchd", "x"]])
def test_a_restart_that_is_not_a_form_lists_the_valid_forms(value):
    """Measured: `restart: reboot` said "must be a mapping" while `restart: none` is valid."""
    with pytest.raises(ConfigError) as exc:
        parse_config({"instances": [{"name": "a", "url": "http://127.0.0.1:8080", "restart": value}]}, "c.yaml")
    message = str(exc.value)
    assert "instances[0].restart" in message and "none" in message, message
    for form in ("{launchd: LABEL}", "{systemd: UNIT}", "{command: [", "{signal: SIGTERM}"):
        assert form in message, message


@pytest.mark.parametrize("command", ["/nonexistent/binary", "no-such-command-anywhere"])
def test_launch_of_a_missing_command_does_not_print_the_path(command, capsys, monkeypatch):
    """Measured: the line held the whole PATH (hundreds of characters, every directory)."""
    monkeypatch.setenv("PATH", os.pathsep.join(f"/opt/dir-{n}/bin" for n in range(20)))
    line = one_line_error(capsys, _run(["launch", "--", command]), ["launch"], 2, f"launch: {command}: ")
    assert "/opt/dir-" not in line and len(line) < 160, line


def test_capture_out_that_cannot_be_written_is_refused_before_capturing(tmp_path, fake_server, capsys):  # noqa: F811 - a fixture
    """Measured: `capture PID --out /proc/x.tar.gz` captured a bundle first, then refused."""
    pid, port, log = fake_server
    cfg = _config(tmp_path, port, log)
    code = _run(["--config", str(cfg), "capture", str(pid), "--out", "/proc/x.tar.gz", *FAST])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if ": capture: PID " not in x]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("mlxwatch: capture: --out /proc/x.tar.gz: cannot "), lines[0]
    assert not (tmp_path / "state" / "bundles").exists() or not list((tmp_path / "state" / "bundles").iterdir())


@pytest.mark.parametrize("argv", [["capture", "--help"], ["bundle", "export", "--help"]])
def test_help_says_out_is_created(argv, capsys):
    """Measured: both said `--out` is "an existing directory", but both create it."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(argv)
    text = " ".join(capsys.readouterr().out.split())
    assert "existing directory" not in text and "created" in text, text


# --- every exit code is the README's


def _command_of(argv: list[str]) -> str | None:
    words = [a for n, a in enumerate(argv) if a != "--config" and (n == 0 or argv[n - 1] != "--config")]
    if not words or words[0].startswith("-"):
        return None
    return " ".join(words[:2]) if words[0] in ("bundle", "config", "launchd") and len(words) > 1 else words[0]


def _readme_codes() -> dict[str, set[int]]:
    return {command: {int(c) for c in re.findall(r"\b(\d{1,3})\b", row.rsplit("|", 2)[1])}
            for command, row in _readme_commands().items()}


MORE = [  # (argv, exit code): this file's cases, for the table check
    (["bundle", "list", "--instance", "nosuch"], 2), (["bundle", "list", "--dir", "{tmp}/passwd"], 2),
    (["launch", "--", "/nonexistent/binary"], 2), (["check", "http://127.0.0.1:1?key=v"], 2),
]


def test_every_exit_code_the_cli_gives_is_in_the_readme_table(tmp_path, sleeper, capsys):
    """Each bad input's exit code (test_cli's table and the cases above) is one the README's
    command table lists for that command; the codes are the commands' real ones."""
    readme = _readme_codes()
    values = _setup(tmp_path, sleeper)
    seen = 0
    for argv, expected, *_ in [*BAD_INPUTS, *MORE]:
        command = _command_of(argv)
        if command not in readme:
            continue  # no command (`mlxwatch`, a typo): the parser's, exit 2
        argv = [a.format(**values) for a in argv]
        code = _run(argv)
        capsys.readouterr()
        assert code == expected, f"{argv}: exit {code}"
        assert code in readme[command], f"{argv}: exit {code}, README lists {sorted(readme[command])} for {command}"
        seen += 1
    assert seen > 50
