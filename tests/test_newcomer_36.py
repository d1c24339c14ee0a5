"""What a newcomer tripped on in issue 36's round, each measured on main before its fix:
contradicting flags that let the last one win, a status that could not read its state dir
without a fix, a typo'd key never named, missing-config lines without `run`'s hint, long paths
indented past 80 columns, and a non-mlx server on an instance's port taken for a crashed one."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest
from rich.console import Console
from test_cli import make_bundle, no_user_config, one_line_error  # noqa: F401 - no_user_config: autouse fixture

import mlxwatch.cli as cli
from lab.ports import free_port


# --- contradicting flags: refused, exit 2, one line (the last one won)


def test_export_with_redact_and_no_redact_is_refused(tmp_path, capsys):
    """Measured: `bundle export X --redact --no-redact` exited 0 and wrote an unredacted archive."""
    bundle = make_bundle(tmp_path / "bundles")
    for flags in (["--redact", "--no-redact"], ["--no-redact", "--redact"]):
        argv = ["bundle", "export", str(bundle), *flags, "--out", str(tmp_path / "out")]
        code = cli.run(argv, out=Console(file=io.StringIO()))
        line = one_line_error(capsys, code, argv, 2, "contradict")
        assert "--redact" in line and "--no-redact" in line
    assert not (tmp_path / "out").exists() and not list(tmp_path.rglob("*.tar.gz"))
    # the same form twice is still one wish
    argv = ["bundle", "export", str(bundle), "--redact", "--redact", "--out", str(tmp_path / "out")]
    assert cli.run(argv, out=Console(file=io.StringIO())) == 0
    (archive,) = (tmp_path / "out").glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        assert any(m.name.endswith("manifest.json") for m in tar.getmembers())


def test_config_init_with_out_and_print_is_refused(tmp_path, capsys):
    """Found looking for other such pairs: `config init --out FILE --print` went on to print
    (--print wins) and ignored --out without a word."""
    argv = ["config", "init", "--out", str(tmp_path / "c.yaml"), "--print"]
    code = cli.run(argv, out=Console(file=io.StringIO()))
    one_line_error(capsys, code, argv, 2, "--out and --print")
    assert not (tmp_path / "c.yaml").exists()



@pytest.mark.parametrize("argv, fragment", [
    (["--config", "{a}", "config", "validate", "{b}"], "config validate: PATH {b} and --config {a}"),
    (["config", "init", "--out", "{b}", "--config", "{a}"], "config init: --out {b} and --config {a}"),
])
def test_two_config_files_for_one_command_are_refused(argv, fragment, tmp_path, capsys):
    """Found looking for other such pairs: with two config files one was silently ignored
    (`mlxwatch --config A config validate B` checked B and said ok). (`launchd plist --config`
    is the agent's config, another role: it may differ from mlxwatch's, as test_launchd says.)"""
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    for path in (a, b):
        path.write_text("instances:\n  - name: lab\n    url: http://127.0.0.1:8080\n")
    argv = [x.format(a=a, b=b) for x in argv]
    code = cli.run(argv, out=Console(file=io.StringIO()))
    one_line_error(capsys, code, argv, 2, fragment.format(a=a, b=b))
    same = [x.replace(str(b), str(a)) for x in argv]  # the same file twice is one wish
    cli.run(same, out=Console(file=io.StringIO()))
    assert "two config files" not in capsys.readouterr().err

# --- a typo'd key is named


def test_a_typod_required_key_is_named(tmp_path, capsys):
    """Measured: `urll:` with no `url:` was reported only as "url: is required"."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("instances:\n  - name: lab\n    urll: http://127.0.0.1:8080\n")
    argv = ["config", "validate", str(cfg)]
    line = one_line_error(capsys, cli.run(argv, out=Console(file=io.StringIO())), argv, 2, "instances[0].urll")
    assert "did you mean url?" in line and "instances[0].url is required" in line


def test_a_typod_optional_key_says_what_it_was_meant_to_be(tmp_path, capsys):
    """`intervall:` was "unknown key" without the key it was meant to be."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("instances:\n  - name: lab\n    url: http://127.0.0.1:8080\n    probe: {intervall: 5s}\n"
                   "  - name: two\n    url: http://127.0.0.1:8081\n    kernal: auto\n")
    argv = ["config", "validate", str(cfg)]
    line = one_line_error(capsys, cli.run(argv, out=Console(file=io.StringIO())), argv, 2, "probe.intervall")
    assert "unknown key" in line and "did you mean interval?" in line
    cfg.write_text("instances:\n  - name: two\n    url: http://127.0.0.1:8081\n    kernal: auto\n")
    line = one_line_error(capsys, cli.run(argv, out=Console(file=io.StringIO())), argv, 2, "instances[0].kernal")
    assert "did you mean kernel?" in line
    cfg.write_text("instances:\n  - name: two\n    url: http://127.0.0.1:8081\n    zebra: 1\n")
    line = one_line_error(capsys, cli.run(argv, out=Console(file=io.StringIO())), argv, 2, "instances[0].zebra")
    assert "did you mean" not in line  # nothing close: no guess


# --- a missing config: every command gives `run`'s hint


@pytest.mark.parametrize("argv", [
    ["config", "validate", "{missing}"],
    ["check", "--config", "{missing}", "--instance", "lab"],
    ["launchd", "plist", "--config", "{missing}"],
    ["run", "--config", "{missing}"],
])
def test_a_missing_config_says_how_to_write_one(argv, tmp_path, capsys):
    """Measured: `config validate`, `check --instance` and `launchd plist` said only "file not
    found", where `run` said to run `mlxwatch config init`."""
    missing = tmp_path / "nope.yaml"
    argv = [a.replace("{missing}", str(missing)) for a in argv]
    line = one_line_error(capsys, cli.run(argv, out=Console(file=io.StringIO())), argv, 2, str(missing))
    assert f"`mlxwatch config init --out {missing}`" in line and "mlxwatch config example" in line


@pytest.mark.parametrize("argv", [["config", "validate"], ["check", "--instance", "lab"], ["launchd", "plist"],
                                  ["run"]])
def test_the_default_config_missing_says_config_init(argv, tmp_path, capsys):
    """At the default path, `config init` writes there by itself: the hint says just that."""
    line = one_line_error(capsys, cli.run(argv, out=Console(file=io.StringIO())), argv, 2, "config.yaml")
    assert "`mlxwatch config init`" in line and "mlxwatch config example" in line


# --- a state dir status cannot read: one line, exit 2 as documented, with the fix, in run's words


def _as_a_user(argv: list[str], home: Path) -> subprocess.CompletedProcess:
    """``mlxwatch ARGV`` as a process the file modes apply to: root drops the capabilities that
    let it read anything (setpriv), anyone else runs as is."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root without setpriv: file modes do not apply to this process")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    env = {**os.environ, "HOME": str(home), "XDG_STATE_HOME": str(home / "state")}
    env.pop("MLXWATCH_CONFIG", None)
    return subprocess.run([*prefix, sys.executable, "-m", "mlxwatch", *argv], capture_output=True, text=True,
                          timeout=120, env=env)


def test_status_of_a_state_dir_that_is_a_file_says_so_with_the_fix(tmp_path, capsys):
    """Measured: `status --state-dir FILE` said `FILE/state.json: cannot read: Not a directory`,
    exit 2, no fix."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for argv in (["status", "--state-dir", str(afile)], ["status", "--json", "--state-dir", str(afile)]):
        line = one_line_error(capsys, cli.run(argv, out=Console(file=io.StringIO())), argv, 2,
                              f"cannot use the state dir {afile}: {afile} is not a directory")
        assert "give --state-dir" in line


@pytest.mark.parametrize("what", ["state dir", "state.json"])
def test_status_of_an_unreadable_state_says_so_with_the_fix(what, tmp_path):
    """Measured: a state dir status could not enter said `state.json: cannot read: Permission
    denied`, exit 2 without a fix; a state.json it could not read said "daemon not running
    (none has left a record)", exit 1, as if there were none. Now both are `run`'s line."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.json").write_text('{"instances": {}}')
    locked = state if what == "state dir" else state / "state.json"
    locked.chmod(0)
    try:
        proc = _as_a_user(["status", "--state-dir", str(state)], tmp_path / "home")
    finally:
        locked.chmod(0o700)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"mlxwatch: cannot use the state dir {state}: {state / 'state.json'}: "
                               "Permission denied; run mlxwatch as the user the daemon runs as"), lines[0]
    assert "Traceback" not in proc.stderr


# --- line width: a long path stands flush left, so lines stay within 80 columns


@pytest.fixture
def path_72() -> Path:
    """A directory whose files (``lab/server.log``, ``c.yaml``) have paths of 72 characters, as
    the newcomer's did; removed after."""
    root = Path(tempfile.mkdtemp(prefix="w", dir="/tmp"))
    deep = root / ("d" * (72 - len(str(root / "x" / "lab" / "server.log")) + 1))
    (deep / "lab").mkdir(parents=True)
    (deep / "lab" / "server.log").write_text("")
    assert len(str(deep / "lab" / "server.log")) == 72
    yield deep
    shutil.rmtree(root)


@pytest.mark.parametrize("command", [["doctor"], ["config", "validate"]], ids=" ".join)
@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "piped"])
def test_long_paths_stand_flush_left_within_80_columns(command, terminal, path_72):
    """Measured: a 72-character path indented 19 columns in `doctor` (and in `config validate`)
    made lines of 91 to 111 columns. Every path stays whole, on a line of its own."""
    log = path_72 / "lab" / "server.log"
    cfg = path_72 / ("c" * (72 - len(str(path_72)) - 6) + ".yaml")
    assert len(str(cfg)) == 72
    cfg.write_text(f"state_dir: {path_72 / 'state'}\ninstances:\n  - name: lab\n    url: http://127.0.0.1:{free_port()}\n"
                   f"    log: {log}\n    restart:\n      command: [{log}, relaunch, {log}]\n")
    console = Console(file=io.StringIO(), width=80, force_terminal=terminal, color_system=None, highlight=False,
                      soft_wrap=True)
    assert cli.run(["--config", str(cfg), *command], out=console) in (0, 1)
    lines = console.file.getvalue().splitlines()
    assert not [line for line in lines if len(line) > 80], "\n".join(lines)
    for path in (str(log), str(cfg)):  # never broken
        assert any(path in line for line in lines), (path, "\n".join(lines))


# --- the demo's log never breaks a path


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "piped"])
def test_the_demo_log_never_breaks_a_bundle_path(terminal):
    """Measured: the demo's log (rich's log handler) folded a bundle's path in the middle of its
    name at the message column's edge."""
    from mlxwatch.output.demo import DemoView

    console = Console(file=io.StringIO(), width=80, force_terminal=terminal, color_system=None, highlight=False,
                      soft_wrap=True)
    bundle = "/tmp/mlxwatch-demo-k2j4h5/state/bundles/20261207T010203Z-demo-livelock"
    handler = DemoView(console).log_handler()
    record = logging.LogRecord("mlxwatch.watchdog", logging.WARNING, __file__, 1,
                               "%s: evidence bundle written in 5.6s: %s (livelock, high confidence)",
                               ("demo", bundle), None)
    handler.handle(record)
    lines = console.file.getvalue().splitlines()
    assert any(bundle in line for line in lines), "\n".join(lines)
    assert not [line for line in lines if len(line) > 80], "\n".join(lines)
    assert "WARNING" in lines[0] and "(livelock, high confidence)" in " ".join(" ".join(lines).split())


# --- a non-mlx HTTP server on an instance's port


@pytest.fixture
def http_server():
    """``python3 -m http.server`` on a loopback port (it answers a POST with a 9-line HTML page,
    501), ended by its PID."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    from mlxwatch.host.process import own_listeners

    deadline = time.monotonic() + 30
    while not own_listeners(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield proc, f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(10)


def test_check_of_a_non_mlx_server_says_what_answered_in_one_line(http_server, capsys):
    """Measured: `check` printed http.server's raw 9-line HTML error page as the reason."""
    _, url = http_server
    console = Console(file=io.StringIO(), width=10**4, color_system=None, highlight=False, soft_wrap=True)
    assert cli.run(["check", url, "--timeout", "5s"], out=console) == 1
    lines = console.file.getvalue().splitlines()
    reason = lines[0]
    assert "<" not in console.file.getvalue(), "\n".join(lines)
    assert "HTTP 501 with an HTML page (Unsupported method ('POST').)" in reason
    assert "another program answers at this URL" in reason
    assert any(line.split() == ["/v1/models", "404", "an", "HTML", "page", "(File", "not", "found.)"] for line in lines)


async def test_the_daemon_calls_a_non_mlx_server_on_the_port_port_taken_not_crashed(tmp_path, http_server, caplog):
    """Measured: with http.server on an instance's port, `status` showed the HTML page with `?`
    for its newlines, every log line carried it, and the instance was "down (crashed)", its bundle
    `crashed, high confidence`, while the daemon's own log said another program holds the port."""
    from test_daemon_core import Running, config

    from mlxwatch.config import RestartConfig
    from mlxwatch.daemon.status import collect_status
    from mlxwatch.output.status import render_status

    proc, url = http_server
    cfg = config(tmp_path / "state", url, RestartConfig())
    with caplog.at_level(logging.INFO, logger="mlxwatch"):
        async with Running(cfg) as run:
            await run.until(lambda: "captured" in run.events(), what="the capture")
            captured = next(r for r in run.journal.records() if r["event"] == "captured")
            console = Console(file=io.StringIO(), width=80, color_system=None, highlight=False, soft_wrap=True)
            render_status(collect_status(cfg, cfg.state_dir), console)
    manifest = json.loads((Path(captured["bundle"]) / "manifest.json").read_text())
    assert manifest["classification"]["kind"] == "port_taken", manifest["classification"]
    assert any(f"taken by PID {proc.pid}" in line for line in manifest["classification"]["evidence"])
    shown = console.file.getvalue()
    assert "down (port taken)" in shown and "crashed" not in shown, shown
    assert "<" not in shown and "?" not in shown.replace("?)", ""), shown
    assert "an HTML page (Unsupported method ('POST').)" in " ".join(shown.split()), shown
    for record in caplog.records:
        assert "<" not in record.getMessage() and "\n" not in record.getMessage(), record.getMessage()
    assert proc.poll() is None  # never signalled


# --- two daemons, two state dirs, one server: the second is refused


async def test_a_second_daemon_on_the_same_server_is_refused(tmp_path, standin):
    """Measured: two daemons with different state dirs watching one URL were not noticed: both
    probed it and both would capture and restart it. Now the second is refused, naming the
    first (its PID, state dir and instance), whatever loopback spelling its config uses; once
    the first stops, it starts."""
    from test_daemon_core import Running, config

    from mlxwatch.daemon.supervisor import Daemon
    from mlxwatch.errors import StateError

    (url,), _, _ = standin("ok")
    port = url.rsplit(":", 1)[1]
    first = config(tmp_path / "one", url, name="big")
    async with Running(first):
        for spelling in (url, f"http://localhost:{port}/", f"http://[::ffff:127.0.0.1]:{port}"):
            second = config(tmp_path / "two", spelling, name="other")
            with pytest.raises(StateError) as refused:
                await asyncio.wait_for(Daemon(second, second.state_dir).run(asyncio.Event()), 60)  # else: ran on
            said = str(refused.value)
            assert said.startswith(f"{spelling} is already watched by another mlxwatch daemon (PID {os.getpid()}, "
                                   f"state dir {tmp_path / 'one'}, instance big)"), said
            assert "stop that daemon, or remove this instance from one of the two configs" in said
            assert not (tmp_path / "two" / "journal.jsonl").exists()  # refused before it probed or wrote
    async with Running(config(tmp_path / "two", url, name="other")) as again:
        await again.until(lambda: (again.daemon.state.instance("other").get("last_probe") or {}).get("ok"),
                          what="a healthy probe by the second daemon")


async def test_a_reload_that_adds_a_server_another_daemon_watches_is_refused(tmp_path, standin):
    """The same rule at a SIGHUP: the old config is kept, and the reload says why."""
    from dataclasses import replace

    from test_daemon_core import FAST, Running, config

    from mlxwatch.config import InstanceConfig

    (url, other_url), _, _ = standin("ok", ports=2)
    async with Running(config(tmp_path / "one", url, name="big")):
        cfg = config(tmp_path / "two", other_url, name="mine")
        async with Running(cfg) as run:
            run.cfg = replace(cfg, instances=(*cfg.instances, InstanceConfig("theirs", url, None, None, FAST)))
            run.reload.set()
            await run.until(lambda: "last_reload" in run.daemon.state.data["daemon"]
                            and run.daemon.state.data["daemon"]["last_reload"] is not None, what="the reload")
            reload = run.daemon.state.data["daemon"]["last_reload"]
            assert reload["ok"] is False and f"{url} is already watched by another mlxwatch daemon" in reload["message"]
            assert list(run.daemon.watchers) == ["mine"]


def _held_by_another(url: str) -> bool:
    from mlxwatch.errors import StateError
    from mlxwatch.journal.serverlock import ServerLocks

    locks = ServerLocks(Path("/nonexistent"))
    try:
        locks.take(url, "test")
    except StateError:
        return True
    locks.release()
    return False


def test_run_refuses_a_server_another_daemon_watches_exit_2_one_line(tmp_path, standin):
    """`mlxwatch run` as users start it: exit 2, one line naming the other daemon."""
    (url,), _, _ = standin("ok")
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    configs = []
    for name in ("one", "two"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"state_dir: {tmp_path / name}\ninstances:\n  - name: {name}\n    url: {url}\n")
        configs.append(path)
    first = subprocess.Popen([sys.executable, "-m", "mlxwatch", "--config", str(configs[0]), "run"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not _held_by_another(url):  # the first daemon holds the server
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.poll() else ""
            time.sleep(0.1)
        second = subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(configs[1]), "run"], env=env,
                                capture_output=True, text=True, timeout=120)
    finally:
        first.terminate()
        first.wait(30)
        first.stderr.close()
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stderr
    assert lines[0].startswith(f"mlxwatch: {url} is already watched by another mlxwatch daemon (PID {first.pid}, "
                               f"state dir {tmp_path / 'one'}, instance one)"), lines[0]


# --- the front door under hostile clients


async def test_a_full_door_refuses_an_upload_on_its_length_before_its_body():
    """Measured: a full door (front.max_buffered) refused uploads mid-body, after 6-14 MiB of
    them were sent: bytes were held as they arrived, so every upload passed the check of its
    Content-Length at its head. Now a body is held whole on its length: one that does not fit
    is refused before a byte of it is sent, and one that fits is never refused half-way."""
    from test_front_door import Upstream, _door, _read_response, _split, _until

    kib = 1024
    async with Upstream() as up, _door(up, max_body=700 * kib, max_buffered=1000 * kib) as door:
        first_r, first_w = await asyncio.open_connection(*door.address)
        first_w.write(b"POST /plain HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % (700 * kib))
        await _until(lambda: door.buffered == 700 * kib, "the first upload's 700 KiB held on its length")
        second_r, second_w = await asyncio.open_connection(*door.address)
        second_w.write(b"POST /plain HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % (500 * kib))
        refused = await asyncio.wait_for(_read_response(second_r), 15)  # answered with no byte of its body sent
        first_w.write(b"a" * (700 * kib))  # the upload that fits goes through whole
        answered = await asyncio.wait_for(_read_response(first_r), 15)
        for writer in (first_w, second_w):
            writer.close()
        await _until(lambda: door.buffered == 0, "every byte given back")
    line, headers, body = _split(refused)
    assert line.split(" ")[1] == "503" and json.loads(body)["error"]["code"] == "mlxwatch_door_full", refused[:300]
    assert answered.startswith(b"HTTP/1.1 201 ") and len(up.seen) == 1 and len(up.seen[0].body) == 700 * kib


class _Firehose:
    """A server that streams SSE tokens of ``pad`` bytes each as fast as its client takes them,
    until the client goes: a healthy server that a slow client holds back."""

    def __init__(self, pad: int = 16 * 1024) -> None:
        self.token = ("x" * pad)
        self.server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> "_Firehose":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from test_front_door import _chunk

        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            chunk = _chunk(self.token)
            while True:
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def _slow_client(door) -> socket.socket:
    """A client that sends a streaming request, then takes nothing of its answer (for now)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, door.address)
    body = b'{"stream": true, "max_tokens": 9}'
    await asyncio.get_running_loop().sock_sendall(
        sock, b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    return sock


async def test_a_client_reading_slowly_is_no_stall_of_the_server():
    """Measured: a client that read its stream slowly made the door journal `front_stall` ("no
    token delivered to anyone for 10-12 s: suspect") while the server streamed to it fine: the
    door stops reading the server for a client that takes nothing (backpressure), so no token
    reached it. Such a request waits on its client, not on the server."""
    from test_front_door import _cfg, _until

    from mlxwatch.evidence.door import stall_of
    from mlxwatch.front.door import FrontDoor

    async with _Firehose() as up:
        door = FrontDoor("t", up.url, _cfg(stall_timeout=1.0, request_stall_timeout=1.0))
        await door.start()
        sock = await _slow_client(door)
        try:
            await _until(lambda: door.view().tokens_total > 0, "the first tokens")
            await _until(lambda: time.monotonic() - door.view().last_token_mono > 2.0,
                         "the client's backpressure holding the server's tokens back for 2 s")
            view = door.view()
            assert len(view.in_flight) == 1, view  # still in flight: not failed as a stalled request
            assert stall_of(view, time.monotonic(), 1.0) is None
            before = view.tokens_total
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while door.view().tokens_total == before:  # the client reads: the server's tokens flow again
                assert loop.time() < deadline, "no token once the client read"
                await asyncio.wait_for(loop.sock_recv(sock, 65536), 15)
        finally:
            sock.close()
            await door.stop(drain=0.5)
        assert door.view().outcomes["failed_loudly"] == 0


async def test_a_request_its_client_closed_mid_body_is_counted():
    """Measured: 3,072 connections whose client closed mid-body were counted in no outcome. A
    request sent in part (head or body) and closed by its client counts as cancelled; one the
    door cut off for time still counts once, as timeout."""
    from test_front_door import Upstream, _door, _until

    async with Upstream() as up, _door(up) as door:
        for partial in (b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Length: 1000\r\n\r\n{\"str",
                        b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nConte"):
            for _ in range(3):
                _, writer = await asyncio.open_connection(*door.address)
                writer.write(partial)
                await writer.drain()
                writer.close()
        await _until(lambda: door.view().outcomes["cancelled"] == 6, "six requests cancelled by their clients")
        outcomes = dict(door.view().outcomes)
    assert outcomes["cancelled"] == 6 and sum(outcomes.values()) == 6, outcomes
    assert up.seen == []


async def test_a_request_the_door_cut_off_for_time_is_counted_once(monkeypatch):
    """A head the door cut off at its deadline is `timeout`, and not `cancelled` as well when
    the connection then closes."""
    from test_front_door import Upstream, _door, _until

    import mlxwatch.front.door as door_module

    monkeypatch.setattr(door_module, "HEAD_TIMEOUT", 1.0)
    async with Upstream() as up, _door(up) as door:
        reader, writer = await asyncio.open_connection(*door.address)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nConte")
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 15) == b""  # closed by the door at the deadline
        writer.close()
        await _until(lambda: sum(door.view().outcomes.values()) >= 1, "the cut-off counted")
        outcomes = dict(door.view().outcomes)
    assert outcomes["timeout"] == 1 and sum(outcomes.values()) == 1, outcomes


def test_status_with_no_instance_still_says_the_state_file_is_damaged(tmp_path):
    """Found beside the unreadable state.json: with no instance configured, a damaged
    state.json was not mentioned at all (only "daemon not running (none has left a record)")."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.json").write_text("{not json")
    console = Console(file=io.StringIO(), width=80, color_system=None, highlight=False, soft_wrap=True)
    assert cli.run(["status", "--state-dir", str(state)], out=console) == 1
    text = " ".join(console.file.getvalue().split())
    assert "state file is unreadable (JSONDecodeError); the daemon rebuilds it from the journal" in text, text
