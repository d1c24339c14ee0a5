"""The newcomer's path fits 80 columns (issue 29, item 5): the README tour's commands, every
``--help``, and ``status``, ``doctor``, ``config validate`` and ``resume`` in their usual states
print no line over 80 columns, on an 80-column terminal and, for those four, piped too (a log,
a mail, an issue); a long line is reflowed, never cut, so no count is lost.

Measured before: `status`'s front door line cut (`…last token 35.2s ago, 113 ok, 1…`: the
failed-loudly and refused counts lost), its first line cut with the daemon stopped; `doctor`'s
server line 138 columns, `config validate` 233, `resume` 150 (127 piped)."""

from __future__ import annotations

import argparse
import io
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from rich.console import Console
from test_cli import make_bundle, no_user_config  # noqa: F401 - no_user_config: autouse fixture
from test_cli_newcomer import ANSI

import mlxwatch.cli as cli
from mlxwatch.output.status import render_status
from lab.ports import free_port

WIDTH = 80


def _console(terminal: bool) -> Console:
    """What the CLI prints to: an 80-column terminal, or a pipe (rich's default width, 80)."""
    return Console(file=io.StringIO(), width=WIDTH, force_terminal=terminal, color_system=None,
                   highlight=False, soft_wrap=True)


def _lines(console: Console) -> list[str]:
    return [piece for line in console.file.getvalue().splitlines() for piece in ANSI.split(line)]


def _too_wide(console: Console) -> list[str]:
    return [f"{len(line)}: {line}" for line in _lines(console) if len(line) > WIDTH]


@pytest.fixture
def short_tmp() -> Path:
    """A directory with a path as short as the tour's /tmp/tour (pytest's own are over 60
    characters: a path longer than a line overflows whole, by design)."""
    path = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    yield path
    shutil.rmtree(path)


def _tour_config(tmp_path: Path, port: int) -> Path:
    """The README tour's config, in a directory of its own."""
    tour = tmp_path / "tour"
    cfg = tmp_path / "tour.yaml"
    cfg.write_text(f"state_dir: {tour / 'state'}\ninstances:\n  - name: lab\n"
                   f"    url: http://127.0.0.1:{port}\n    log: {tour / 'lab' / 'server.log'}\n"
                   f"    pid_file: {tour / 'lab' / 'server.pid'}\n"
                   "    probe: {interval: 5s, suspect_interval: 2s, first_token_timeout: 5s, timeout: 10s, failures: 2}\n"
                   "    restart:\n"
                   f"      command: [{tour / '.venv' / 'bin' / 'python'}, tests/lab/cli.py, relaunch, {tour / 'lab'}]\n"
                   f"    front: {{listen: \"127.0.0.1:{free_port()}\"}}\n")
    return cfg


def _run_both(argv: list[str], codes: tuple[int, ...] = (0, 1)) -> tuple[Console, Console]:
    tty, pipe = _console(True), _console(False)
    for console in (tty, pipe):
        code = cli.run(argv, out=console)
        assert code in codes, (argv, code, console.file.getvalue())
    return tty, pipe


@pytest.mark.parametrize("command", [
    ["status"], ["doctor"], ["config", "validate"], ["resume", "lab"],
], ids=" ".join)
def test_the_four_commands_fit_80_columns_on_a_terminal_and_piped(command, short_tmp):
    """With the tour's config and no daemon: each line fits, on a terminal and piped."""
    cfg = _tour_config(short_tmp, free_port())
    tty, pipe = _run_both(["--config", str(cfg), *command])
    assert not _too_wide(tty), "\n".join(_lines(tty))
    assert not _too_wide(pipe), "\n".join(_lines(pipe))


def test_doctor_keeps_every_word_of_a_finding_and_its_fix(short_tmp):
    """Reflowed, not cut: the fix of the server finding is all there, on lines of its own."""
    cfg = _tour_config(short_tmp, free_port())
    _, pipe = _run_both(["--config", str(cfg), "doctor"])
    text = " ".join(pipe.file.getvalue().split())
    assert "fix: start the server, or fix the instance's url (http://127.0.0.1:" in text, text
    assert "[Errno" not in text  # the OS's own words, the path named once


def _front_status(running: bool = True, **front) -> dict:
    now = time.time()
    outcomes = {"ok": 113, "cancelled": 11, "failed_loudly": 19, "refused_restarting": 16, "replayed": 18,
                "rejected": 2}
    inst = {"name": "gemma-3-27b-it-qat-4bit", "configured": True, "state": "healthy", "failures": 0,
            "restarts_in_window": 1, "budget": 3,
            "last_probe": {"at": now - 1.4, "ok": True, "reason": None, "ttft": 0.009, "total": 0.1, "tokens": 4},
            "front": {"listen": "127.0.0.1:8081", "gate": "open", "in_flight": 0, "last_token_at": now - 35.2,
                      "outcomes": outcomes, **front},
            "last_incident": {"detected_at": now - 37.7, "kind": "livelock", "event": "recovered",
                              "seconds_to_recovery": 28.4},
            "open_incident": None}
    return {"state_dir": "/Users/someone/.local/state/mlxwatch", "state_problem": None, "config": "c.yaml",
            "daemon": {"running": running, "pid": 31015, "stalled": False, "updated_at": now - 300},
            "instances": [inst]}


@pytest.mark.parametrize("running", [True, False], ids=["daemon running", "daemon stopped"])
@pytest.mark.parametrize("gate", ["open", "restarting"])
def test_status_keeps_every_front_door_count(running, gate):
    """Measured: `…last token 35.2s ago, 113 ok, 1…`. Every count is shown, on a terminal and piped."""
    status = _front_status(running, gate=gate)
    for terminal in (True, False):
        console = _console(terminal)
        render_status(status, console)
        assert not _too_wide(console), "\n".join(_lines(console))
        rows = [line for line in _lines(console) if not line.startswith("gemma-3-27b-it-qat-")]
        text = " ".join(" ".join(rows).split())
        for count in ("113 ok", "11 cancelled", "19 failed loudly", "16 refused restarting", "18 replayed",
                      "2 rejected"):
            assert count in text, (count, text)
        assert "…" not in text, text
        assert "state in /Users/someone/.local/state/mlxwatch" in text


def test_status_first_line_with_the_daemon_stopped_is_whole(tmp_path):
    """Measured: cut on an 80-column terminal. Now it says what to do in the first 80 columns
    (the state dir, however long, on a line of its own)."""
    cfg = _tour_config(tmp_path, free_port())
    tty, pipe = _run_both(["--config", str(cfg), "status"])
    for console in (tty, pipe):
        first = _lines(console)[0]
        assert first.startswith("daemon not running") and first.endswith("start it with `mlxwatch run`"), first


def test_every_help_fits_80_columns(monkeypatch, capsys):
    """Every command's and subcommand's ``--help`` on an 80-column terminal."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    parser = cli.build_parser()
    paths: list[list[str]] = [[]]

    def walk(p: argparse.ArgumentParser, path: list[str]) -> None:
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    paths.append([*path, name])
                    walk(sub, [*path, name])

    walk(parser, [])
    assert len(paths) > 15
    for path in paths:
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([*path, "--help"])
        out = capsys.readouterr().out
        wide = [line for line in out.splitlines() if len(line) > WIDTH]
        assert not wide and out, (path, wide)


def test_the_tour_commands_fit_80_columns_on_a_terminal(short_tmp, standin):
    """The tour's `check` (healthy, then a server that never answers), `bundle list` and
    `status` of the tour's config: every line on an 80-column terminal."""
    [url], mode, _ = standin("ok")
    cfg = _tour_config(short_tmp, int(url.rsplit(":", 1)[1]))
    make_bundle(short_tmp / "tour" / "state" / "bundles", "lab")
    runs = [(["check", url], (0,))]
    for argv, codes in runs:
        tty, _ = _run_both(argv, codes)
        assert not _too_wide(tty), "\n".join(_lines(tty))
    mode.write_text("hang")
    for argv, codes in [(["check", url, "--first-token-timeout", "1s", "--timeout", "2s"], (1,)),
                        (["--config", str(cfg), "bundle", "list"], (0,)),
                        (["--config", str(cfg), "status"], (1,))]:
        tty, _ = _run_both(argv, codes)
        assert not _too_wide(tty), "\n".join(_lines(tty))
