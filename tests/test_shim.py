"""The launch shim without MLX: a stand-in ``mlx_lm`` (tests/shim_standin.py) run through the
real ``mlxwatch launch``, the reader, the capture and daemon logic on top of it, and the shim's
promise to import nothing but the standard library. Real servers: tests/test_shim_real.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from mlxwatch import stacks
from mlxwatch.capture import CaptureRequest, capture_bundle, collector, pyspy
from mlxwatch.capture.classify import Evidence, classify
from mlxwatch.capture.results import ProcessResult
from mlxwatch.errors import UsageError
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.shim import dumps, heartbeat, layout
from mlxwatch.shim.launcher import BOOT_DIR, check_python_flags, clean_runtime_dir, plan
from mlxwatch.shim.stacks import ShimFindings, ShimWindow, dumps_are_over, parse_dump
from mlxwatch.shim.watch import ShimWatch

sys.path.insert(0, str(Path(__file__).parent))
from shim_standin import write_standin
from test_time import HOUR, step_psutils_clock

ROOT = Path(__file__).resolve().parent.parent
SHIM_DIR = ROOT / "mlxwatch" / "shim"
OLD_PYTHON = ROOT / ".venvs" / "mlx-lm-0.31.3" / "bin" / "python"
PROGRAM = "import mlx_lm.server as s; s.main()"


class Standin:
    """One stand-in server started through `mlxwatch launch`; only its own PID is ever signalled."""

    def __init__(self, tmp: Path, *, mode: str = "work", style: str = "31", seam: bool = True,
                 launch_args: tuple[str, ...] = (), argv: list[str] | None = None, env: dict | None = None,
                 stay: bool = False) -> None:
        self.root = write_standin(tmp / "pkg", seam)
        self.mode_file = tmp / "mode"
        self.mode_file.write_text(mode)
        self.run_dir = tmp / "run"
        self.log = tmp / "server.log"
        full_env = {**os.environ, "PYTHONPATH": str(self.root), "STANDIN_MODE_FILE": str(self.mode_file),
                    "STANDIN_STYLE": style, layout.RUNTIME_ENV: str(self.run_dir), "PYTHONUNBUFFERED": "1",
                    **({"STANDIN_STAY": "1"} if stay else {}), **(env or {})}
        command = argv or [sys.executable, "-c", PROGRAM]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "mlxwatch", "launch", *launch_args, "--", *command],
                                         stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        self.pid = self.proc.pid
        self.create_time = psutil.Process(self.pid).create_time()

    def set_mode(self, mode: str) -> None:
        tmp = self.mode_file.with_suffix(".tmp")
        tmp.write_text(mode)
        os.replace(tmp, self.mode_file)

    def heartbeat(self) -> heartbeat.Heartbeat | None:
        hb, _ = heartbeat.read(self.pid, self.create_time, str(self.run_dir))
        return hb

    def wait_for(self, predicate, timeout: float = 15.0, what: str = "condition") -> heartbeat.Heartbeat:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hb = self.heartbeat()
            if hb is not None and predicate(hb):
                return hb
            time.sleep(0.1)
        raise AssertionError(f"{what} not seen in {timeout}s; last heartbeat: "
                             f"{self.heartbeat() and self.heartbeat().data}; log:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def standin(tmp_path, monkeypatch):
    started: list[Standin] = []
    monkeypatch.setenv(layout.RUNTIME_ENV, str(tmp_path / "run"))

    def start(**kw) -> Standin:
        server = Standin(tmp_path, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


# --- stdlib only


def _stdlib_only(names: list[str], python: str) -> list[str]:
    out = subprocess.run([python, "-c", "import sys, json; print(json.dumps(sorted(sys.stdlib_module_names)))"],
                         capture_output=True, text=True, check=True)
    stdlib = set(json.loads(out.stdout))
    return [n for n in names if n.split(".")[0] not in stdlib and not n.startswith("_mlxwatch_shim")
            and n != "__main__"]


@pytest.mark.parametrize("python", [sys.executable, str(OLD_PYTHON)], ids=["test-venv", "mlx-lm-0.31.3-venv"])
def test_the_shim_imports_only_the_standard_library_in_a_clean_interpreter(python, tmp_path):
    """Loaded by path, exactly as boot/sitecustomize does, in ``python -I -S`` (no site, no
    PYTHONPATH): the agent starts, publishes, and nothing outside the standard library (nor
    mlxwatch itself) is in sys.modules."""
    if not Path(python).exists():
        pytest.skip(f"{python} not installed")
    code = f"""
import importlib.util, json, os, sys, time
spec = importlib.util.spec_from_file_location("_mlxwatch_shim", {str(SHIM_DIR / '__init__.py')!r},
                                              submodule_search_locations=[{str(SHIM_DIR)!r}])
pkg = importlib.util.module_from_spec(spec); sys.modules["_mlxwatch_shim"] = pkg; spec.loader.exec_module(pkg)
from _mlxwatch_shim import agent
a = agent.start(env={{"MLXWATCH_RUNTIME_DIR": {str(tmp_path / 'run')!r}, "MLXWATCH_SHIM": "1"}})
deadline = time.time() + 10
while not os.path.exists(os.path.join({str(tmp_path / 'run')!r}, f"{{os.getpid()}}.json")) and time.time() < deadline:
    time.sleep(0.05)
print(json.dumps(sorted(sys.modules)))
"""
    out = subprocess.run([python, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    names = json.loads(out.stdout.strip().splitlines()[-1])
    assert _stdlib_only(names, python) == []
    assert "mlxwatch" not in names and "_mlxwatch_shim.agent" in names
    assert out.stderr == ""


def test_the_boot_module_adds_only_standard_library_modules(tmp_path):
    """Through ``mlxwatch launch`` with the site machinery on: what the shim adds to a plain
    interpreter start is stdlib only (compared with the same program run without it)."""
    program = "import sys, json, time; time.sleep(0.3); print(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, layout.RUNTIME_ENV: str(tmp_path / "run")}
    plain = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, check=True)
    shimmed = subprocess.run([sys.executable, "-m", "mlxwatch", "launch", "--", sys.executable, "-c", program],
                             capture_output=True, text=True, env=env, check=True)
    added = sorted(set(json.loads(shimmed.stdout)) - set(json.loads(plain.stdout)))
    assert "_mlxwatch_shim.agent" in added
    assert _stdlib_only([n for n in added if n != "sitecustomize"], sys.executable) == []  # sitecustomize: boot itself
    assert not any(n == "mlxwatch" or n.startswith("mlxwatch.") for n in added)


# --- the heartbeat on the stand-in


def test_heartbeat_counts_steps_tokens_and_requests_in_flight_and_keeps_the_pid(standin):
    s = standin()
    hb = s.wait_for(lambda h: h.tokens >= 10 and h.seam_ok, what="tokens")
    assert hb.pid == s.pid  # exec: the PID the launcher was started as is the server's
    assert psutil.Process(s.pid).cmdline()[:2] == [sys.executable, "-c"]
    assert hb.data["argv"][-1] == PROGRAM
    assert hb.steps >= 2 and hb.thread["name"] == "Thread-1 (_generate)"
    s.wait_for(lambda h: h.in_flight == 1, what="a request in flight")  # between requests it is 0
    assert hb.data["seam"]["where"][0] == "mlx_lm.generate.BatchGenerator.next"
    assert hb.prompt_tokens >= 3 and hb.loop["finished"] >= 1
    assert hb.stalled_for < 2 and not hb.stale
    later = s.wait_for(lambda h: h.published_at > hb.published_at and (h.tokens_per_s or 0) > 5, what="tokens/s")
    assert later.seq > hb.data["seq"] and later.tokens > hb.tokens  # advancing, about once a second
    s.set_mode("idle")
    s.wait_for(lambda h: h.in_flight == 0 and h.stalled_for == 0, what="idle")


def test_livelock_shows_steps_without_tokens_and_a_growing_stall(standin):
    s = standin()
    s.wait_for(lambda h: h.tokens > 0, what="tokens")
    switched = time.time()
    s.set_mode("spin")
    # A stall seen once the loop has stepped twice after a heartbeat published after the switch:
    # every step since spins (a loop starved of CPU before the switch also shows a stall, then
    # finishes the step that was in flight with tokens: seen once on a loaded machine).
    after = s.wait_for(lambda h: h.published_at > switched + 0.1, what="a heartbeat after the switch")
    first = s.wait_for(lambda h: h.steps > after.steps + 1 and h.stalled_for > 1.0, what="stall")
    second = s.wait_for(lambda h: h.published_at > first.published_at + 1, what="a later heartbeat")
    change = heartbeat.Change.between(first, second)
    assert change.steps > 10 and change.tokens == 0 and second.in_flight == 1
    assert second.stalled_for > first.stalled_for
    judged = ShimWatch(stall_timeout=1.0).judge(second)
    assert judged.stall and "no token" in judged.stall


def test_a_blocked_loop_freezes_the_heartbeat_counts_and_still_gives_stacks(standin):
    s = standin()
    s.wait_for(lambda h: h.tokens > 0, what="tokens")
    s.set_mode("block")
    hb = s.wait_for(lambda h: (h.in_step_for or 0) > 1.5, what="a long step")
    later = s.wait_for(lambda h: h.published_at > hb.published_at + 1, what="a later heartbeat")
    assert later.steps == hb.steps and not later.stale  # the publisher runs; the loop does not
    dump = heartbeat.request_stacks(later, ProcessIdentity.of(s.pid))
    assert dump.by == "thread"  # the GIL is free: no signal
    gen = stacks.generation_thread(parse_dump(dump.text, later.thread_names()))
    assert gen is not None and gen.name == "Thread-1 (_generate)"
    assert [f.name for f in gen.frames[:3]] == ["wait", "wait", "next"]  # Event().wait() inside next


def test_a_held_gil_stales_the_heartbeat_but_faulthandler_still_dumps(standin):
    s = standin()
    s.wait_for(lambda h: h.tokens > 0, what="tokens")
    s.set_mode("gil")
    time.sleep(0.5)
    deadline = time.monotonic() + 15
    while not s.heartbeat().stale:
        assert time.monotonic() < deadline, "heartbeat never went stale"
        time.sleep(0.2)
    hb = s.heartbeat()
    dump = heartbeat.request_stacks(hb, ProcessIdentity.of(s.pid))
    assert dump.by == "signal"  # from the C signal handler, the GIL held elsewhere
    gen = stacks.generation_thread(parse_dump(dump.text, hb.thread_names()))
    assert gen is not None and gen.frames[0].name == "next" and gen.frames[0].filename.endswith("generate.py")
    findings = ShimWindow(hb, hb).findings()
    assert findings.stale and "GIL" in findings.stale[0]


BUSY_THREADS = """
import threading, time
def busy():
    def down(n):
        return 0 if n == 0 else down(n - 1) + 1
    while True:
        down(30)
def come_and_go():
    while True:
        t = threading.Thread(target=sum, args=(range(100),))
        t.start()
        t.join()
for target in (busy,) * 2 + (come_and_go,) * 3:
    threading.Thread(target=target, daemon=True).start()
time.sleep(600)
"""


def test_many_dumps_of_a_busy_process_whose_threads_come_and_go_never_crash_it(standin):
    """CI saw an mlx-lm 0.31.3 server die right after a shim dump, twice: faulthandler's dump from
    the signal handler reads every thread's frames without the GIL while they change
    (python/cpython#116008). Dumped by the signal, this process died after 256 dumps (and after
    9 to 550 in ten more runs); the shim's dump thread takes them under the GIL."""
    s = standin(argv=[sys.executable, "-c", BUSY_THREADS])
    hb = s.wait_for(lambda h: h.dumps_offered, what="a heartbeat")
    identity = ProcessIdentity.of(s.pid)
    for i in range(1000):  # kept: the signal's dumps killed it after 9 to 550 in eleven runs; 1,000 is past them all
        dump = heartbeat.request_stacks(hb, identity)
        assert s.proc.poll() is None, f"the process died after {i + 1} dumps: {s.proc.returncode}"
    busy = [t for t in parse_dump(dump.text) if any(f.name == "busy" for f in t.frames)]
    assert len(busy) == 2
    assert os.path.getsize(hb.stacks_file) == 0  # no stack signal was sent


def test_the_dump_thread_comes_back_when_a_cleaner_removes_its_files(standin):
    s = standin()
    hb = s.wait_for(lambda h: h.tokens > 0, what="tokens")
    identity = ProcessIdentity.of(s.pid)
    old = os.stat(hb.ask_path).st_ino
    os.unlink(hb.ask_path)
    os.unlink(hb.answers_path)
    s.wait_for(lambda h: os.path.exists(h.ask_path) and os.stat(h.ask_path).st_ino != old, what="a new FIFO")
    dump = heartbeat.request_stacks(s.heartbeat(), identity)
    assert "in _generate" in dump.text and dump.by == "thread"
    s.wait_for(lambda h: [n for n, _ in h.thread_names().values()].count("mlxwatch-shim-dumps") == 1,
               what="the retired dump thread gone, one left")


@pytest.mark.parametrize("step", [1.0, HOUR])
def test_a_wall_clock_step_does_not_stop_stack_dumps_and_a_reused_pid_is_never_signalled(standin, monkeypatch,
                                                                                          step):
    """A capture in CI got 1 of 3 shim dumps with its stacks step 'ok'. Each dump request proved
    the PID by psutil's create time to within 1 s, which a clock step or NTP's correction of the
    boot time moves (psutil#2526): a live server became "another process now" for the rest of the
    capture. It is proven by its kernel start now, as every other identity check in mlxwatch."""
    s = standin()
    hb = s.wait_for(lambda h: h.tokens > 0, what="tokens")
    identity = ProcessIdentity.of(s.pid)
    step_psutils_clock(monkeypatch, step + 0.01)  # just over the old tolerance at 1 s
    assert "in _generate" in heartbeat.request_stacks(hb, identity).text
    reused = ProcessIdentity.from_dict({**identity.to_dict(), "started": identity.started + 5})
    size = os.path.getsize(hb.stacks_file)
    with pytest.raises(heartbeat.ShimError, match="another process now"):
        heartbeat.request_stacks(hb, reused)
    time.sleep(0.3)
    assert os.path.getsize(hb.stacks_file) == size  # no signal was sent


def test_python_dash_m_is_counted_too(standin):
    """``python -m mlx_lm.server`` runs the server as __main__: the class comes from
    mlx_lm.generate, patched when that module is imported."""
    s = standin(argv=[sys.executable, "-m", "mlx_lm.server"])
    hb = s.wait_for(lambda h: h.tokens >= 5, what="tokens")
    assert hb.data["seam"]["where"] == ["mlx_lm.generate.BatchGenerator.next"]


def test_requests_served_one_at_a_time_are_counted(standin):
    s = standin(mode="single")
    hb = s.wait_for(lambda h: h.tokens >= 30, what="tokens")
    assert hb.seam_ok


def test_a_module_without_the_seam_runs_unmodified_with_stacks_still_on(standin):
    s = standin(seam=False, stay=True)
    hb = s.wait_for(lambda h: h.seam_state == "unavailable", what="seam unavailable")
    assert "no BatchGenerator.next" in hb.seam_detail
    assert "in _generate" in heartbeat.request_stacks(hb, ProcessIdentity.of(s.pid)).text
    s.set_mode("stop")
    s.wait_for(lambda h: (h.thread or {}).get("end") in (None, "stopped"), what="stopped")
    log = s.log.read_text()
    assert log.count("mlxwatch shim:") == 1 and "heartbeat unavailable" in log
    findings = ShimWindow(hb, s.heartbeat()).findings()
    assert findings.notes and not (findings.livelock or findings.blocked or findings.busy)


def test_a_changed_return_shape_stops_counting_once(standin):
    s = standin()
    s.wait_for(lambda h: h.tokens > 0, what="tokens")
    s.set_mode("shape")
    hb = s.wait_for(lambda h: h.seam_state == "changed", what="seam changed")
    assert "not (prompt_responses, generation_responses)" in hb.seam_detail
    time.sleep(1.5)
    assert s.log.read_text().count("the heartbeat stops counting") == 1
    assert s.proc.poll() is None


@pytest.mark.parametrize("style, mode", [("31", "die"), ("32", "die"), ("31", "die_outside"), ("32", "die_outside")])
def test_exit_on_thread_death_exits_70_after_the_traceback_is_kept(standin, style, mode):
    s = standin(style=style, launch_args=("--exit-on-thread-death",), stay=True)
    s.wait_for(lambda h: h.tokens > 0, what="tokens")
    s.set_mode(mode)
    assert s.proc.wait(15) == layout.THREAD_DEATH_EXIT
    hb, _ = heartbeat.read(s.pid, None, str(s.run_dir))  # the process is gone; its heartbeat stays
    assert hb.thread_died
    exc = hb.thread_exception
    expected = "RuntimeError" if mode == "die" else "ValueError"
    assert exc["type"] == expected and expected in exc["traceback"]
    log = s.log.read_text()
    server_says = "generation thread died" if style == "32" else "Exception in thread Thread-1 (_generate)"
    assert log.index(server_says) < log.index("mlxwatch shim: the generation thread died")


def test_without_the_flag_a_dead_thread_is_reported_and_the_process_stays(standin):
    s = standin(style="32", stay=True)
    s.wait_for(lambda h: h.tokens > 0, what="tokens")
    s.set_mode("die")
    hb = s.wait_for(lambda h: h.thread_died, what="thread died")
    assert hb.thread_exception["type"] == "RuntimeError" and s.proc.poll() is None
    judged = ShimWatch().judge(hb)
    assert judged.stall and "died" in judged.stall
    f = ShimWindow(hb, hb).findings()
    assert f.dead and "RuntimeError" in f.dead[0]


def test_a_clean_stop_is_not_a_death(standin):
    s = standin(launch_args=("--exit-on-thread-death",), stay=True)
    s.wait_for(lambda h: h.tokens > 0, what="tokens")
    s.set_mode("stop")
    hb = s.wait_for(lambda h: (h.thread or {}).get("end") == "stopped", what="stopped")
    assert not hb.thread_died
    time.sleep(1.5)
    assert s.proc.poll() is None


def test_the_server_environment_is_given_back_and_children_do_not_load_the_shim(standin):
    program = ("import os, json, mlx_lm.server as s; print('ENV', json.dumps({k: os.environ.get(k) for k in "
               "('PYTHONPATH', 'MLXWATCH_SHIM', 'MLXWATCH_SHIM_BOOT')})); s.main()")
    s = standin(argv=[sys.executable, "-c", program])
    s.wait_for(lambda h: h.tokens > 0, what="tokens")
    line = next(ln for ln in s.log.read_text().splitlines() if ln.startswith("ENV "))
    env = json.loads(line[4:])
    assert env == {"PYTHONPATH": str(s.root), "MLXWATCH_SHIM": None, "MLXWATCH_SHIM_BOOT": None}


def test_a_sitecustomize_the_shim_hides_runs_first_and_its_patch_is_counted(standin, tmp_path):
    """Like the lab's fault injection: another sitecustomize replaces server.BatchGenerator with
    a subclass whose next() never calls the base. The shim runs it first and counts at the
    subclass, so its steps show."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text(
        "import os, mlx_lm.server as server\n"
        "print('OTHER SITECUSTOMIZE', flush=True)\n"
        "class Spinning(server.BatchGenerator):\n"
        "    def next(self):\n"
        "        import time; time.sleep(0.01)\n"
        "        return [], []\n"
        "server.BatchGenerator = Spinning\n")
    s = standin(env={"PYTHONPATH": f"{other}{os.pathsep}{tmp_path / 'pkg'}"})
    hb = s.wait_for(lambda h: h.steps > 20, what="steps")
    assert hb.tokens == 0 and hb.in_flight == 1
    assert "mlx_lm.server.BatchGenerator.next" in hb.data["seam"]["where"]
    assert "OTHER SITECUSTOMIZE" in s.log.read_text()


# --- capture and status on the stand-in


def test_capture_with_stacks_shim_needs_no_py_spy(standin, tmp_path, monkeypatch):
    monkeypatch.setattr(pyspy, "find_py_spy", lambda: None)
    s = standin()
    s.wait_for(lambda h: h.tokens > 0, what="tokens")
    s.set_mode("spin")
    s.wait_for(lambda h: h.stalled_for > 1, what="stall")
    bundle = asyncio.run(capture_bundle(CaptureRequest(pid=s.pid, out_dir=tmp_path / "bundles", snapshots=2,
                                                       spacing=0.5, ceiling=20, stacks="shim")))
    names = sorted(p.name for p in (bundle.path / "stacks").iterdir())
    assert names == ["shim-1.json", "shim-1.txt", "shim-2.json", "shim-2.txt"]
    assert "Thread-1 (_generate)" in (bundle.path / "stacks" / "shim-1.txt").read_text()
    assert (bundle.path / "shim" / "heartbeat-start.json").exists()
    c = bundle.classification
    assert c.kind == "livelock", c
    assert any(line.startswith("shim: the batch loop took") for line in c.evidence)
    summary = (bundle.path / "summary.md").read_text()
    assert "Launch shim heartbeat" in summary and "Snapshot 1" in summary
    assert bundle.manifest["settings"]["stacks"] == "shim"


def test_capture_auto_falls_back_to_py_spy_without_a_shim(tmp_path, monkeypatch):
    monkeypatch.setenv(layout.RUNTIME_ENV, str(tmp_path / "run"))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        calls = []
        monkeypatch.setattr(pyspy, "find_py_spy", lambda: calls.append(1))
        bundle = asyncio.run(capture_bundle(CaptureRequest(pid=proc.pid, out_dir=tmp_path / "b", snapshots=1,
                                                           ceiling=10, stacks="auto")))
        assert calls  # py-spy was asked for
        steps = {s["name"]: s for s in bundle.manifest["steps"]}
        assert steps["heartbeat"]["outcome"] == "skipped" and "no launch shim" in steps["heartbeat"]["error"]
        bundle2 = asyncio.run(capture_bundle(CaptureRequest(pid=proc.pid, out_dir=tmp_path / "b", snapshots=1,
                                                            ceiling=10, stacks="shim")))
        steps = {s["name"]: s for s in bundle2.manifest["steps"]}
        assert steps["stacks"]["outcome"] == "failed" and steps["stacks"]["error"].startswith("shim stacks: no shim")
    finally:
        proc.kill()
        proc.wait()


def test_status_shows_tokens_per_second_and_time_since_the_last_token(standin, tmp_path):
    from rich.console import Console

    from mlxwatch.config import Config, InstanceConfig
    from mlxwatch.daemon.status import collect_status
    from mlxwatch.output.status import render_status

    s = standin()
    s.wait_for(lambda h: (h.tokens_per_s or 0) > 0, what="tokens/s")
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "state.json").write_text(json.dumps({"instances": {"lab": {
        "state": "healthy", "server": {"pid": s.pid, "create_time": s.create_time, "cmdline": [], "address": None}}}}))
    status = collect_status(Config(instances=(InstanceConfig("lab", "http://127.0.0.1:1"),)), state_dir)
    shim = status["instances"][0]["shim"]
    assert shim["tokens_per_s"] > 0 and shim["since_last_token"] is not None and shim["seam"] == "ok"
    console = Console(record=True, width=100)
    render_status(status, console)
    text = console.export_text()
    assert "shim: " in text and "tok/s" in text and "last token" in text


# --- launch's checks


def _script(tmp_path: Path, first_line: str) -> str:
    path = tmp_path / "server-script"
    path.write_text(f"{first_line}\nprint('hi')\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("line, refused", [
    ("#!/usr/bin/python3", False),
    ("#!/usr/bin/python3 -I", True),
    ("#!/usr/bin/python3 -sE", True),
    ("#!/usr/bin/env python3", False),
    ("#!/usr/bin/env -S python3 -S", True),
    ("#!/bin/sh", False),
    ("#!/opt/venv/bin/python3.12 -u", False),
])
def test_a_script_whose_python_would_ignore_the_shim_is_refused(tmp_path, line, refused):
    path = _script(tmp_path, line)
    assert bool(check_python_flags(path, [path])) == refused


@pytest.mark.parametrize("argv, refused", [
    (["python3", "-m", "mlx_lm.server", "-I"], False),  # after -m: the server's own arguments
    (["python3", "-I", "-m", "mlx_lm.server"], True),
    (["python3", "-X", "faulthandler", "-E", "x.py"], True),
    (["python3", "-Wignore", "-u", "x.py"], False),
    (["python3", "-c", "import x", "-I"], False),
])
def test_a_python_command_line_that_would_ignore_the_shim_is_refused(argv, refused):
    assert bool(check_python_flags("/usr/bin/python3", argv)) == refused


def test_plan_puts_the_boot_dir_first_and_keeps_the_command(tmp_path):
    path = _script(tmp_path, "#!/usr/bin/python3")
    p = plan(["--", path, "--port", "8080"], name="big", exit_on_thread_death=True,
             environ={"PATH": "/usr/bin", "PYTHONPATH": "/mine", layout.RUNTIME_ENV: str(tmp_path / "run")})
    assert p.argv == [path, "--port", "8080"] and p.executable == path
    assert p.env["PYTHONPATH"] == f"{BOOT_DIR}{os.pathsep}/mine"
    assert p.env[layout.ACTIVE_ENV] == "1" and p.env[layout.NAME_ENV] == "big" and p.env[layout.EXIT_ENV] == "1"
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700 and not p.warnings
    with pytest.raises(UsageError, match="command not found"):
        plan(["no-such-server-here"], environ={"PATH": str(tmp_path)})
    with pytest.raises(UsageError, match="give the server command"):
        plan(["--"], environ={})


def test_plan_warns_but_still_runs_when_the_runtime_dir_is_not_private(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    path = _script(tmp_path, "#!/usr/bin/python3")
    p = plan([path], environ={"PATH": "/usr/bin", layout.RUNTIME_ENV: str(shared)})
    assert p.warnings and "open to other users" in p.warnings[0]
    hb, problem = heartbeat.read(os.getpid(), None, str(shared))
    assert hb is None and "open to other users" in problem


def test_cleanup_removes_only_files_of_long_gone_processes_and_our_own_pid(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    dead = 2**22 + 12345  # above any pid_max default: never alive
    for name in (f"{dead}.json", f"{dead}.stacks", f"{os.getpid()}.json", f"{os.getppid()}.json", "notes.txt"):
        (run / name).write_text("x")
    old = time.time() - layout.KEEP_DEAD_SECONDS - 10
    os.utime(run / f"{dead}.json", (old, old))
    removed = clean_runtime_dir(str(run), os.getpid())
    assert removed == 2
    assert sorted(p.name for p in run.iterdir()) == sorted([f"{dead}.stacks", f"{os.getppid()}.json", "notes.txt"])


def test_cleanup_lets_a_dead_process_recorded_requests_go_after_the_recorder_age_bound(tmp_path):
    """Users' words outlive their process no longer than a recorder would have kept them."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    dead = 2**22 + 12346
    for n, age in ((1, 700), (2, 100)):
        (run / f"{dead}.requests.{n}").write_text("x")
        os.utime(run / f"{dead}.requests.{n}", (time.time() - age, time.time() - age))
    (run / f"{os.getpid()}.requests.1").write_text("x")  # our PID: a process before us left it
    assert clean_runtime_dir(str(run), os.getpid()) == 2  # the default bound, front.record_max_age (10m)
    assert sorted(p.name for p in run.iterdir()) == [f"{dead}.requests.2"]
    assert clean_runtime_dir(str(run), os.getpid(), keep_requests=60.0) == 1


# --- the reader


def _write_heartbeat(directory: Path, file_pid: int, **over) -> None:
    directory.mkdir(mode=0o700, exist_ok=True)
    pid = file_pid
    data = {"format": layout.FORMAT, "pid": pid, "started_at": time.time(), "published_at": time.time(),
            "interval": 1.0, "seam": {"state": "ok"}, "loop": {"tokens": 5, "steps": 5, "in_flight": 0}, **over}
    (directory / f"{file_pid}.json").write_text(json.dumps(data))


@pytest.mark.parametrize("recorded", ["the server's", "none"])
async def test_a_pid_reused_since_the_capture_recorded_it_is_never_signalled(tmp_path, monkeypatch, recorded):
    """Found in review: the server SIGKILLed (its heartbeat stays on disk) and its PID reused by
    a process without the shim. The stacks step must not send that process the shim's signal,
    which would kill it, whether or not the capture could read the server's create time."""
    run = tmp_path / "run"
    monkeypatch.setenv(layout.RUNTIME_ENV, str(run))
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        earlier = psutil.Process(stranger.pid).create_time() - 600  # the server that had this PID
        _write_heartbeat(run, stranger.pid, started_at=earlier + 0.5, published_at=earlier + 60,
                         stacks={"signal": "SIGUSR2", "signum": int(signal.SIGUSR2),
                                 "file": str(run / f"{stranger.pid}.stacks")})
        (run / f"{stranger.pid}.stacks").write_text("")
        process = ProcessResult(info={"pid": stranger.pid, "errors": {},
                                      **({"create_time": earlier} if recorded != "none" else {})})
        result = await collector._shim_stacks(CaptureRequest(pid=stranger.pid, out_dir=tmp_path, snapshots=1,
                                                             spacing=0.1), stranger.pid, process, None,
                                              lambda: 0.0, [], required=True)
        time.sleep(0.3)
        assert stranger.poll() is None, f"the stranger was signalled ({stranger.returncode})"
        assert result.outcome == "failed" and not result.snapshots, result
    finally:
        stranger.kill()
        stranger.wait()


def test_a_server_that_died_unreaped_is_gone_and_the_dumps_stop(tmp_path):
    """A zombie runs no signal handler: its dump requests say "gone", which ends the step's
    schedule, rather than "another process now" for every remaining snapshot."""
    run = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        identity = ProcessIdentity.of(child.pid)
        _write_heartbeat(run, child.pid, stacks={"signal": "SIGUSR2", "signum": int(signal.SIGUSR2),
                                                 "file": str(run / f"{child.pid}.stacks")})
        (run / f"{child.pid}.stacks").write_text("")
        hb, _ = heartbeat.read(child.pid, None, str(run))
        deadline = time.monotonic() + 15
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.05)
        with pytest.raises(heartbeat.ShimError, match="is gone") as caught:
            heartbeat.request_stacks(hb, identity)
        assert dumps_are_over(caught.value)
    finally:
        child.kill()
        child.wait()


def test_a_heartbeat_is_taken_only_for_the_process_it_belongs_to(tmp_path):
    run = tmp_path / "run"
    me = psutil.Process()
    _write_heartbeat(run, me.pid, started_at=me.create_time() + 0.5)
    hb, problem = heartbeat.read(me.pid, me.create_time(), str(run))
    assert hb is not None and problem is None
    _write_heartbeat(run, me.pid, started_at=me.create_time() - 3600)  # an earlier process with this PID
    hb, problem = heartbeat.read(me.pid, me.create_time(), str(run))
    assert hb is None and "earlier process" in problem
    _write_heartbeat(run, me.pid, pid=1)
    assert "names PID 1" in heartbeat.read(me.pid, None, str(run))[1]
    _write_heartbeat(run, me.pid, format=99)
    assert "unknown format" in heartbeat.read(me.pid, None, str(run))[1]
    (run / f"{me.pid}.json").unlink()
    os.mkfifo(run / f"{me.pid}.json")  # never blocks on a FIFO
    assert "not a regular file" in heartbeat.read(me.pid, None, str(run))[1]


def test_a_stale_heartbeat_and_a_signal_that_is_not_offered(tmp_path):
    run = tmp_path / "run"
    _write_heartbeat(run, os.getpid(), published_at=time.time() - 30)
    hb, _ = heartbeat.read(os.getpid(), None, str(run))
    assert hb.stale and hb.age > 25
    with pytest.raises(heartbeat.ShimError, match="no stack signal"):
        heartbeat.request_stacks(hb, ProcessIdentity.of(os.getpid()))
    _write_heartbeat(run, os.getpid(), stacks={"signal": "SIGUSR2", "signum": 12, "file": "/etc/passwd"})
    hb, _ = heartbeat.read(os.getpid(), None, str(run))
    with pytest.raises(heartbeat.ShimError, match="outside its own dir"):
        heartbeat.request_stacks(hb, ProcessIdentity.of(os.getpid()))


def test_a_stopped_process_is_not_sent_the_signal_it_would_handle_on_resuming(standin, monkeypatch):
    """Found in review: a signal sent to a stopped process stays pending and is handled when it
    resumes, with every thread running: the unsafe case. It is not sent then."""
    monkeypatch.setattr(heartbeat, "ANSWER_QUIET", 1.5)  # a stopped process publishes nothing: 5 s was all waiting
    s = standin()
    hb = s.wait_for(lambda h: h.tokens > 0, what="tokens")
    os.kill(s.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while psutil.Process(s.pid).status() != psutil.STATUS_STOPPED:  # the stop is not instant
            assert time.monotonic() < deadline, "the process never stopped"
            time.sleep(0.05)
        with pytest.raises(heartbeat.ShimError, match="is stopped") as caught:
            heartbeat.request_stacks(hb, ProcessIdentity.of(s.pid))
        assert dumps_are_over(caught.value)
    finally:
        os.kill(s.pid, signal.SIGCONT)
    time.sleep(0.5)
    assert os.path.getsize(hb.stacks_file) == 0


def test_a_dump_thread_that_died_is_started_again_and_never_replaced_by_the_signal(standin, monkeypatch):
    """Found in review: a dump thread ended by a failed write (a full disk) was never started
    again, and every later dump went by the signal, which then killed the busy server. Here the
    server may write files of at most 24 KiB (its answers fill that in a few dumps): while it runs
    Python it is never signalled, and once there is room a new thread answers."""
    s = standin(argv=["bash", "-c", f"ulimit -f 24; exec {sys.executable} -c '{PROGRAM}'"])
    hb = s.wait_for(lambda h: h.tokens > 0 and h.ask_path is not None, what="the dump thread")
    identity = ProcessIdentity.of(s.pid)
    # The dead thread's dump is given up after ANSWER_LIMIT while heartbeats come: 6 s, not 10, still
    # past ANSWER_QUIET (5 s), so heartbeats that stopped would send the signal and fail the test.
    monkeypatch.setattr(heartbeat, "ANSWER_LIMIT", 6.0)
    failed = None
    for _ in range(40):
        try:
            assert heartbeat.request_stacks(hb, identity).by == "thread"
        except heartbeat.ShimError as exc:
            failed = exc
            break
    assert failed is not None and "not sent" in str(failed), failed
    assert os.path.getsize(hb.stacks_file) == 0 and s.proc.poll() is None
    os.truncate(hb.answers_path, 0)
    dump = heartbeat.request_stacks(s.heartbeat(), identity)
    assert dump.by == "thread" and "in _generate" in dump.text


def test_a_dump_thread_that_cannot_be_opened_is_tried_again_and_never_replaced_by_the_signal(standin, monkeypatch):
    """Found in review: when a new dump thread could not be opened, the heartbeat offered only
    the signal, and the reader sent it at once to the running process. Now the heartbeat says
    the thread is down (``ask: null``), the reader waits for evidence as for a slow thread, and
    the shim tries again each heartbeat. A FIFO put where the heartbeat's temp file goes does
    not stop the heartbeat either."""
    s = standin()
    hb = s.wait_for(lambda h: h.tokens > 0 and h.ask_path is not None, what="the dump thread")
    os.mkfifo(s.run_dir / f".{s.pid}.json.tmp")
    os.unlink(hb.answers_path)
    os.mkdir(hb.answers_path)  # the next dumper cannot open its answers file
    down = s.wait_for(lambda h: h.dump_thread_down, what="the thread down")
    assert down.stack_signal is not None and not down.stale
    monkeypatch.setattr(heartbeat, "ANSWER_LIMIT", 3.0)
    with pytest.raises(heartbeat.ShimError, match="not sent"):
        heartbeat.request_stacks(down, ProcessIdentity.of(s.pid))
    assert os.path.getsize(hb.stacks_file) == 0
    os.rmdir(hb.answers_path)
    back = s.wait_for(lambda h: h.ask_path is not None, what="the thread back")
    assert heartbeat.request_stacks(back, ProcessIdentity.of(s.pid)).by == "thread"


def test_a_partial_line_left_in_the_fifo_does_not_swallow_the_next_token(standin):
    s = standin()
    hb = s.wait_for(lambda h: h.tokens > 0, what="tokens")
    fd = os.open(hb.ask_path, os.O_WRONLY | os.O_NONBLOCK)
    os.write(fd, b"abc")  # no newline
    os.close(fd)
    started = time.monotonic()
    assert heartbeat.request_stacks(hb, ProcessIdentity.of(s.pid)).by == "thread"
    assert time.monotonic() - started < heartbeat.ANSWER_QUIET


def test_an_answer_is_taken_only_whole_and_only_for_its_own_token():
    body = 'Thread 0x0000000000000001 (most recent call first):\n  File "a.py", line 1 in f\n\n'
    torn = f"{dumps.HEADER} aa\n{body[:30]}"
    mine = f"\n{dumps.HEADER} bb cc\n{body}{dumps.FOOTER}"  # as the thread writes it
    assert heartbeat._answer_in(torn + mine, "cc") == body
    assert heartbeat._answer_in(torn + mine, "aa") is None  # cut: no footer before the next header
    assert heartbeat._answer_in(mine, "dd") is None
    assert heartbeat._answer_in(mine[:-5], "bb") is None  # not whole yet


def test_the_generation_thread_comes_first_so_a_thread_limit_never_leaves_it_out():
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait) for _ in range(dumps.MAX_THREADS + 20)]
    for t in threads:
        t.start()
    try:
        wanted = threads[-1].ident
        text = dumps.format_threads(sys._current_frames(), skip=threading.get_ident(), first=wanted)
    finally:
        stop.set()
        for t in threads:
            t.join()
    shown = parse_dump(text)
    assert len(shown) == dumps.MAX_THREADS and text.rstrip().endswith("...")
    assert text.startswith(f"Thread 0x{wanted:016x}")
    assert f"0x{threading.get_ident():016x}" not in text


@pytest.mark.parametrize("python_runs", [True, False])
def test_the_stack_signal_is_sent_only_when_no_python_thread_runs(tmp_path, monkeypatch, python_runs):
    """The signal's dump can crash a busy process, so it is sent only on evidence that no Python
    thread runs: no answer from the dump thread and no heartbeat published for ANSWER_QUIET.
    While heartbeats come, a dump thread slow to answer is waited for, then given up on, and the
    process is never signalled. (Here: a FIFO nobody answers, this process as the server.)"""
    run, pid = tmp_path / "run", os.getpid()
    files = {"ask": run / f"{pid}.ask", "answers": run / f"{pid}.answers", "file": run / f"{pid}.stacks"}
    offered = {"signal": "SIGUSR1", "signum": int(signal.SIGUSR1), **{k: str(v) for k, v in files.items()}}
    _write_heartbeat(run, pid, stacks=offered)
    os.mkfifo(files["ask"], 0o600)
    unanswered = os.open(files["ask"], os.O_RDONLY | os.O_NONBLOCK)
    files["answers"].write_text("")
    files["file"].write_text("")
    monkeypatch.setattr(heartbeat, "ANSWER_QUIET", 0.6)
    monkeypatch.setattr(heartbeat, "ANSWER_LIMIT", 2.0)
    signalled: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: signalled.append(signum))
    stop = threading.Event()
    publisher = threading.Thread(target=lambda: [_write_heartbeat(run, pid, stacks=offered)
                                                 for _ in iter(lambda: stop.wait(0.2), True)])
    try:
        hb, _ = heartbeat.read(pid, None, str(run))
        if python_runs:
            publisher.start()
            with pytest.raises(heartbeat.ShimError, match="the stack signal is not sent"):
                heartbeat.request_stacks(hb, ProcessIdentity.of(pid))
            assert signalled == []
        else:
            with pytest.raises(heartbeat.ShimError, match="no stack dump"):  # a Python handler writes none
                heartbeat.request_stacks(hb, ProcessIdentity.of(pid), timeout=0.5)
            assert signalled == [signal.SIGUSR1]
    finally:
        stop.set()
        if publisher.is_alive():
            publisher.join()
        signal.signal(signal.SIGUSR1, previous)
        os.close(unanswered)


# --- pure parts


DUMP = '''Thread 0x00007f3a2b7fe640 (most recent call first):
  File "/v/lib/python3.11/site-packages/mlx_lm/generate.py", line 1369 in _step
  File "/v/lib/python3.11/site-packages/mlx_lm/generate.py", line 1415 in next
  File "/opt/mlxwatch/shim/agent.py", line 489 in next
  File "/v/lib/python3.11/site-packages/mlx_lm/server.py", line 943 in _generate
  ...

Current thread 0x00007f3a3c1e8740 (most recent call first):
  File "/v/lib/python3.11/socketserver.py", line 233 in serve_forever
'''


def test_parse_faulthandler_dump_with_heartbeat_thread_names():
    threads = parse_dump(DUMP, {0x7f3a2b7fe640: ("Thread-1 (_run_generate)", 4242)})
    gen = stacks.generation_thread(threads)
    assert gen is not None and gen.os_thread_id == 4242
    assert [f.where for f in gen.frames] == ["_step (generate.py:1369)", "next (generate.py:1415)",
                                            "next (agent.py:489)", "_generate (server.py:943)"]
    assert threads[1].name == "thread 0x00007f3a3c1e8740" and threads[1].active


PROBE_FAILED = dict(probe_ran=True, probe_ok=False, probe_failure="no_first_token", health_status=200, models_status=200)


def test_the_classifier_takes_the_shims_evidence_and_says_so():
    spin = ShimFindings(present=True, livelock=["shim: the batch loop took 40 step(s) in 2.0s and emitted no token"])
    c = classify(Evidence(**PROBE_FAILED, process_cpu=95.0, shim=spin))
    assert c.kind == "livelock" and c.confidence == "high" and any(e.startswith("shim:") for e in c.evidence)
    c = classify(Evidence(**PROBE_FAILED, process_cpu=1.0, shim=spin))
    assert c.kind == "livelock" and c.confidence == "medium" and "idle" in c.competing[-1]
    busy = ShimFindings(present=True, busy=["shim: 120 token(s) delivered to other clients during the window"])
    c = classify(Evidence(**PROBE_FAILED, process_cpu=95.0, shim=busy, verdict="2 failed probes"))
    assert c.kind == "busy" and c.contradicts_verdict and c.confidence == "medium"  # high, one step down
    blocked = ShimFindings(present=True, blocked=["shim: the batch loop is inside one BatchGenerator.next call for 9s"])
    assert classify(Evidence(**PROBE_FAILED, process_cpu=0.0, shim=blocked)).kind == "blocked"
    dead = ShimFindings(present=True, dead=["shim: the generation thread ended: RuntimeError: x"])
    c = classify(Evidence(**PROBE_FAILED, shim=dead))
    assert c.kind == "dead_thread" and c.evidence[-1].startswith("shim:")
    stale = ShimFindings(present=True, stale=["shim: no heartbeat for 9s: ..."])
    c = classify(Evidence(**{**PROBE_FAILED, "endpoints_answered": False}, shim=stale))
    assert c.kind == "wedged" and c.evidence[-1].startswith("shim: no heartbeat")


def _hb(pid=1, **loop) -> heartbeat.Heartbeat:
    now = time.time()
    data = {"format": 1, "pid": pid, "published_at": now, "started_at": now, "interval": 1.0,
            "seam": {"state": "ok"}, "loop": {"tokens": 0, "steps": 0, "in_flight": 0, **loop}}
    return heartbeat.Heartbeat(pid, data, now, "x")


def test_shimwatch_turns_readings_into_stall_delivered_busy_and_evidence():
    w = ShimWatch(stall_timeout=10.0)
    assert w.judge(_hb(tokens=10, steps=10)).stall is None
    j = w.judge(_hb(tokens=30, steps=30, in_flight=2), probe_tokens=0)
    assert j.delivered and "20 token(s)" in j.delivered[0] and j.stall is None and not j.busy
    j = w.judge(_hb(tokens=30, steps=90, in_flight=2, quiet_since=time.time() - 12))
    assert j.stall and "no token for 12s" in j.stall and "livelock" in j.evidence[0]
    assert w.first_time(j) and not w.first_time(w.judge(_hb(tokens=30, steps=95, in_flight=2,
                                                             quiet_since=j.stall_key[1])))
    j = w.judge(_hb(tokens=34, steps=96, in_flight=1), probe_tokens=4)  # the probe's own tokens are not "others"
    assert not j.delivered and not j.busy
    w2 = ShimWatch(stall_timeout=5.0)
    stale = _hb(tokens=1)
    stale.data["published_at"] -= 8
    j = w2.judge(stale)
    assert j.stall and "GIL" in j.stall


def test_the_example_server_agent_runs_the_server_through_launch():
    import plistlib

    from mlxwatch.cli import build_parser

    plist = plistlib.loads((ROOT / "launchd" / "com.example.mlx-server-shim.plist").read_bytes())
    argv = plist["ProgramArguments"]
    assert argv[0].endswith("/mlxwatch") and argv[1] == "launch"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "launch" and args.exit_on_thread_death and args.name == "local"
    server = args.server_command[1:] if args.server_command[:1] == ["--"] else args.server_command
    assert server[:2] == ["@SERVER_BIN@/mlx_lm", "server"]  # the plain example's server command
    assert plist["KeepAlive"] is True and plist["ProcessType"] == "Interactive"
    assert plist["StandardOutPath"] == plist["StandardErrorPath"]


def test_a_server_without_a_heartbeat_is_not_read_again_every_probe():
    from mlxwatch.shim.watch import RECHECK_ABSENT

    w = ShimWatch()
    w.reset_for(10)
    assert w.should_read(100.0)
    w.absent(100.0)
    assert not w.should_read(100.0 + RECHECK_ABSENT - 1) and w.should_read(100.0 + RECHECK_ABSENT)
    w.reset_for(11)  # a new server process: looked at at once
    assert w.should_read(100.0)
