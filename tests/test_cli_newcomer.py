"""What a newcomer stumbled on, measured on main ("One house", build item 7): capture finds the
configured instance behind a PID, output fits an 80-column terminal (and stays whole when piped),
bad input gets the documented exit code and a line that names the user's value, ``--out DIR`` is
created, negative durations and an empty ``--config`` are refused in one line, and ``run`` says
what it watches and when a starting server will first be judged."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console
from test_cli import make_bundle, no_user_config, one_line_error  # noqa: F401 - no_user_config: autouse fixture

import mlxwatch.cli as cli
from lab.ports import free_port

FAKE_SERVER = """\
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
print("fake mlx-lm server log line", flush=True)
http.server.HTTPServer(("127.0.0.1", port), http.server.BaseHTTPRequestHandler).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path):
    """A process whose command line is an mlx-lm server's (``python -m mlx_lm.server --port N``),
    listening on a loopback port and answering every request 501 at once; ended by its PID."""
    pkg = tmp_path / "fake" / "mlx_lm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "server.py").write_text(FAKE_SERVER)
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--port", str(port)], stdout=fh,
                                stderr=subprocess.STDOUT, cwd=tmp_path / "fake")
    deadline = time.monotonic() + 30
    from mlxwatch.host.process import own_listeners

    while not own_listeners(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield proc.pid, port, log
    proc.kill()
    proc.wait(10)


def _config(tmp_path: Path, port: int, log: Path | None = None, name: str = "lab") -> Path:
    cfg = tmp_path / "c.yaml"
    log_line = f"    log: {log}\n" if log else ""
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\ninstances:\n  - name: {name}\n"
                   f"    url: http://127.0.0.1:{port}\n{log_line}"
                   "    probe: {first_token_timeout: 2s, timeout: 3s}\n")
    return cfg


def _capture_json(capsys, argv: list[str]) -> tuple[dict, str]:
    """The manifest a --json capture printed, and its stderr."""
    code = cli.run(argv, out=Console(file=io.StringIO()))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out), captured.err


FAST = ["--snapshots", "1", "--spacing", "100ms", "--ceiling", "20s", "--stacks", "sample", "--json"]


@pytest.mark.parametrize("how", ["pid", "pid and url"])
def test_capture_of_a_pid_uses_the_configured_instance_at_its_address(how, tmp_path, fake_server, capsys):
    """Measured: `capture PID` ignored the config's instance at that PID's address (no log, a
    `pid-N` bundle) unless --instance was given. Now its name, log and URL are used."""
    pid, port, log = fake_server
    cfg = _config(tmp_path, port, log)
    argv = ["--config", str(cfg), "capture", str(pid), "--out", str(tmp_path / "out"), *FAST]
    if how == "pid and url":
        argv += ["--url", f"http://127.0.0.1:{port}/"]
    manifest, _ = _capture_json(capsys, argv)
    target = manifest["target"]
    assert target["label"] == "lab" and target["pid"] == pid
    assert target["url"] == f"http://127.0.0.1:{port}" and target["log"] == str(log)
    assert Path(manifest["path"]).name.startswith("lab-"), manifest["path"]


def test_capture_of_a_pid_without_a_matching_instance_stays_a_pid_bundle(tmp_path, fake_server, capsys):
    """An instance at another port is not this PID's: the bundle is named by the PID."""
    pid, port, log = fake_server
    cfg = _config(tmp_path, free_port(), log)
    manifest, _ = _capture_json(capsys, ["--config", str(cfg), "capture", str(pid), "--out", str(tmp_path / "o"), *FAST])
    assert manifest["target"]["label"] is None and manifest["target"]["log"] is None
    assert Path(manifest["path"]).name.startswith(f"pid-{pid}-")


# --- 80 columns on a terminal, whole lines when piped


def _console(terminal: bool) -> Console:
    return Console(file=io.StringIO(), width=80, force_terminal=terminal, color_system=None,
                   highlight=False, soft_wrap=True)


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")  # a live display moves the cursor: each piece is drawn apart


def _widest(console: Console) -> int:
    """The widest thing drawn on one line of the terminal."""
    return max(len(piece) for line in console.file.getvalue().splitlines() for piece in ANSI.split(line))


def test_check_fits_80_columns_on_a_terminal_and_keeps_whole_lines_piped(tmp_path):
    """Measured: `check` printed a 110-column reason line on an 80-column terminal."""
    url = f"http://127.0.0.1:{free_port()}"
    tty, pipe = _console(True), _console(False)
    assert cli.run(["check", url], out=tty) == 1 and cli.run(["check", url], out=pipe) == 1
    assert _widest(tty) <= 80, tty.file.getvalue()
    assert "nothing is listening at this address" in " ".join(tty.file.getvalue().split())
    lines = pipe.file.getvalue().splitlines()
    assert any(line.startswith(f"unhealthy {url}: ") and line.endswith("nothing is listening at this address")
               for line in lines), lines
    assert not any(line.endswith("…") for line in lines)


def test_bundle_list_fits_80_columns_and_keeps_every_name_whole(tmp_path):
    """Measured: `bundle list` printed 128-column rows. On a terminal each name stays whole (it is
    what `bundle show NAME` takes); piped, one row per bundle as before."""
    root = tmp_path / "b"
    names = [make_bundle(root, "gemma-3-27b-it-qat-4bit").name, make_bundle(root, "lab", "generation_thread_died").name]
    tty, pipe = _console(True), _console(False)
    assert cli.run(["bundle", "list", "--dir", str(root)], out=tty) == 0
    assert cli.run(["bundle", "list", "--dir", str(root)], out=pipe) == 0
    assert _widest(tty) <= 80, tty.file.getvalue()
    tty_words = tty.file.getvalue().split()
    assert all(name in tty_words for name in names)
    rows = [line for line in pipe.file.getvalue().splitlines() if line.startswith("2026-")]
    assert len(rows) == 2 and all(any(row.endswith(name) for row in rows) for name in names)


def test_capture_fits_80_columns_on_a_terminal(tmp_path, fake_server):
    """Measured: `capture` printed 81-90 column lines (evidence, the bundle's path)."""
    pid, port, log = fake_server
    out_dir = tmp_path / "a-rather-long-directory-name-for-bundles" / "and-another-level-below-it"
    cfg = _config(tmp_path, port, log, name="gemma-3-27b-it-qat-4bit-on-the-big-mac")
    tty = _console(True)
    code = cli.run(["--config", str(cfg), "capture", str(pid), "--out", str(out_dir), *FAST[:-1]], out=tty)
    assert code == 0
    assert _widest(tty) <= 80, tty.file.getvalue()
    bundle = next(p for p in out_dir.iterdir() if not p.name.startswith("."))
    assert str(bundle) in "".join(tty.file.getvalue().split())  # folded, never cut


# --- exit codes and messages for bad input


def test_unwritable_out_is_exit_2_naming_the_users_path(tmp_path, sleeper, capsys):
    """Measured: an unwritable --out exited 1 naming a hidden `.partial` path."""
    if os.geteuid() == 0:
        target = Path("/sys/kernel")  # root writes anywhere a mode allows: sysfs refuses it all the same
        if not target.is_dir():
            pytest.skip("no /sys/kernel here")
    else:
        target = tmp_path / "readonly"
        target.mkdir()
        target.chmod(0o500)
    argv = ["capture", str(sleeper), "--force", "--out", str(target), "--snapshots", "1", "--ceiling", "5s"]
    code = cli.run(argv, out=Console(file=io.StringIO()))
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if "--force" not in x]
    assert code == 2 and len(line) == 1, err
    assert str(target) in line[0] and ".partial" not in line[0], line[0]


def _full_disk_line(capsys, code: int) -> str:
    """The one error line of a capture that met a full disk (the target note aside)."""
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if ": capture: PID " not in x]
    assert code == 2 and len(lines) == 1, err  # exit 2, "cannot write the output" (docs/commands.md)
    assert "Traceback" not in err and ".partial" not in lines[0], err
    return lines[0]


def test_a_full_disk_under_the_bundles_dir_is_exit_2_naming_it(tmp_path, fake_server, full_disk, capsys):
    """Measured with 8 KB free (capture.min_free_bytes: 1KB): `capture PID` printed `mlxwatch: No
    space left on device`, naming no path, and exited 1, the code for "no such process". Now:
    exit 2, one line naming the bundles dir, and no partial bundle left holding the space."""
    pid, port, log = fake_server
    cfg = _config(tmp_path, port, log)
    cfg.write_text(cfg.read_text() + "capture: {min_free_bytes: 1KB}\n")
    bundles = tmp_path / "state" / "bundles"
    disk = full_disk(bundles, free=2000)
    code = cli.run(["--config", str(cfg), "capture", str(pid), *FAST], out=Console(file=io.StringIO()))
    line = _full_disk_line(capsys, code)
    assert line.startswith(f"mlxwatch: {bundles}: no space left on device writing "), line
    assert disk.refused >= 1 and list(bundles.iterdir()) == []


def test_a_full_disk_under_the_out_archive_is_exit_2_naming_it(tmp_path, fake_server, full_disk, capsys):
    """The bundle is written, its `--out NAME.tar.gz` meets a full disk: exit 2 with a line naming
    the --out given (write(2)'s error names no file), and no cut-short archive left under the
    name (a retry would be refused: "exists; not overwriting")."""
    pid, port, log = fake_server
    cfg = _config(tmp_path, port, log)
    cfg.write_text(cfg.read_text() + "capture: {min_free_bytes: 1KB}\n")
    archive = tmp_path / "exports" / "hang.tar.gz"
    archive.parent.mkdir()
    disk = full_disk(archive.parent, free=100)
    code = cli.run(["--config", str(cfg), "capture", str(pid), "--out", str(archive), *FAST],
                   out=Console(file=io.StringIO()))
    line = _full_disk_line(capsys, code)
    assert line == (f"mlxwatch: capture: --out {archive}: cannot write there: {os.strerror(errno.ENOSPC)}; "
                    "free some space there or give another directory"), line
    assert disk.refused == 1 and list(archive.parent.iterdir()) == []
    assert len(list((tmp_path / "state" / "bundles").iterdir())) == 1  # the bundle itself is kept


def test_capture_out_dir_is_created_with_its_parents(tmp_path, fake_server, capsys):
    """Measured: `capture --out DIR` refused a directory that did not exist yet. Now it is made
    (with its parents, like mkdir -p) once the capture is sure to run, and stderr says so."""
    pid, port, log = fake_server
    out_dir = tmp_path / "new" / "bundles"
    manifest, err = _capture_json(capsys, ["capture", str(pid), "--out", str(out_dir), *FAST])
    assert Path(manifest["path"]).parent == out_dir
    assert f"created {out_dir}" in err


def test_capture_out_dir_is_not_created_when_the_capture_is_refused(tmp_path, sleeper, capsys):
    """A refused PID leaves no directory behind."""
    out_dir = tmp_path / "new" / "bundles"
    code = cli.run(["capture", str(sleeper), "--out", str(out_dir)], out=Console(file=io.StringIO()))
    one_line_error(capsys, code, [], 2, "is not an mlx-lm server")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv", [
    ["check", "http://127.0.0.1:1", "--timeout", "-5s"],
    ["check", "http://127.0.0.1:1", "--timeout=-5s"],
    ["capture", "1", "--spacing", "-5s"],
    ["status", "--watch", "-5s"],
])
def test_a_negative_duration_gets_the_duration_message(argv, capsys):
    """Measured: `--timeout -5s` said "expected one argument" (argparse took -5s for an option)."""
    code = cli.run(argv, out=Console(file=io.StringIO()))
    option = next(a for a in argv if a.startswith("--")).split("=")[0]
    one_line_error(capsys, code, argv, 2,
                   f"argument {option}: must be a duration such as 30, 30s, 5m or 1h (got '-5s')")


def test_zero_duration_says_positive(capsys):
    code = cli.run(["check", "http://127.0.0.1:1", "--timeout", "0"], out=Console(file=io.StringIO()))
    one_line_error(capsys, code, [], 2, "argument --timeout: must be a positive duration (got '0')")


@pytest.mark.parametrize("argv", [["--config", "", "status"], ["status", "--config", ""], ["--config=", "doctor"],
                                  ["check", "--config", "", "--instance", "x"]])
def test_an_empty_config_is_refused(argv, capsys):
    """Measured: `--config ""` silently used the default config."""
    code = cli.run(argv, out=Console(file=io.StringIO()))
    one_line_error(capsys, code, argv, 2, "--config is empty")


@pytest.mark.parametrize("argv", [["run", "--state-dir", ""], ["status", "--state-dir="], ["doctor", "--state-dir", ""],
                                  ["bundle", "list", "--dir", ""], ["capture", "1", "--out", ""],
                                  ["bundle", "export", "x", "--out", ""], ["config", "init", "--out", ""]])
def test_an_empty_path_is_refused(argv, capsys, tmp_path, monkeypatch):
    """Measured by a new user: `--state-dir ""`, `--dir ""` and `--out ""` silently used the
    default place (while `--config ""` was refused)."""
    monkeypatch.chdir(tmp_path)
    code = cli.run(argv, out=Console(file=io.StringIO()))
    option = next(a for a in argv if a.startswith("--")).split("=")[0]
    one_line_error(capsys, code, argv, 2, f"{option} is empty: give a path, or leave {option} out for the default")


@pytest.mark.parametrize(("argv", "env", "says"), [
    (["config", "validate", ""], {}, "config validate: PATH is empty"),
    (["config", "validate"], {"MLXWATCH_CONFIG": ""}, "$MLXWATCH_CONFIG: set but empty"),
    (["status"], {"MLXWATCH_CONFIG": ""}, "$MLXWATCH_CONFIG: set but empty")])
def test_an_empty_config_path_anywhere_is_refused(argv, env, says, capsys, tmp_path, monkeypatch):
    """Found by a new user: `config validate "$UNSET"` and `MLXWATCH_CONFIG=` validated the
    default config and said ok, exit 0, where `--config ""` was refused."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("MLXWATCH_CONFIG", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = cli.run(argv, out=Console(file=io.StringIO()))
    one_line_error(capsys, code, argv, 2, says)



# --- run: what it watches, when it first probes, when a loading server is first judged


@pytest.mark.parametrize("seen", [False, True], ids=["a server first seen now", "one an earlier run saw healthy"])
def test_run_says_what_it_watches_and_when_a_starting_server_is_judged(tmp_path, fake_server, monkeypatch, seen):
    """Measured: a first `run` on defaults said nothing for minutes with no word why. Now, as it
    starts: the URL, when the first probe comes, and for a server younger than startup_timeout
    the wall time before which no verdict is drawn. Found by a new user: a `run` over the very
    process an earlier run had seen healthy said "no verdict before" a time, then gave one at
    once (rightly: that process is not loading); now it says a failed probe counts at once."""
    import types
    import logging
    from datetime import datetime

    import psutil

    pid, port, log = fake_server

    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    class FakeDaemon:  # the plan is said once the daemon has started its watchers; the daemon is not the point
        def __init__(self, config, state_dir):
            self.tasks = {}
            # a watcher restores the process an earlier run saw healthy from state.json
            self.watchers = {"lab": types.SimpleNamespace(identity=types.SimpleNamespace(alive=lambda: True))} if seen else {}

        async def run(self, stop, reload, load_config):
            self.tasks = {"lab": None}
            deadline = time.monotonic() + 30
            while len(said) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    monkeypatch.setattr("mlxwatch.daemon.supervisor.Daemon", FakeDaemon)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"state_dir: {tmp_path / 'state'}\ninstances: [{{name: lab, url: 'http://127.0.0.1:{port}'}}]\n")
    root, plan_log = logging.getLogger(), logging.getLogger("mlxwatch.run")
    handlers, level = root.handlers[:], root.level
    plan_log.addHandler(Said())
    try:
        assert cli.run(["run", "--config", str(cfg)]) == 0
    finally:
        plan_log.handlers.clear()
        root.handlers[:] = handlers
        root.setLevel(level)
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.NOTSET)
    err = "\n".join(said)
    until = datetime.fromtimestamp(psutil.Process(pid).create_time() + 600).strftime("%H:%M:%S")
    assert f"lab: watching http://127.0.0.1:{port}: first probe within 5s, then every 30s" in err, err
    if seen:
        assert f"lab: server PID {pid} was seen healthy by an earlier run: a failed probe counts at once" in err, err
        assert "no verdict before" not in err, err
    else:
        assert f"lab: server PID {pid} started" in err and f"no verdict before {until} (startup_timeout 10m)" in err, err
