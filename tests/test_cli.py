"""The command line as a newcomer meets it: every bad input is one line that names the problem
and what to do, with the documented exit code and never a traceback; help texts state the real
defaults; the README's command table matches the parser. (Real-server behaviour of doctor,
config init, bundles and status is in ``test_cli_real.py``.)"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from rich.console import Console

from mlxwatch.capture.bundle import BundleWriter, bundle_entries
from mlxwatch.capture.export import export_bundle, read_archive
import mlxwatch.cli as cli
from mlxwatch.config import CaptureConfig, ProbeConfig
from lab.ports import free_port  # a loopback port free a moment ago
from lab.standin import STANDIN  # the token-streaming stand-in's script

ROOT = Path(__file__).parent.parent


@pytest.fixture(autouse=True)
def no_user_config(tmp_path, monkeypatch):
    """Nothing from the real home: no config, no state, no bundles of the person running the tests."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "home" / "state"))
    monkeypatch.delenv("MLXWATCH_CONFIG", raising=False)
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)


def make_bundle(root: Path, label: str = "lab", kind: str = "livelock") -> Path:
    writer = BundleWriter(root, label)
    writer.write("log-tail.txt", "Prompt processing progress: 1/2\n")
    manifest = {"created_at": "2026-12-01T10:00:00+00:00", "target": {"pid": 4242, "label": label},
                "classification": {"kind": kind, "confidence": "high"}, "verdict": None, "steps": []}
    return writer.finish(manifest, f"# mlxwatch bundle: {kind} (high confidence)\n")


def one_line_error(capsys, code: int, argv: list[str], expected: int, fragment: str) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == expected, f"{argv}: exit {code}, stderr: {err}"
    assert len(lines) == 1, f"{argv}: not one line: {err!r}"
    assert lines[0].startswith("mlxwatch: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in err and "internal error" not in err
    assert not re.search(r"\b\w+_command\b", lines[0]), f"internal name in {lines[0]}"
    return lines[0]


# --- every bad input the issue lists (and its neighbours): one line, documented exit code


def _setup(tmp_path: Path, sleeper_pid: int) -> dict[str, str]:
    """Files the table's cases refer to, as {name: path}."""
    port = free_port()
    state = tmp_path / "state"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {state}\ninstances:\n  - name: lab\n    url: http://127.0.0.1:{port}\n")
    (tmp_path / "passwd").write_text("root:x:0:0\n")
    (tmp_path / "outdir").mkdir()
    bundle = make_bundle(tmp_path / "bundles")
    nosummary = tmp_path / "nosummary"
    nosummary.mkdir()
    (nosummary / "manifest.json").write_text('{"files": {}}')
    (tmp_path / "notabundle").mkdir()
    (tmp_path / "garbage.tar.gz").write_bytes(b"not gzip at all")
    with tarfile.open(tmp_path / "other.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("x/readme.txt")
        tar.addfile(info, io.BytesIO(b""))
    (tmp_path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    os.mkfifo(tmp_path / "fifo.yaml")
    broken_state = tmp_path / "broken"
    broken_state.mkdir()
    (broken_state / "state.json").write_text("[]")
    (tmp_path / "exists.yaml").write_text("instances: []\n")
    return {"cfg": str(cfg), "state": str(state), "bundle": str(bundle), "bundles": str(tmp_path / "bundles"),
            "tmp": str(tmp_path), "pid": str(sleeper_pid), "port": str(port), "self": str(os.getpid())}


BAD_INPUTS = [
    # (argv, exit code, fragment of the one line)
    ([], 2, "give a command: check, capture, bundle"),
    (["config"], 2, "config: give a subcommand: validate, init, example"),
    (["bundle"], 2, "bundle: give a subcommand: list, show, export"),
    (["launchd"], 2, "launchd: give a subcommand: plist, install, uninstall"),
    (["check", "--bogus"], 2, "unrecognized arguments: --bogus (see `mlxwatch check --help`)"),
    (["nosuchcommand"], 2, "invalid choice: 'nosuchcommand'"),
    # capture: bad PIDs, wrong process, bad --url/--out/--log
    (["capture", "-5"], 2, "capture: argument PID: a PID is a positive whole number (got '-5')"),
    (["capture", "0"], 2, "a PID is a positive whole number (got '0')"),
    (["capture", "abc"], 2, "a PID is a positive whole number (got 'abc')"),
    (["capture", "99999999", "--out", "{tmp}/outdir"], 1, "no process with PID 99999999"),
    (["capture"], 2, "capture: give the server's PID, or --instance NAME"),
    (["capture", "{pid}"], 2, "is not an mlx-lm server (sleep 300); check the PID, or add --force"),
    (["capture", "{pid}", "--url", "http://127.0.0.1:{port}"], 2,
     "is not the mlx-lm server listening at http://127.0.0.1:{port}: nothing listens on"),
    (["--config", "{cfg}", "capture", "1", "--instance", "lab"], 2, "PID 1 "),
    (["--config", "{cfg}", "capture", "--instance", "lab"], 1, "capture: no mlx-lm server proven for lab"),
    (["--config", "{cfg}", "capture", "--instance", "nope"], 2, "no instance named 'nope' (known: lab)"),
    (["capture", "{pid}", "--url", "localhost"], 2, "capture: --url must be a URL such as http://127.0.0.1:8080"),
    (["capture", "{pid}", "--out", "{tmp}/passwd"], 2, "is a file, not a directory"),
    (["capture", "{pid}", "--out", "{tmp}/x.zip"], 2, "the name must end in .tar.gz"),
    (["capture", "{pid}", "--out", "{tmp}/passwd/dir"], 2, "--out {tmp}/passwd/dir: {tmp}/passwd is not a directory"),
    (["capture", "{pid}", "--out", "{tmp}/passwd/b.tar.gz"], 2, "{tmp}/passwd is not a directory"),
    (["capture", "{pid}", "--log", "/dev/zero"], 2, "--log /dev/zero is not a regular file"),
    (["capture", "{pid}", "--log", "{tmp}/nolog"], 2, "--log {tmp}/nolog: no such file"),
    (["capture", "{pid}", "--snapshots", "0"], 2, "must be a whole number from 1 to"),
    (["capture", "{pid}", "--spacing=-1s"], 2, "argument --spacing: must be a duration such as 30, 30s, 5m or 1h (got '-1s')"),
    # resume: names that are not instances, or paths
    (["resume", "x"], 2, "resume: no config at"),
    (["--config", "{cfg}", "resume", ""], 2, "no instance named '' (known: lab)"),
    (["--config", "{cfg}", "resume", "a/b"], 2, "no instance named 'a/b'"),
    (["--config", "{cfg}", "resume", "../../x"], 2, "no instance named '../../x'"),
    (["--config", "{cfg}", "resume", "nope"], 2, "no instance named 'nope'"),
    # bundles
    (["bundle", "show", "{tmp}/nosummary"], 2, "has no summary.md"),
    (["bundle", "show", "{tmp}/notabundle"], 2, "is not a bundle (no manifest.json or summary.md)"),
    (["bundle", "show", "{tmp}/missing"], 2, "no such bundle directory or archive (`mlxwatch bundle list`"),
    (["bundle", "show", "/dev/zero"], 2, "is not a bundle directory or a .tar.gz archive"),
    (["bundle", "show", "{tmp}/garbage.tar.gz"], 2, "not a readable .tar.gz bundle archive"),
    (["bundle", "show", "{tmp}/other.tar.gz"], 2, "an archive, but not of a bundle"),
    (["bundle", "export", "{bundle}", "--out", "{tmp}/passwd"], 2, "is a file, not a directory"),
    (["bundle", "export", "{bundle}", "--out", "{tmp}/b.zip"], 2, "the name must end in .tar.gz"),
    (["bundle", "export", "{bundle}", "--out", "{tmp}/passwd/b.tar.gz"], 2, "{tmp}/passwd is not a directory"),
    (["bundle", "export", "{bundle}", "--out", "{bundle}"], 2, "is inside the bundle"),
    (["bundle", "export", "{tmp}/notabundle"], 2, "bundle export: {tmp}/notabundle is not a bundle (no manifest.json)"),
    (["bundle", "export", "{tmp}/notabundle", "--out", "{tmp}/made/by/a/refusal"], 2, "is not a bundle (no manifest.json)"),
    (["bundle", "list", "--dir", "{tmp}/missing"], 2, "bundle list: --dir {tmp}/missing: no such directory"),
    # config files that are not config files
    (["config", "validate", "{tmp}/latin1.yaml"], 2, "not UTF-8 text at byte"),
    (["config", "validate", "/dev/zero"], 2, "not a regular file (a character device)"),
    (["config", "validate", "{tmp}/fifo.yaml"], 2, "not a regular file (a FIFO)"),
    (["config", "validate", "{tmp}/missing.yaml"], 2, "file not found"),
    (["config", "init", "--out", "{tmp}/exists.yaml"], 2, "exists; not overwriting"),
    (["config", "init", "--out", "{tmp}/missing/c.yaml"], 2, "no such directory"),
    (["config", "init", "--out", "{tmp}"], 2, "config init: {tmp} is a directory; name the file to write"),
    # --config accepted after the subcommand too (a missing file proves it was read)
    (["run", "--config", "{tmp}/missing.yaml"], 2, "{tmp}/missing.yaml: file not found"),
    (["check", "--config", "{tmp}/missing.yaml", "--instance", "x"], 2, "{tmp}/missing.yaml: file not found"),
    (["status", "--config", "{tmp}/missing.yaml"], 2, "{tmp}/missing.yaml: file not found"),
    (["doctor", "--config", "{cfg}", "--instance", "nope"], 2, "no instance named 'nope'"),
    (["run"], 2, "nothing to watch"),
    # check and status options
    (["check", "http://127.0.0.1:1", "--max-tokens", "0"], 2, "--max-tokens: must be a whole number from 1"),
    (["check", "http://127.0.0.1:1", "--wait", "soon"], 2,
     "argument --wait: must be a duration such as 30, 30s, 5m or 1h (got 'soon')"),
    (["check", "localhost"], 2, "check: must be a URL such as http://127.0.0.1:8080 (got 'localhost')"),
    (["status", "--count", "2"], 2, "status: --count needs --watch"),
    (["status", "--watch", "0"], 2, "must be a positive duration"),
]


@pytest.mark.parametrize("argv, expected, fragment", BAD_INPUTS, ids=[" ".join(a) or "(none)" for a, _, _ in BAD_INPUTS])
def test_every_bad_input_is_one_line_with_its_exit_code(argv, expected, fragment, tmp_path, sleeper, capsys):
    """No traceback, one line that names the value and what to do, the documented exit code."""
    values = _setup(tmp_path, sleeper)
    argv = [a.format(**values) for a in argv]
    code = cli.run(argv, out=Console(file=io.StringIO()))
    one_line_error(capsys, code, argv, expected, fragment.format(**values))


def test_resume_never_writes_outside_the_state_dir(tmp_path, sleeper, capsys):
    """`resume ../../x` is refused before anything is written."""
    values = _setup(tmp_path, sleeper)
    before = set(tmp_path.rglob("*"))
    assert cli.run(["--config", values["cfg"], "resume", "../../x"]) == 2
    assert set(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("state_json", ["[]", '{"instances": 5}', '{"instances": {"x": 5}}',
                                        '{"instances": {"x": {"state": 5, "last_probe": 7, "restarts": "no"}}, '
                                        '"daemon": {"last_tick": "soon"}}',
                                        '{"instances": {"x": {"last_probe": {"at": "x", "ok": 1, "reason": ["a"]}}}}'])
def test_status_reads_a_damaged_state_file_without_a_traceback(state_json, tmp_path, capsys):
    """A hand-edited state.json is shown as far as it makes sense; exit 1 (no daemon runs)."""
    (tmp_path / "state.json").write_text(state_json)
    (tmp_path / "incidents.jsonl").write_text('{"id": [], "instance": "x", "event": "verdict"}\n'
                                              '{"id": "a", "instance": {}, "event": "verdict"}\n')
    for extra in ([], ["--json"]):
        code = cli.run(["status", "--state-dir", str(tmp_path), *extra], out=Console(file=io.StringIO()))
        err = capsys.readouterr().err
        assert code == 1 and "Traceback" not in err and "internal error" not in err, err


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} in status --json: not JSON")


@pytest.mark.parametrize("state_json", ['{"instances": {"x": {"failures": 1e400}}}',
                                        '{"instances": {"x": {"failures": NaN}}}',
                                        '{"instances": {"x": {"group": {"ranks": [{"rank": 1e400}]}}}}',
                                        '{"daemon": {"pid": 1e400, "last_tick": NaN}}',
                                        '{"instances": {"x": {"state": "healthy", "failures": -3}}, '
                                        '"daemon": {"pid": "abc", "last_tick": "yesterday", "watcher_errors": 2.5}}'])
def test_status_of_a_state_file_with_odd_numbers_is_json_and_no_internal_error(state_json, tmp_path, capsys):
    """Found by a new user: NaN, Infinity or 1e400 in state.json made `status` an internal error
    (OverflowError, ValueError), and `status --json` passed the daemon's fields through as they
    were: `Infinity`, `NaN` (not JSON) or a string PID. A file holding non-JSON numbers is
    damaged (status says so and the daemon rebuilds it); odd values are left out."""
    (tmp_path / "state.json").write_text(state_json)
    assert cli.run(["status", "--state-dir", str(tmp_path)], out=Console(file=io.StringIO())) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    assert cli.run(["status", "--state-dir", str(tmp_path), "--json"]) == 1
    data = json.loads(capsys.readouterr().out, parse_constant=_no_constant)
    daemon = data["daemon"]
    assert daemon["pid"] is None and "last_tick" not in daemon and "watcher_errors" not in daemon, daemon
    assert all(i["failures"] >= 0 for i in data["instances"]), data["instances"]
    if "NaN" in state_json or "1e400" in state_json:
        assert data["state_problem"], data


def test_status_shows_control_characters_from_the_state_file_as_question_marks(tmp_path, capsys):
    """Found by a new user: an instance name or reason in state.json with a newline or an ANSI
    escape sequence was printed raw, breaking the table (and driving the terminal)."""
    (tmp_path / "state.json").write_text(json.dumps({"instances": {"evil\x1b[2J\nname": {
        "state": "hung\x1b[31m", "last_probe": {"at": 1.0, "ok": False, "reason": "no\ntoken"}}}}))
    buf = io.StringIO()
    assert cli.run(["status", "--state-dir", str(tmp_path)], out=Console(file=buf, width=200)) == 1
    shown = buf.getvalue()
    assert "\x1b" not in shown and "evil?[2J?name" in shown and "hung?[31m" in shown, shown
    assert cli.run(["status", "--state-dir", str(tmp_path), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["instances"][0]["name"] == "evil?[2J?name"


# --- stdout closed early (`| head`): no traceback, the shell's SIGPIPE code


@pytest.mark.parametrize("argv", [["check", "http://127.0.0.1:{port}", "--json"], ["config", "example"],
                                  ["--help"], ["status", "--json"], ["bundle", "list", "--dir", "{tmp}"]])
def test_a_reader_that_goes_away_gets_no_traceback(argv, tmp_path):
    """Measured: `check URL --json | head` ended in a BrokenPipeError traceback; `bundle list |
    head -1` (printed through rich, whose own answer is exit 1) ended in exit 1 with no line."""
    argv = [a.format(port=free_port(), tmp=tmp_path) for a in argv]
    env = {**os.environ, "HOME": str(tmp_path), "XDG_STATE_HOME": str(tmp_path / "state")}
    env.pop("MLXWATCH_CONFIG", None)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    with open(write, "wb") as stdout:
        proc = subprocess.run([sys.executable, "-m", "mlxwatch", *argv], stdout=stdout, stderr=subprocess.PIPE,
                              env=env, timeout=120)
    assert b"Traceback" not in proc.stderr and b"Exception ignored" not in proc.stderr, proc.stderr.decode()
    assert proc.returncode in (cli.EXIT_PIPE, 0, 1), proc.returncode
    if argv[0] != "--help":  # argparse's own exit after --help cannot tell us the pipe broke
        assert proc.returncode == cli.EXIT_PIPE


def test_an_internal_error_is_one_line_and_the_traceback_is_on_request(monkeypatch, capsys):
    """A bug still ends in one line; MLXWATCH_DEBUG=1 shows its traceback."""
    def boom(args, out):
        raise TypeError("a bug")

    monkeypatch.setitem(cli.COMMANDS, "status", boom)
    assert cli.run(["status"]) == 1
    assert capsys.readouterr().err.strip() == ("mlxwatch: internal error: TypeError: a bug "
                                               "(please report it; MLXWATCH_DEBUG=1 shows the traceback)")
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    with pytest.raises(TypeError):
        cli.run(["status"])


# --- help: every option explained, defaults read from the config dataclasses


def _subparsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, prefix + (name,))


def test_every_option_and_argument_has_help():
    """Measured: several options had no help text."""
    for path, parser in _subparsers(cli.build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
                continue
            assert action.help, f"mlxwatch {' '.join(path)}: {action.option_strings or action.dest} has no help"


def test_help_defaults_are_the_config_defaults():
    """Measured: `check --help` said 120s and min(60s, ...) while the real defaults were 90s and 45s."""
    parser = dict(_subparsers(cli.build_parser()))
    check, capture = parser[("check",)].format_help(), parser[("capture",)].format_help()
    flat = lambda text: " ".join(text.split())  # noqa: E731 - argparse wraps lines
    p, c = ProbeConfig(), CaptureConfig()
    assert f"default {cli.help_duration(p.timeout)}" in flat(check) and "default 90s" in flat(check)
    assert f"default {cli.help_duration(p.first_token_timeout)}" in flat(check)
    assert f"default {p.max_tokens}" in flat(check)
    assert f"default {c.snapshots}" in flat(capture) and f"default {cli.help_duration(c.spacing)}" in flat(capture)
    assert f"default {cli.help_duration(c.ceiling)}" in flat(capture)
    assert "120" not in check


@pytest.mark.parametrize("seconds, text", [(90, "90s"), (45, "45s"), (600, "10m"), (3600, "1h"), (0.5, "500ms"),
                                           (2, "2s"), (150, "150s")])
def test_human_duration(seconds, text):
    assert cli.help_duration(seconds) == text


def _readme_commands() -> dict[str, str]:
    """README "Commands" table: first cell's command words -> the whole row."""
    text = (ROOT / "README.md").read_text()
    table = text.split("## Commands", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cell = line.split("|")[1]
        words = re.findall(r"`mlxwatch ([a-z ]+?)(?: [A-Z\[`-]|`)", cell)
        for w in words:
            rows[w.strip()] = line
    return rows


def test_readme_command_table_matches_the_parser():
    """Every command has a row; every option the parser has is in its row, and the other way round."""
    rows = _readme_commands()
    for path, parser in _subparsers(cli.build_parser()):
        has_sub = any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
        if not path or has_sub:
            continue
        command = " ".join(path)
        assert command in rows, f"README has no row for `mlxwatch {command}`"
        row = rows[command]
        options = {o for a in parser._actions for o in a.option_strings
                   if o.startswith("--") and o not in ("--help", "--config")}
        for option in options:
            assert option in row, f"README row for {command} lacks {option}"
        for option in re.findall(r"(--[a-z][a-z-]*)", row):
            assert option in options or option == "--config", f"README row for {command} names {option}, not in --help"


# --- status: 80 columns, exit codes a monitor can use


def _status(running=True, instances=None, config="c.yaml"):
    now = time.time()
    return {"state_dir": "/home/someone/.local/state/mlxwatch", "state_problem": None, "config": config,
            "daemon": {"running": running, "pid": 4242, "stalled": False, "updated_at": now - 60},
            "instances": instances or []}


def _instance(name="gemma", state="healthy", ok=True, reason=None, open_incident=None, last_incident=None):
    now = time.time()
    return {"name": name, "configured": True, "state": state, "failures": 0, "restarts_in_window": 0, "budget": 3,
            "last_probe": {"at": now - 5, "ok": ok, "reason": reason, "ttft": 0.05 if ok else None, "total": 0.1,
                           "tokens": 4 if ok else 0},
            "last_incident": last_incident, "open_incident": open_incident}


def test_status_fits_80_columns_and_reflows_long_lines():
    """Measured: headers cut, a row wrapping to 7 lines, reasons cut mid-word with no mark; then
    (issue 29) a reason or a front door's counts cut with an ellipsis, lost to the reader. Now
    a long line is reflowed onto indented lines, every word of it kept."""
    from mlxwatch.output.status import status_lines

    reason = "no token delivered within the first-token timeout: 45s passed (headers received, 3 keepalives)" * 2
    status = _status(instances=[
        _instance("a-rather-long-instance-name-for-a-server", "suspect", ok=False, reason=reason),
        _instance("gone", "hung", ok=False, reason="connection refused: nothing is listening at this address",
                  open_incident={"id": "1a2b3c4d5e6f", "stopped_at_event": "awaiting_recovery", "kind": "crashed"}),
        _instance("qwen"),
    ])
    lines = [t.plain for t in status_lines(status, 80)]
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert lines[1].split() == ["INSTANCE", "STATE", "LAST", "PROBE", "TTFT", "RESTARTS"]
    assert not any(line.endswith("…") for line in lines[2:] if not line.startswith(("a-rather", "gone", "qwen")))
    start = next(n for n, line in enumerate(lines) if line.startswith("  last probe: no token"))
    folded = " ".join(line.strip() for line in lines[start:start + 4])
    assert folded.startswith(f"last probe: {reason}"), folded
    gone = next(line for line in lines if line.startswith("gone"))
    assert "down (crashed)" in gone  # not "hung" beside a "crashed" incident
    assert any("gone: incident 1a2b3c4d5e6f in progress: awaiting_recovery" in line for line in lines)


@pytest.mark.parametrize("running, states, code", [
    (True, ["healthy", "healthy"], 0),
    (False, ["healthy"], 1),
    (True, ["healthy", "suspect"], 1),
    (True, ["starting"], 1),
    (True, [], 1),
])
def test_status_exit_codes(running, states, code):
    """0 only when a daemon runs and every instance is healthy."""
    from mlxwatch.daemon.status import status_exit_code

    status = _status(running, [_instance(f"i{n}", s) for n, s in enumerate(states)])
    assert status_exit_code(status) == code


def test_status_is_1_while_a_front_door_cannot_serve():
    """Found in a walk through the README: a door that could not listen (its clients refused)
    left `status` at 0 beside a healthy server."""
    from mlxwatch.daemon.status import status_exit_code

    door = {"listen": "127.0.0.1:8081", "gate": "open", "error": None, "in_flight": 0, "last_token_at": None,
            "outcomes": {}}
    serving = _status(True, [{**_instance(), "front": door}])
    refused = _status(True, [{**_instance(), "front": {**door, "error": "cannot listen on 127.0.0.1:8081: in use"}}])
    assert status_exit_code(serving) == 0 and status_exit_code(refused) == 1


def test_status_with_no_config_says_what_to_do(capsys):
    """Measured: an empty table and no hint."""
    assert cli.run(["status"]) == 1
    out = capsys.readouterr().out
    assert "mlxwatch config init" in out and "mlxwatch run" in out


def test_status_watch_prints_count_updates(tmp_path, capsys):
    """`status --watch 50ms --count 3` prints three updates (piped: one block each), then exits."""
    assert cli.run(["status", "--state-dir", str(tmp_path), "--watch", "50ms", "--count", "3"]) == 1
    assert capsys.readouterr().out.count("--- ") == 3
    assert cli.run(["status", "--state-dir", str(tmp_path), "--watch", "50ms", "--count", "2", "--json"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(json.loads(line)["exit_code"] == 1 for line in lines)


# --- bundles: export, list, show


def test_export_holds_one_top_folder_and_only_the_listed_files(tmp_path, monkeypatch):
    """Measured: `cd BUNDLE && bundle export .` wrote `-redacted.tar.gz` inside the bundle, with
    absolute member names and earlier archives included."""
    bundle = make_bundle(tmp_path / "bundles")
    (bundle / "stray.txt").write_text("not listed")
    (bundle / "old.tar.gz").write_bytes(b"an earlier archive")
    monkeypatch.chdir(bundle)
    assert cli.run(["bundle", "export", ".", "--redact"], out=Console(file=io.StringIO())) == 0
    archive = bundle.parent / f"{bundle.name}-redacted.tar.gz"
    assert archive.exists() and not list(bundle.glob("*-redacted.tar.gz"))
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert {n.split("/")[0] for n in names} == {bundle.name}
    assert sorted(n.split("/", 1)[1] for n in names) == ["log-tail.txt", "manifest.json", "summary.md"]


@pytest.mark.parametrize("out, where", [(None, "{parent}/{name}-redacted.tar.gz"),
                                        ("{tmp}/outdir", "{tmp}/outdir/{name}-redacted.tar.gz"),
                                        ("{tmp}/mine.tar.gz", "{tmp}/mine.tar.gz")])
def test_export_out_is_a_directory_or_a_tar_gz(out, where, tmp_path, capsys):
    """`--out` means the same as for capture: an existing directory, or a new FILE.tar.gz (the
    export is redacted by default, and its default name says so)."""
    bundle = make_bundle(tmp_path / "bundles")
    (tmp_path / "outdir").mkdir()
    values = {"tmp": tmp_path, "parent": bundle.parent, "name": bundle.name}
    argv = ["bundle", "export", str(bundle)] + (["--out", out.format(**values)] if out else [])
    assert cli.run(argv) == 0
    assert capsys.readouterr().out.strip() == where.format(**values)
    assert cli.run(argv) == 2  # never overwrites
    assert "exists; not overwriting" in capsys.readouterr().err


def test_bundle_list_newest_first_with_incomplete_ones(tmp_path, capsys):
    """Time, instance, kind, confidence, size and name; --json has the paths."""
    root = tmp_path / "bundles"
    older = make_bundle(root, "gemma", "blocked")
    newer = make_bundle(root, "qwen", "livelock")
    os.utime(older, (time.time() - 3600, time.time() - 3600))
    manifest = json.loads((newer / "manifest.json").read_text())
    assert manifest["created_at"]  # both say 2026-12-01T10:00; the newer one is made newer here:
    for path, when in ((older, "2026-12-01T09:00:00+00:00"), (newer, "2026-12-01T10:00:00+00:00")):
        m = json.loads((path / "manifest.json").read_text())
        m["created_at"] = when
        (path / "manifest.json").write_text(json.dumps(m))
    (root / "lab-20261201T110000Z-abcdef-incomplete").mkdir()
    assert cli.run(["bundle", "list", "--dir", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"3 bundles in {root}, newest first:"
    assert out[1].split() == ["time", "instance", "kind", "conf.", "size", "bundle"]
    assert [line.split()[-1] for line in out[2:]] == ["lab-20261201T110000Z-abcdef-incomplete", newer.name, older.name]
    assert "(incomplete)" in out[2] and "livelock" in out[3] and "high" in out[3]
    assert cli.run(["bundle", "list", "--dir", str(root), "--json", "--instance", "gemma"]) == 0
    listed = json.loads(capsys.readouterr().out)["bundles"]
    assert [(b["path"], b["kind"], b["confidence"], b["instance"]) for b in listed] == [
        (str(older), "blocked", "high", "gemma")]
    assert bundle_entries(tmp_path / "nothing") == []


def test_bundle_show_a_directory_a_name_or_an_archive(tmp_path, capsys):
    """The summary of a bundle by path, by name in the bundles dir, or from its exported archive."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"capture: {{dir: {tmp_path / 'bundles'}}}\n")
    bundle = make_bundle(tmp_path / "bundles")
    archive = export_bundle(bundle, tmp_path)
    for target in (str(bundle), bundle.name, str(archive)):
        assert cli.run(["--config", str(cfg), "bundle", "show", target]) == 0
        assert capsys.readouterr().out == "# mlxwatch bundle: livelock (high confidence)\n"
    assert cli.run(["bundle", "show", "--json", str(archive)]) == 0
    assert json.loads(capsys.readouterr().out)["classification"]["kind"] == "livelock"
    assert read_archive(archive).name == bundle.name


# --- capture output


def test_capture_progress_says_no_token_when_the_probe_got_none():
    """Measured: the progress table said "probe ok" when the probe got no token."""
    from mlxwatch.output.capture import CaptureProgress

    console = Console(file=io.StringIO(), width=100, color_system=None)
    with CaptureProgress(console) as progress:
        progress.update("probe", "start")
        progress.update("probe", "ok")
        progress.update("stacks", "ok")
        progress.finish([{"name": "probe", "outcome": "ok", "error": "probe: no token delivered within 10s"},
                         {"name": "stacks", "outcome": "ok", "error": None}])
    text = console.file.getvalue()
    assert "no token: no token delivered within 10s" in text and "probe ok" not in text


def test_summary_without_an_instance_has_no_none(tmp_path):
    """Measured: "target: PID N None" in summaries of a capture without --instance."""
    from mlxwatch.capture.summary import render_summary

    manifest = {"classification": {"kind": "unknown", "confidence": "low", "evidence": []},
                "target": {"pid": 7, "label": None}, "created_at": "x", "host": "h", "steps": []}
    assert "- target: PID 7\n" in render_summary(manifest, [], None)


# --- notify after the bundle is written


async def test_notify_fires_captured_with_kind_confidence_and_bundle(tmp_path):
    """Measured: the only notify payload before a restart had kind null and bundle null."""
    import asyncio

    from mlxwatch.capture import Bundle, Classification
    from mlxwatch.config import InstanceConfig
    from mlxwatch.daemon.watcher import InstanceWatcher, Shared
    from mlxwatch.journal.incidents import Incident, Journal
    from mlxwatch.journal.state import StateFile

    fired = []

    class Notifier:
        def fire(self, event, payload):
            fired.append((event, payload))

    async def capture(request):
        return Bundle(tmp_path / "b1", Classification("livelock", "high", [], []), {})

    shared = Shared(journal=Journal(tmp_path), state=StateFile(tmp_path), state_dir=tmp_path, notifier=Notifier(),
                    capture=CaptureConfig(), bundles_dir=tmp_path / "b", capture_fn=capture)
    watcher = InstanceWatcher(InstanceConfig("gemma", "http://127.0.0.1:1"), shared, asyncio.Event())
    watcher.incident = inc = Incident("gemma")
    await watcher._capture(inc, None)
    ((event, payload),) = fired
    assert event == "captured"
    assert (payload["kind"], payload["confidence"], payload["bundle"]) == ("livelock", "high", str(tmp_path / "b1"))


# --- config example and init


def test_config_example_is_the_repository_example_and_validates(tmp_path, capsys):
    """pip users get the commented example too (package data), the same file as the repository's."""
    assert cli.run(["config", "example"]) == 0
    text = capsys.readouterr().out
    assert text == (ROOT / "mlxwatch.example.yaml").read_text()
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert cli.run(["config", "validate", str(path)]) == 0


def test_config_validate_json(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("instances: [{name: a, url: 'http://127.0.0.1:8080', probe: {timeout: 2m}}]\n")
    assert cli.run(["config", "validate", "--json", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] is True and data["instances"][0]["probe"]["timeout"] == 120.0


def test_starter_config_validates_and_names_are_unique():
    """What `config init` writes always loads; names come from the model and never repeat."""
    import yaml

    from mlxwatch.config import parse_config
    from mlxwatch.host.discover import FoundServer, _name_all, starter_config

    servers = [FoundServer(10, ("mlx_lm.server",), "http://127.0.0.1:8080", True, Path("/var/log/a b.log"),
                           "stderr", model="mlx-community/gemma-3-27b-it-4bit"),
               FoundServer(11, ("mlx_lm.server",), "http://127.0.0.1:8081", True, None, "",
                           launchd_label="com.example.mlx", model="mlx-community/gemma-3-27b-it-4bit"),
               FoundServer(12, ("mlx_lm.server",), "http://[::1]:8082", False, None, "",
                           systemd_unit="mlx.service", systemd_user=True, model="/models/.hidden")]
    _name_all(servers)
    assert [s.name for s in servers] == ["gemma-3-27b-it-4bit", "gemma-3-27b-it-4bit-2", "hidden"]
    cfg = parse_config(yaml.safe_load(starter_config(servers)), "x")
    assert [(i.name, i.url, i.log, i.restart.method, i.restart.target) for i in cfg.instances] == [
        ("gemma-3-27b-it-4bit", "http://127.0.0.1:8080", Path("/var/log/a b.log"), "none", ""),
        ("gemma-3-27b-it-4bit-2", "http://127.0.0.1:8081", None, "launchd", "com.example.mlx"),
        ("hidden", "http://[::1]:8082", None, "systemd", "mlx.service")]
    assert cfg.instances[2].restart.user is True
    # found by a new user: its header and hint comments ran to 105 and 89 columns (`--print`)
    wide = [line for line in starter_config(servers).splitlines() if len(line) > 80 and "# found: PID" not in line]
    assert wide == []


@pytest.mark.parametrize("addresses, url", [
    ([("0.0.0.0", 8080)], "http://127.0.0.1:8080"),
    ([("::", 8080)], "http://[::1]:8080"),
    ([("::1", 8080), ("127.0.0.1", 8080)], "http://127.0.0.1:8080"),
    ([("192.168.1.5", 8080)], "http://192.168.1.5:8080"),
    ([("fe80::1", 9)], "http://[fe80::1]:9"),
])
def test_found_servers_are_addressed_as_a_local_client_would(addresses, url):
    from mlxwatch.host.discover import _url

    assert _url(addresses) == url


@pytest.mark.parametrize("cgroup, unit", [
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/mlx-qwen.service\n", ("mlx-qwen.service", True)),
    ("0::/system.slice/mlx.service\n", ("mlx.service", False)),
    ("0::/user.slice/user-1000.slice/user@1000.service/app.slice/vte-spawn-1.scope\n", None),
    ("0::/\n", None),
])
def test_systemd_unit_from_cgroup(cgroup, unit):
    from mlxwatch.host.discover import unit_from_cgroup

    assert unit_from_cgroup(cgroup) == unit


def test_config_init_that_cannot_write_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """Found by a new user: `config init --out /proc/c.yaml` printed the bare OS error with
    exit 1 (documented as "no server running")."""
    monkeypatch.setattr("mlxwatch.host.discover.find_servers", lambda: ["a server"])
    monkeypatch.setattr("mlxwatch.host.discover.starter_config", lambda servers: "instances: []\n")
    one_line_error(capsys, cli.run(["config", "init", "--out", "/proc/c.yaml"]), ["config", "init"], 2,
                   "config init: cannot write /proc/c.yaml:")


def test_config_init_with_no_server_says_so(tmp_path, monkeypatch, capsys):
    """Nothing running: exit 1, nothing written, one line pointing to `config example`."""
    monkeypatch.setattr("mlxwatch.host.discover.find_servers", lambda: [])
    assert cli.run(["config", "init", "--out", str(tmp_path / "c.yaml")]) == 1
    assert not (tmp_path / "c.yaml").exists()
    one_line_error(capsys, 1, ["config", "init"], 1, "mlxwatch config example")


# --- the daemon's log: one line per event, rotated when it is a file


def test_run_keeps_httpx_request_lines_out_of_the_log(tmp_path, monkeypatch):
    """Measured: 67 of 80 INFO lines were `httpx: HTTP Request: ...`, three per probe."""
    import logging

    seen = {}

    class FakeDaemon:
        def __init__(self, config, state_dir):
            seen["levels"] = {n: logging.getLogger(n).getEffectiveLevel() for n in ("httpx", "httpcore", "mlxwatch")}

        async def run(self, stop, reload, load_config):
            return None

    monkeypatch.setattr("mlxwatch.daemon.supervisor.Daemon", FakeDaemon)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path}\ninstances: [{{name: a, url: 'http://127.0.0.1:1'}}]\n")
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert cli.run(["run", "--config", str(cfg)]) == 0
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.NOTSET)
    assert seen["levels"]["httpx"] == logging.WARNING and seen["levels"]["httpcore"] == logging.WARNING
    assert seen["levels"]["mlxwatch"] == logging.INFO


def test_stderr_file_is_rotated(tmp_path):
    """A log file nothing rotates (launchd's StandardErrorPath) is rotated by the daemon itself."""
    import logging

    from mlxwatch.daemon.selflog import RotatingStderr

    path = tmp_path / "mlxwatch.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        handler = RotatingStderr(max_bytes=1000, keep=2, fd=fd)
        logger = logging.getLogger("mlxwatch.test-rotation")
        logger.addHandler(handler)
        logger.propagate = False
        try:
            for i in range(60):
                logger.warning("line %03d %s", i, "x" * 40)
        finally:
            logger.removeHandler(handler)
            handler.flush()
    finally:
        os.close(fd)
    assert handler.rotations >= 2
    assert path.stat().st_size <= 1000 + 200 and (tmp_path / "mlxwatch.log.1").exists()
    assert (tmp_path / "mlxwatch.log.2").exists() and not (tmp_path / "mlxwatch.log.3").exists()
    assert "line 059" in path.read_text()  # the newest lines are in the file being written


def test_stderr_that_is_not_a_file_is_never_rotated(tmp_path):
    import logging

    from mlxwatch.daemon.selflog import RotatingStderr

    read, write = os.pipe()
    try:
        handler = RotatingStderr(max_bytes=10, fd=write)
        handler.emit(logging.makeLogRecord({"msg": "x" * 100}))
        assert handler.rotations == 0
    finally:
        os.close(read)
        os.close(write)


# --- check --wait


def test_check_wait_polls_until_the_server_answers(tmp_path):
    """A CI job starts the server and it loads a while: refused, refused, ... healthy; exit 0,
    saying how long it waited. The server is started when the waiting is seen, not after a sleep."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    checker = subprocess.Popen([sys.executable, "-m", "mlxwatch", "check", "--wait", "60s", url],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    standin = None
    try:
        line = checker.stderr.readline()  # the first "waiting for ..." line: it was refused at least once
        assert f"waiting for {url}" in line and "connection refused" in line, line
        (tmp_path / "mode").write_text("ok")
        standin = subprocess.Popen([sys.executable, STANDIN, "--ports", str(port),
                                    "--mode-file", str(tmp_path / "mode")], stdout=subprocess.PIPE, text=True)
        assert standin.stdout.readline().strip() == "ready"
        out, err = checker.communicate(timeout=90)
    finally:
        checker.kill()
        checker.wait(10)
        if standin is not None:
            standin.kill()
            standin.wait(10)
            standin.stdout.close()
    assert checker.returncode == 0, err
    assert out.startswith(f"healthy {url}")
    waited = re.search(r"waited\s+(\S+), (\d+) probes", out)
    assert waited and int(waited.group(2)) >= 2, out


def test_check_wait_gives_up_after_the_duration(capsys):
    """Nothing ever listens: exit 1 once the wait is over, with the reason and the time waited."""
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    assert cli.run(["check", "--wait", "1500ms", url, "--json"]) == 1
    elapsed = time.monotonic() - t0
    data = json.loads(capsys.readouterr().out)
    assert data["failure"] == "connect_refused" and data["waited"]["probes"] >= 2
    assert 1.5 <= data["waited"]["seconds"] and elapsed < 30


# --- the documented notify examples (docs/commands.md) work as written


def _readme_notify_examples() -> dict[str, list[str]]:
    import yaml

    text = (ROOT / "docs" / "commands.md").read_text().split("## Notifications (`notify`)", 1)[1]
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    examples, comment = {}, None
    for line in block.splitlines():
        if line.startswith("# "):
            comment = line[2:].split(":")[0]
        elif line.startswith("notify:"):
            examples[comment] = yaml.safe_load(line)["notify"]
    return examples


@pytest.fixture
def webhook():
    """A loopback HTTP server that records what is POSTed to it."""
    import http.server
    import threading

    received: list[tuple[str, bytes, str]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            received.append((self.path, body, self.headers.get("Content-Type", "")))
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", received
    server.shutdown()
    server.server_close()


PAYLOAD = {"instance": "gemma", "id": "abc", "kind": "livelock", "confidence": "high", "bundle": "/b/gemma-1"}


async def test_readme_ntfy_and_slack_examples_post_the_incident(webhook):
    """The ntfy and Slack examples, pointed at a loopback server, post what they promise."""
    import shutil

    from mlxwatch.daemon.notify import run_notify

    url, received = webhook
    examples = _readme_notify_examples()
    assert set(examples) == {"ntfy", "Slack incoming webhook", "macOS notification"}
    ntfy = [url + "/my-mlx-topic" if a.startswith("https://ntfy.sh/") else a for a in examples["ntfy"]]
    slack = [url + "/slack" if a.startswith("https://hooks.slack.com/") else a for a in examples["Slack incoming webhook"]]
    slack[0] = sys.executable  # "python3" as written; this interpreter is one
    if shutil.which("curl"):
        assert await run_notify(ntfy, "captured", PAYLOAD)
        path, body, _ = received.pop(0)
        assert path == "/my-mlx-topic" and json.loads(body)["kind"] == "livelock"
    assert await run_notify(slack, "captured", PAYLOAD)
    path, body, ctype = received.pop(0)
    assert path == "/slack" and ctype == "application/json"
    assert json.loads(body) == {"text": "mlxwatch gemma: captured livelock /b/gemma-1"}


async def test_readme_macos_notification_example_passes_the_text_as_an_argument(tmp_path, monkeypatch):
    """The osascript example (run with a stand-in osascript): the text is an argument of the
    run handler, never spliced into the AppleScript."""
    from mlxwatch.daemon.notify import run_notify

    fake = tmp_path / "bin" / "osascript"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(tmp_path / 'args.json')!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    argv = _readme_notify_examples()["macOS notification"]
    argv[0] = sys.executable  # /usr/bin/python3 on a Mac
    assert await run_notify(argv, "gave_up", {**PAYLOAD, "instance": 'evil" & do shell script "x'})
    args = json.loads((tmp_path / "args.json").read_text())
    assert args == ["-e", "on run a", "-e", 'display notification (item 1 of a) with title "mlxwatch"', "-e", "end run",
                    'evil" & do shell script "x: gave_up livelock']


# --- more of what a newcomer trips over


def test_capture_says_what_to_do_when_py_spy_is_refused(tmp_path, sleeper, monkeypatch, capsys):
    """Measured: py-spy's "Failed to get process executable name" passed on verbatim, exit 0, no hint."""
    from mlxwatch.capture import Bundle, Classification

    async def fake_capture(request, on_step=None):
        manifest = {"steps": [{"name": "stacks", "outcome": "failed",
                               "error": "snapshot 1: exit 1: Error: Failed to get process executable name. "
                                        "Check that the process is running."}]}
        return Bundle(tmp_path / "b", Classification("unknown", "low", ["x"]), manifest)

    monkeypatch.setattr("mlxwatch.capture.capture_bundle", fake_capture)
    monkeypatch.setattr("mlxwatch.doctor.read_ptrace_scope", lambda: 1)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.run(["capture", str(sleeper), "--force", "--out", str(tmp_path), "--json"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("mlxwatch: capture --force: PID") and "capturing it anyway" in err[0]
    assert err[1].startswith("mlxwatch: capture: no Python stacks: kernel.yama.ptrace_scope is 1")
    assert "sudo setcap cap_sys_ptrace+ep" in err[1]


def test_resume_json_and_what_it_says_about_the_state(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\ninstances: [{{name: gemma, url: 'http://127.0.0.1:1'}}]\n")
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "state.json").write_text('{"instances": {"gemma": {"state": "gave_up"}}}')
    assert cli.run(["resume", "gemma", "--config", str(cfg), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data == {"instance": "gemma", "request": str(tmp_path / "state" / "resume" / "gemma"), "state": "gave_up",
                    "daemon_running": False, "state_dir": str(tmp_path / "state")}
    assert cli.run(["resume", "gemma", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "no daemon runs on" in out and "not given up" not in out


def test_demo_keep_says_what_was_kept(tmp_path):
    """Measured: `demo --keep` ended with "the server and model are gone" when they were kept."""
    from mlxwatch.demo import demo_result
    from mlxwatch.journal.incidents import Incident, Journal
    from mlxwatch.output.demo import render_demo_report

    for with_incident in (False, True):
        if with_incident:
            Journal(tmp_path).record("recovered", Incident("demo", kind="livelock", seconds_to_recovery=12.0))
        for kept, expected in ((tmp_path / "server", f"its log and the model are kept in {tmp_path / 'server'}"),
                               (None, "the model removed")):
            console = Console(file=io.StringIO(), width=300)
            render_demo_report(demo_result(Journal(tmp_path), tmp_path, kept), console)
            text = console.file.getvalue()
            assert expected in text and "are gone" not in text


async def test_after_recovery_status_shows_the_recovery_probe(tmp_path):
    """Measured: after a recovery `status` said healthy with "last probe: failed". A daemon
    watching a stand-in that hangs, then answers again after the restart: healthy and ok."""
    import asyncio

    from mlxwatch.capture import Bundle, Classification
    from mlxwatch.config import Config, InstanceConfig, RestartConfig
    from mlxwatch.daemon.status import collect_status
    from mlxwatch.output.status import status_lines
    from mlxwatch.daemon.supervisor import Daemon
    from mlxwatch.journal.incidents import Journal
    from mlxwatch.restart.methods import OK, RestartOutcome

    port = free_port()
    mode = tmp_path / "mode"
    mode.write_text("hang")
    standin = subprocess.Popen([sys.executable, STANDIN, "--ports", str(port),
                                "--mode-file", str(mode)], stdout=subprocess.PIPE, text=True)
    try:
        assert standin.stdout.readline().strip() == "ready"

        async def capture(request):
            return Bundle(tmp_path / "b", Classification("blocked", "high", []), {})

        async def restart(ctx):
            mode.write_text("ok")
            return RestartOutcome(OK, "stand-in answers again")

        # A long interval: the recovery probe is the last one before the daemon is stopped (a
        # later probe on a loaded machine could fail its deadline and be what status shows). A
        # failed probe's stream is read until `timeout`: 2.5 s, not 4, before each verdict.
        probe = ProbeConfig(interval=30.0, suspect_interval=0.1, first_token_timeout=2.0, timeout=2.5, failures=1,
                            endpoint_timeout=1.0, startup_timeout=30.0)
        cfg = Config(None, (InstanceConfig("gemma", f"http://127.0.0.1:{port}", None, None, probe,
                                           RestartConfig("command", argv=("true",), backoff=0.1)),),
                     tmp_path / "state", (), CaptureConfig())
        daemon = Daemon(cfg, cfg.state_dir, shared_overrides={"capture_fn": capture, "restart_fn": restart})
        stop = asyncio.Event()
        task = asyncio.create_task(daemon.run(stop))
        journal = Journal(cfg.state_dir)
        deadline = time.monotonic() + 60
        while not any(r["event"] == "recovered" for r in journal.records()):
            assert time.monotonic() < deadline and not task.done(), [r["event"] for r in journal.records()]
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 30)
    finally:
        standin.kill()
        standin.wait(10)
        standin.stdout.close()
    (inst,) = collect_status(cfg, cfg.state_dir)["instances"]
    assert inst["state"] == "healthy" and inst["last_probe"]["ok"] is True
    text = "\n".join(t.plain for t in status_lines(collect_status(cfg, cfg.state_dir), 80))
    assert "last probe:" not in text and "recovered" in text


def test_status_names_the_state_a_clean_stop_interrupted(tmp_path):
    """An incident a SIGTERM interrupted is shown at the state it was in, not at "interrupted"."""
    from mlxwatch.config import Config, InstanceConfig
    from mlxwatch.daemon.status import collect_status
    from mlxwatch.output.status import status_lines
    from mlxwatch.journal.incidents import Incident, Journal

    inc = Incident("gemma")
    Journal(tmp_path).record("restarting", inc, state="restarting")
    Journal(tmp_path).record("interrupted", inc, state="restarting")
    status = collect_status(Config(instances=(InstanceConfig("gemma", "http://127.0.0.1:1"),)), tmp_path)
    assert status["instances"][0]["open_incident"]["stopped_at_event"] == "restarting"
    text = "\n".join(t.plain for t in status_lines(status, 200))
    assert f"gemma: incident {inc.id} open: daemon stopped at restarting" in text


def test_capture_of_an_instance_with_no_config_names_the_missing_file(tmp_path, capsys, monkeypatch):
    """Found by a new user: `capture --instance nope` with no config said
    `mlxwatch: None: instances: no instance named 'nope' (known: none)`."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MLXWATCH_CONFIG", raising=False)
    line = one_line_error(capsys, cli.run(["capture", "--instance", "nope"]), ["capture"], 2, "file not found")
    assert str(tmp_path / ".config" / "mlxwatch" / "config.yaml") in line and "None" not in line


def test_status_only_reads_it_creates_no_state_dir(tmp_path, capsys, monkeypatch):
    """Found by a new user: `status --state-dir /nonexist/x` created it, parents included, and
    plain `status` created ~/.local/state/mlxwatch: a command that only reads wrote."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.delenv("MLXWATCH_CONFIG", raising=False)
    where = tmp_path / "none" / "x"
    assert cli.run(["status", "--state-dir", str(where)]) == 1
    assert cli.run(["status"]) == 1
    assert "daemon not running" in capsys.readouterr().out
    assert not (tmp_path / "none").exists() and not (tmp_path / "home").exists()


def test_stderr_and_stdout_of_a_launchd_like_process_rotate_together(tmp_path):
    """As under launchd (stdout and stderr to one file): after rotation both write to the new file."""
    log = tmp_path / "daemon.log"
    script = ("import logging, sys\n"
              "from mlxwatch.daemon.selflog import RotatingStderr\n"
              "h = RotatingStderr(max_bytes=400, keep=2)\n"
              "logging.basicConfig(level=logging.INFO, handlers=[h])\n"
              "for i in range(20):\n"
              "    logging.getLogger('t').info('event %02d %s', i, 'x' * 30)\n"
              "print('stdout after', flush=True)\n"
              "assert h.rotations >= 1\n")
    with open(log, "ab") as out:
        proc = subprocess.run([sys.executable, "-c", script], stdout=out, stderr=out, timeout=60)
    assert proc.returncode == 0, log.read_text()
    text = log.read_text()
    assert "event 19" in text and "stdout after" in text
    assert (tmp_path / "daemon.log.1").exists() and "event 00" not in text


def test_status_says_when_kernel_sight_is_unavailable():
    """An instance whose server's per-client byte counts cannot be read (no sock_diag, no nettop)
    is judged by its probe alone: status says so on one line; with kernel sight, nothing more."""
    from mlxwatch.output.status import status_lines

    blind = {**_instance("blind"), "kernel_sight": "sock_diag unavailable: PermissionError: refused"}
    seeing = {**_instance("seeing"), "kernel_sight": "ok"}
    lines = [t.plain for t in status_lines(_status(instances=[blind, seeing]), 80)]
    said = [line for line in lines if "kernel sight" in line]
    assert len(said) == 1 and said[0].startswith("  no kernel sight (sock_diag unavailable: PermissionError: refused)")
