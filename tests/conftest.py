"""Shared fixtures: real ``mlx_lm.server`` instances, one per mlx-lm version under test.

``MLXWATCH_SERVER_PYTHONS`` lists interpreters (comma-separated) that have mlx-lm installed;
``scripts/test.sh`` sets it to one venv per version. Without it, this interpreter is used if it
has mlx-lm. ``MLXWATCH_REQUIRE_REAL_SERVER=1`` (set by the test script) turns "no mlx-lm" into a
failure instead of a skip, so CI cannot pass by skipping the tests that matter.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from lab.group import LabGroup
from lab.ports import free_port  # a loopback port free a moment ago
from lab.server import LabServer, server_version
from lab.standin import STANDIN  # the token-streaming stand-in's script
from mlxwatch.shim import layout

# Shim runtime files (heartbeats, stacks) of every server this run starts go to a directory of
# this run, removed at its end, never to the shared /tmp/mlxwatch-<uid>. Set before any test runs
# so that every process a test starts inherits it.
SHARED_RUNTIME_DIR = Path(layout.runtime_dir({}))
RUN_RUNTIME_DIR = Path(tempfile.mkdtemp(prefix="mlxwatch-test-runtime-"))
os.environ[layout.RUNTIME_ENV] = str(RUN_RUNTIME_DIR)


def _server_pythons() -> list[str]:
    listed = [p for p in os.environ.get("MLXWATCH_SERVER_PYTHONS", "").split(",") if p.strip()]
    if listed:
        return listed
    return [sys.executable] if importlib.util.find_spec("mlx_lm") else []


SERVER_PYTHONS = _server_pythons()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "server_python" in metafunc.fixturenames:
        if not SERVER_PYTHONS:
            if os.environ.get("MLXWATCH_REQUIRE_REAL_SERVER") == "1":
                raise pytest.UsageError("MLXWATCH_REQUIRE_REAL_SERVER=1 but no interpreter with mlx-lm")
            metafunc.parametrize("server_python", [pytest.param(None, marks=pytest.mark.skip("no mlx-lm"))])
            return
        # A test marked ``newest_server_only`` is about mlxwatch itself, not a version's behaviour
        # (every behaviour it meets is tested on each version elsewhere): the newest version only.
        pythons = SERVER_PYTHONS[-1:] if metafunc.definition.get_closest_marker("newest_server_only") else SERVER_PYTHONS
        ids = [server_version(p) for p in pythons]
        metafunc.parametrize("server_python", pythons, ids=[f"mlx-lm-{v}" for v in ids], scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tiers by what a test needs, not by which file it sits in: a test that asks for a real
    server (``server_python``/``lab``) is ``real_server``. The fast tier is ``-m "not real_server"``."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "server_python" in names or "lab" in names or "lab_group" in names \
                or item.get_closest_marker("real_server"):
            item.add_marker(pytest.mark.real_server)


_servers: dict[str, LabServer] = {}
_SHARED_BEFORE = pytest.StashKey[set]()
_SHARED_EXISTED = pytest.StashKey[bool]()  # the shared runtime dir, at the start: one the run made is removed if empty
_BASETEMP = pytest.StashKey[Path]()


@pytest.fixture(scope="session")
def lab_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lab")


@pytest.fixture
def lab(server_python: str, lab_root: Path):
    """A healthy real server for this mlx-lm version; relaunched if an earlier test broke it.

    Tests may switch faults on freely: the next test that asks for it gets a fresh process.
    """
    server = _servers.get(server_python)
    if server is None:
        workdir = lab_root / f"server-{len(_servers)}"
        server = LabServer.start(server_python, workdir)
        _servers[server_python] = server
    elif server.fault_file.read_text().strip() or not server.owned_process_alive():
        server.relaunch()
    yield server


_groups: dict[str, LabGroup] = {}


@pytest.fixture
def lab_group(server_python: str, lab_root: Path):
    """A healthy real 2-rank ``mlx.launch`` group (ring, loopback) for this mlx-lm version under
    a keep-alive loop (as launchd would keep it), shared by the session; relaunched if an
    earlier test broke it and the loop did not bring it back. One group runs at a time
    (a group costs about a core idle; the machine may have two): asking for another version's
    stops the last one."""
    for python, other in list(_groups.items()):
        if python != server_python:
            other.stop()
            del _groups[python]
    group = _groups.get(server_python)
    if group is None:
        group = LabGroup.start(server_python, lab_root / f"group-{server_version(server_python)}", supervised=True)
        _groups[server_python] = group
    elif not group.healthy():
        group.relaunch()
    yield group


@pytest.fixture(scope="module")
def without_lab_groups():
    """No shared lab group runs meanwhile (a test module that starts groups of its own: one
    group at a time on a 2-core machine); ``lab_group`` starts its group again when asked."""
    for python in list(_groups):
        _groups.pop(python).stop()
    yield


# Fixtures more than one test module uses live here, never imported from one test file into another.
@pytest.fixture(autouse=True)
def first_probe_soon(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fast-tier test: an in-process daemon's first probe within 0.2 s of its start. The
    spread that keeps many instances' first probes apart (up to min(interval, 5 s), at random)
    is no part of what a fast test is about (none tests the spread itself), and each daemon a
    test started paid it: 2.5 s on average at interval 60 s. Real-server tests keep it."""
    if request.node.get_closest_marker("real_server"):
        return
    from mlxwatch.daemon import watcher
    from mlxwatch.output import daemon as said  # noqa: F401  imported first: `run` says the real spread, 5 s
    monkeypatch.setattr(watcher, "FIRST_PROBE_SPREAD", 0.2)


@pytest.fixture
def kernel_read_often(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's counters read at each look (every 2 s) while healthy, not every 5 s: at a
    test's quiet_window of 1 s, the low rate (it only delays seeing a stall) was most of the wait
    for a stream the test opened to be seen."""
    from mlxwatch.evidence import kernel
    monkeypatch.setattr(kernel, "POLL_HEALTHY", 1.0)


class FullDisk:
    """A disk with ``free`` bytes left under ``directory``, simulated at the OS-call boundary (a
    real small tmpfs needs root and mount): an ``os.write`` to a file opened (``os.open``) for
    writing under ``directory`` writes what still fits, then fails with ``error`` (ENOSPC), as a
    filling disk does, and names no file, as write(2) does not. Every other descriptor is left
    alone. Set ``free`` again to give space back; ``refused`` counts the refused writes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path, free: int, error: int) -> None:
        self.directory = os.path.abspath(directory)
        self.free = free
        self.error = error
        self.refused = 0
        self._fds: set[int] = set()
        self._lock = threading.Lock()  # bundle files are written from several threads at once
        real_open, real_write, real_close = os.open, os.write, os.close

        def fake_open(path, flags, mode=0o777, *, dir_fd=None):
            fd = real_open(path, flags, mode, dir_fd=dir_fd)
            ours = dir_fd is None and bool(flags & (os.O_WRONLY | os.O_RDWR)) and self._under(path)
            with self._lock:
                (self._fds.add if ours else self._fds.discard)(fd)
            return fd

        def fake_write(fd, data):
            with self._lock:
                if fd not in self._fds:
                    fits = None
                else:
                    fits = min(len(data), self.free)
                    if not fits:
                        self.refused += 1
                        raise OSError(self.error, os.strerror(self.error))
                    self.free -= fits
            return real_write(fd, data if fits is None else bytes(memoryview(data)[:fits]))

        def fake_close(fd):
            with self._lock:
                self._fds.discard(fd)
            real_close(fd)

        monkeypatch.setattr(os, "open", fake_open)
        monkeypatch.setattr(os, "write", fake_write)
        monkeypatch.setattr(os, "close", fake_close)

    def _under(self, path) -> bool:
        return os.path.abspath(os.fspath(path)).startswith(self.directory + os.sep)


@pytest.fixture
def full_disk(monkeypatch):
    """``full_disk(directory, free=0, error=errno.ENOSPC)``: files written under ``directory``
    get only ``free`` more bytes (see ``FullDisk``); undone at the test's end."""
    def fill(directory: Path, free: int = 0, error: int = errno.ENOSPC) -> FullDisk:
        return FullDisk(monkeypatch, directory, free, error)

    return fill


@pytest.fixture
def sleeper():
    """A process of ours that is not an mlx-lm server (ended by its PID)."""
    proc = subprocess.Popen(["sleep", "300"])
    yield proc.pid
    proc.kill()
    proc.wait(10)


@pytest.fixture
def standin(tmp_path):
    """Start the stand-in server on fresh ports; yields a function (mode) -> (url, set_mode)."""
    started: list[subprocess.Popen] = []

    def start(mode: str = "ok", ports: int = 1) -> tuple[list[str], Path, subprocess.Popen]:
        first = free_port()
        port_range = f"{first}-{first + ports - 1}"
        mode_file = tmp_path / f"mode-{first}"
        mode_file.write_text(mode)
        proc = subprocess.Popen([sys.executable, STANDIN, "--ports", port_range,
                                 "--mode-file", str(mode_file)], stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return [f"http://127.0.0.1:{p}" for p in range(first, first + ports)], mode_file, proc

    yield start
    for proc in started:  # only the PIDs we started
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def _shared_runtime_entries() -> set[str]:
    try:
        return set(os.listdir(SHARED_RUNTIME_DIR))
    except OSError:
        return set()


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SHARED_BEFORE] = _shared_runtime_entries()
    session.config.stash[_SHARED_EXISTED] = SHARED_RUNTIME_DIR.exists()


@pytest.fixture(scope="session", autouse=True)
def _basetemp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Remember this run's temp root: the servers it starts name it in their command lines."""
    request.config.stash[_BASETEMP] = tmp_path_factory.getbasetemp()


def leaked_runtime_files(before: set[str], basetemp: Path) -> list[str]:
    """Files this run left in the shared runtime dir: new since the start, of a process whose
    heartbeat names this run's temp dir (a lab server's model, a stand-in's files), so another
    user of the machine starting a shimmed server meanwhile does not count."""
    leaked = []
    for name in sorted(_shared_runtime_entries() - before):
        heartbeat = SHARED_RUNTIME_DIR / f"{name.split('.')[0]}.json"
        try:
            ours = str(basetemp) in heartbeat.read_text(errors="replace")
        except OSError:
            ours = False
        if ours:
            leaked.append(name)
    return leaked


_leaked_by_workers: list[str] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: collect what each worker found left in the shared runtime dir."""
    _leaked_by_workers.extend(getattr(node, "workeroutput", {}).get("leaked_runtime_files", []))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for server in _servers.values():
        server.stop()
    for group in _groups.values():
        group.stop()
    shutil.rmtree(RUN_RUNTIME_DIR, ignore_errors=True)
    before = session.config.stash.get(_SHARED_BEFORE, None)
    basetemp = session.config.stash.get(_BASETEMP, None)
    leaked = _leaked_by_workers if basetemp is None else leaked_runtime_files(before or set(), basetemp)
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its controller reports it
        session.config.workeroutput["leaked_runtime_files"] = leaked
        return
    if not session.config.stash.get(_SHARED_EXISTED, True):
        with contextlib.suppress(OSError):  # made during this run (a daemon without a private one), left empty
            SHARED_RUNTIME_DIR.rmdir()
    if leaked:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        line = f"this run left {len(leaked)} file(s) in {SHARED_RUNTIME_DIR}: {', '.join(leaked[:10])}"
        if reporter is not None:
            reporter.write_line(f"ERROR: {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture
def config_file(tmp_path: Path):
    """Write a YAML config text to a file and return its path."""

    def write(text: str, name: str = "config.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
