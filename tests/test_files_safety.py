"""Files an attacker cannot aim (issue "Act only on evidence", item 7).

Every file the daemon writes is planted with a symbolic link to a victim file first: the
victim must never change, and the daemon must say what is wrong in one line (exit 2) rather
than write through the link. A state or bundles dir others can write, or owned by another
user, is refused with the fix named.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxwatch.capture.bundle import BundleWriter, adopt_partials, prune
from mlxwatch.daemon.metrics import write_textfile
from mlxwatch.errors import StateError
from mlxwatch.journal.incidents import Journal
from mlxwatch.journal.lock import StateDirLock
from mlxwatch.journal.state import StateFile
from mlxwatch.storage import append_record, private_dir, replace_atomically

VICTIM = b"precious: never to be overwritten by mlxwatch\n"
OTHER_UID = 65534  # nobody


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim"
    path.write_bytes(VICTIM)
    return path


def _run(state_dir: Path, tmp_path: Path, *command: str, extra: str = "") -> subprocess.CompletedProcess:
    config = tmp_path / "c.yaml"
    config.write_text(f"state_dir: {state_dir}\ninstances: [{{name: x, url: 'http://127.0.0.1:1'}}]\n{extra}")
    return subprocess.run([sys.executable, "-m", "mlxwatch", "--config", str(config), *command],
                          capture_output=True, text=True, timeout=60)


def _refusal(proc: subprocess.CompletedProcess) -> str:
    """The one error line of a refused command (INFO log lines may precede it)."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("mlxwatch: ")]
    return line


def test_textfile_temp_names_cannot_be_planted(tmp_path, victim):
    """Measured: the textfile's temp name `.mlxwatch.prom.<pid>.tmp` was predictable and opened
    with O_CREAT|O_TRUNC, so a planted link made the daemon overwrite its target. Now the temp
    name is random and created O_EXCL|O_NOFOLLOW; the planted link is left alone."""
    textfile = tmp_path / "prom" / "mlxwatch.prom"
    textfile.parent.mkdir()
    planted = textfile.parent / f".{textfile.name}.{os.getpid()}.tmp"
    planted.symlink_to(victim)
    write_textfile(textfile, b"mlxwatch_daemon_running 1\n")
    assert victim.read_bytes() == VICTIM
    assert textfile.read_bytes() == b"mlxwatch_daemon_running 1\n" and not textfile.is_symlink()
    assert oct(textfile.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in textfile.parent.iterdir()) == sorted([textfile.name, planted.name])


def test_a_link_at_the_target_is_replaced_not_written_through(tmp_path, victim):
    """A link at the target's own name is replaced by the new file; its target is untouched."""
    target = tmp_path / "state.json"
    target.symlink_to(victim)
    replace_atomically(target, b"{}")
    assert victim.read_bytes() == VICTIM and not target.is_symlink() and target.read_bytes() == b"{}"


def test_a_planted_journal_link_is_refused(tmp_path, victim):
    """Measured: a planted `incidents.jsonl` link got the journal appended to its target. Now
    the journal refuses it (one line, exit 2 for `run` and `status`), and an append never
    follows a link."""
    state = private_dir(tmp_path / "state")
    (state / "incidents.jsonl").symlink_to(victim)
    with pytest.raises(StateError, match="incidents.jsonl is a symbolic link"):
        Journal(state)
    with pytest.raises(OSError):
        append_record(state / "incidents.jsonl", {"event": "x"})
    for command in ("run", "status"):
        assert "incidents.jsonl is a symbolic link" in _refusal(_run(state, tmp_path, command))
    assert victim.read_bytes() == VICTIM


def test_a_planted_state_file_link_is_refused(tmp_path, victim):
    """state.json is never read or written through a link: the daemon refuses to start."""
    state = private_dir(tmp_path / "state")
    victim.write_bytes(b'{"instances": {}}')
    (state / "state.json").symlink_to(victim)
    with pytest.raises(StateError, match="state.json is a symbolic link"):
        StateFile(state)
    assert "state.json is a symbolic link" in _refusal(_run(state, tmp_path, "run"))
    assert victim.read_bytes() == b'{"instances": {}}'


def test_a_planted_lock_link_is_refused(tmp_path, victim):
    """The lock is opened O_NOFOLLOW: before, a planted daemon.lock link had its target
    truncated to the daemon's PID."""
    state = private_dir(tmp_path / "state")
    (state / "daemon.lock").symlink_to(victim)
    with pytest.raises(StateError, match="daemon.lock is a symbolic link"):
        StateDirLock(state).acquire()
    assert victim.read_bytes() == VICTIM


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_state_dir_others_can_write_is_refused(tmp_path, mode):
    """Measured: a pre-existing world-writable state dir was used without a word. Now `run`
    exits 2 with one line naming the fix, and writes nothing there."""
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, mode)
    line = _refusal(_run(state, tmp_path, "run"))
    assert str(state) in line and f"chmod 700 {state}" in line
    assert list(state.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a directory another user owns")
def test_a_state_or_bundles_dir_owned_by_another_user_is_refused(tmp_path):
    """A dir another user owns is theirs to fill with links: refused, for state and bundles."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    assert f"owned by uid {OTHER_UID}" in _refusal(_run(theirs, tmp_path, "run"))
    state = private_dir(tmp_path / "state")
    (state / "bundles").symlink_to(theirs)  # a link to their dir: the dir it leads to is checked
    with pytest.raises(StateError, match=f"owned by uid {OTHER_UID}"):
        BundleWriter(state / "bundles", "x")
    assert list(theirs.iterdir()) == []


def test_a_group_writable_bundles_dir_is_refused(tmp_path):
    """Bundles hold private prompts and are pruned by name: their dir must be ours alone."""
    bundles = tmp_path / "bundles"
    bundles.mkdir()
    os.chmod(bundles, 0o775)
    with pytest.raises(StateError, match="chmod 700"):
        BundleWriter(bundles, "x")
    assert list(bundles.iterdir()) == []


def test_a_new_state_dir_is_made_private(tmp_path):
    """A state dir the daemon makes is 0700 whatever the umask, and so is every missing parent
    it makes: a new user found `capture` making ~/.local/state/mlxwatch 0755 on its way to
    the bundles dir under it (mkdir -p gives parents the umask's mode)."""
    old = os.umask(0)
    try:
        made = private_dir(tmp_path / "a" / "state" / "bundles")
    finally:
        os.umask(old)
    assert made.stat().st_mode & 0o777 == 0o700
    assert [(p.name, p.stat().st_mode & 0o777) for p in (made.parent, made.parent.parent)] == [
        ("state", 0o700), ("a", 0o700)]


def test_links_in_the_bundles_dir_are_never_followed(tmp_path):
    """A link named like a bundle or a partial is never counted, renamed into, or pruned through."""
    bundles = private_dir(tmp_path / "bundles")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "manifest.json").write_text("{}")
    (elsewhere / "keep.txt").write_text("keep")
    (bundles / "x-20200101T000000Z-abcdef").symlink_to(elsewhere)
    (bundles / "y-20200101T000000Z-abcdef-incomplete").symlink_to(elsewhere)
    (bundles / ".z-20200101T000000Z-abcdef.partial").symlink_to(elsewhere)
    assert adopt_partials(bundles, older_than=0) == []
    assert prune(bundles, keep=0, max_bytes=1, keep_days=1) == []
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt", "manifest.json"]


async def test_the_daemon_refuses_a_world_writable_state_dir_before_writing(tmp_path):
    """The same refusal from the daemon core: StateError, nothing written."""
    from mlxwatch.config import Config, InstanceConfig
    from mlxwatch.daemon.supervisor import Daemon

    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o777)
    with pytest.raises(StateError, match="writable by others"):
        await Daemon(Config(instances=(InstanceConfig("x", "http://127.0.0.1:1"),), state_dir=state),
                     state).run(asyncio.Event())
    assert list(state.iterdir()) == []


@pytest.mark.parametrize("how", ["capture.dir", "bundles link"])
def test_run_refuses_a_bundles_dir_others_can_write(tmp_path, how):
    """Measured: `run` started with a 0777 bundles dir (set as capture.dir, or `<state>/bundles`
    a link to one) and the first incident's capture failed ("writable by others"), its evidence
    lost. Now `run` checks the bundles dir at start as it does the state dir: exit 2, one line
    naming the fix, nothing written in it."""
    state = tmp_path / "state"
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    if how == "capture.dir":
        bundles, extra = shared, f"capture: {{dir: {shared}}}\n"
    else:
        bundles, extra = private_dir(state) / "bundles", ""
        bundles.symlink_to(shared)
    line = _refusal(_run(state, tmp_path, "run", extra=extra))
    assert str(bundles) in line and "writable by others" in line and f"chmod 700 {bundles}" in line
    assert list(shared.iterdir()) == []


async def test_a_reload_to_a_bundles_dir_others_can_write_is_refused(tmp_path, caplog):
    """A reload is held to what `run` refuses: a config whose bundles dir others can write is
    refused with one WARNING line, and the old config (and its bundles dir) is kept."""
    from dataclasses import replace

    from mlxwatch.config import Config, InstanceConfig
    from mlxwatch.daemon.supervisor import Daemon

    state = tmp_path / "state"
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    old = Config(instances=(InstanceConfig("x", "http://127.0.0.1:1"),), state_dir=state)
    new = replace(old, capture=replace(old.capture, dir=shared))
    daemon = Daemon(old, state, heartbeat=3600.0)
    stop, reload = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(daemon.run(stop, reload, load_config=lambda: new))
    try:
        async def until(predicate) -> None:
            for _ in range(600):
                if task.done():
                    task.result()
                if predicate():
                    return
                await asyncio.sleep(0.05)
            raise AssertionError("timed out")

        await until(lambda: hasattr(daemon, "shared"))
        reload.set()
        await until(lambda: daemon.state.data["daemon"].get("last_reload") is not None)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    outcome = daemon.state.data["daemon"]["last_reload"]
    assert outcome["ok"] is False and f"chmod 700 {shared}" in outcome["message"]
    assert daemon.config is old and daemon.shared.bundles_dir == state / "bundles"
    refused = [r for r in caplog.records if "config reload failed" in r.getMessage()]
    assert [r.levelname for r in refused] == ["WARNING"] and str(shared) in refused[0].getMessage()
    assert list(shared.iterdir()) == []
