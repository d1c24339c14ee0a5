"""One rule decides whether a config can be run (``mlxwatch.config.check_runnable``): `run`,
a SIGHUP reload, `config validate`, `launchd plist` and `launchd install` refuse the same files
with the same line. The daemon-process side (reload, signals) is in test_daemon_process.py."""

from __future__ import annotations

import plistlib

import pytest

from mlxwatch.cli import run

GOOD = "instances: [{name: local, url: 'http://127.0.0.1:8082'}]\n"
NOT_RUNNABLE = {
    "empty file": "",
    "no instances key": "state_dir: /tmp/x\n",
    "empty list": "instances: []\n",
}


@pytest.mark.parametrize("text", NOT_RUNNABLE.values(), ids=NOT_RUNNABLE.keys())
def test_config_validate_refuses_what_run_refuses_with_the_same_line(config_file, capsys, monkeypatch, text):
    """Measured: `config validate` passed an empty file ("ok, 0 instance(s)") that `run` refuses."""
    path = config_file(text)
    assert run(["config", "validate", str(path)]) == 2
    validate_err = capsys.readouterr().err.strip().splitlines()
    monkeypatch.setattr("mlxwatch.daemon.supervisor.Daemon", None)  # run must refuse before it builds one
    assert run(["--config", str(path), "run"]) == 2
    run_err = capsys.readouterr().err.strip().splitlines()
    assert validate_err == run_err == [f"mlxwatch: {path}: instances: no instances to watch "
                                       "(`mlxwatch config init` writes a starter)"]


def test_config_validate_json_refuses_too(config_file, capsys):
    assert run(["config", "validate", "--json", str(config_file(""))]) == 2
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("text, says", [
    (None, "file not found"),
    ("", "no instances to watch"),
    ("instances: [{name: a, url: 'http://127.0.0.1:1', probe: {timeout: -1}}]\n", "instances[0].probe.timeout"),
])
def test_launchd_plist_refuses_a_config_the_agent_could_not_run(tmp_path, capsys, text, says):
    """Measured: `launchd plist` printed an agent (exit 0) for a missing or invalid config that
    `launchd install` refuses: an agent that would exit 2 at every start, every ThrottleInterval."""
    config = tmp_path / "config.yaml"
    if text is not None:
        config.write_text(text)
    assert run(["launchd", "plist", "--config", str(config)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert str(config) in line and says in line


def test_launchd_plist_prints_the_agent_for_a_runnable_config(config_file, capsys):
    config = config_file(GOOD)
    assert run(["launchd", "plist", "--config", str(config)]) == 0
    plist = plistlib.loads(capsys.readouterr().out.encode())
    assert plist["ProgramArguments"][-3:] == ["--config", str(config.resolve()), "run"]
