"""Bounded for months (issue "Act only on evidence", item 8): a year of journal, bundle
retention by age, incomplete and partial bundles counted and pruned, a free-disk floor."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from mlxwatch.capture.bundle import (
    WRITER,
    BundleWriter,
    LowDiskSpace,
    bundle_name,
    prune,
)
from mlxwatch.config import (
    CaptureConfig,
    Config,
    InstanceConfig,
    ProbeConfig,
    RestartConfig,
)
from mlxwatch.daemon.status import collect_status
from mlxwatch.journal.incidents import Incident, Journal
from mlxwatch.journal.state import STATE_NAME, StateFile

DAY = 86400.0
PAD = "x" * 700  # a record of about 1 KB, an incident of about 5 KB, as measured on main


def _bytes_read() -> int:
    with open("/proc/self/io") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("rchar:"))


def _read_cost(fn):
    before = _bytes_read()
    started = time.monotonic()
    result = fn()
    return result, _bytes_read() - before, time.monotonic() - started


@pytest.fixture
def a_year(tmp_path, monkeypatch):
    """A state dir with a year of incidents (10 a day over 3 instances, ~18 MB) written by the
    real journal; fsync is skipped while generating (the read path is under test). Instance
    `old` gave up on day 1 and its incident was left open by a killed daemon."""
    state = tmp_path / "state"
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    journal = Journal(state)
    start = time.time() - 365 * DAY
    old = Incident("old", first_failure_at=start, detected_at=start)
    old.restarts.append({"at": start + 1, "result": "failed", "error": ""})
    journal.record("gave_up", old)
    journal.record("restarting", old, state="restarting")
    for n in range(3650):
        inc = Incident(f"m{n % 3}", detected_at=start + n * DAY / 10, failures=[PAD], kind="livelock")
        for event in ("verdict", "capturing", "captured", "restarting"):
            journal.record(event, inc)
        inc.restarts.append({"at": start + n * DAY / 10 + 5, "result": "ok", "detail": ""})
        journal.record("recovered", inc)
    monkeypatch.undo()
    return state, old


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts bytes read from /proc/self/io")
def test_a_year_of_journal_is_read_in_bounded_bytes(a_year, tmp_path):
    """Measured: the journal grew ~5 KB an incident, never rotated: at 52 MB `status` took 2.5 s
    and a start 7 s (16 s with state.json lost). Now it is rotated into segments with an index,
    and status, a start's open incidents and the state rebuild read a bounded number of bytes
    (and still see the incident left open a year ago, and its gave-up time)."""
    state, old = a_year
    total = sum(p.stat().st_size for p in state.glob("incidents*.jsonl"))
    assert total > 15 * 1024**2 and len(list(state.glob("incidents-*.jsonl"))) >= 10
    bound = 4 * 1024**2
    config = Config(instances=tuple(InstanceConfig(n, "http://127.0.0.1:1") for n in ("old", "m0", "m1", "m2")),
                    state_dir=state)

    status, read, took = _read_cost(lambda: collect_status(config, state))
    print(f"status: {read} bytes read in {took:.2f}s (journal {total} bytes)")
    assert read < bound
    by_name = {i["name"]: i for i in status["instances"]}
    assert by_name["old"]["open_incident"]["id"] == old.id
    assert by_name["m2"]["last_incident"]["event"] == "recovered"

    opened, read, took = _read_cost(lambda: Journal(state).open_incidents())
    print(f"open incidents at start: {read} bytes read in {took:.2f}s")
    assert read < bound and [r["id"] for r in opened] == [old.id]

    (state / STATE_NAME).unlink(missing_ok=True)
    rebuilt, read, took = _read_cost(lambda: StateFile(state, state / "incidents.jsonl"))
    print(f"state rebuild: {read} bytes read in {took:.2f}s")
    assert read < bound
    assert rebuilt.data["instances"]["old"]["gave_up_at"] is not None
    assert rebuilt.data["instances"]["m1"]["restarts"][-1] > time.time() - 2 * DAY


def test_a_lost_index_is_rebuilt_and_the_answers_stay_the_same(tmp_path):
    """The index is derived data: without it every segment is read once, and the next append
    writes it again. Records already folded are never counted twice."""
    state = tmp_path / "state"
    journal = Journal(state, segment_bytes=2000)
    for n in range(40):
        inc = Incident(f"i{n % 2}")
        journal.record("verdict", inc)
        if n != 3:
            journal.record("recovered", inc)
    assert len(list(state.glob("incidents-*.jsonl"))) > 5
    want = ({k: v["id"] for k, v in journal.latest_by_instance().items()}, [r["id"] for r in journal.open_incidents()])
    (state / "incidents.index.json").unlink()
    again = Journal(state, segment_bytes=2000)
    assert ({k: v["id"] for k, v in again.latest_by_instance().items()},
            [r["id"] for r in again.open_incidents()]) == want
    again.note("daemon_start")
    assert (state / "incidents.index.json").exists()
    assert [r["id"] for r in Journal(state).open_incidents()] == want[1]


# --- bundle retention


def _bundle(root: Path, label: str, age_days: float, *, complete: bool = True, size: int = 1000) -> Path:
    name = bundle_name(label, time.time() - age_days * DAY)
    path = root / (name if complete else f"{name}-incomplete")
    path.mkdir(mode=0o700)
    (path / "data").write_bytes(b"x" * size)
    if complete:
        (path / "manifest.json").write_text("{}")
    return path


def _partial(root: Path, label: str, age_days: float, writer: dict) -> Path:
    path = root / f".{bundle_name(label, time.time() - age_days * DAY)}.partial"
    path.mkdir(mode=0o700)
    (path / WRITER).write_text(json.dumps(writer))
    (path / "data").write_bytes(b"x" * 1000)
    return path


def test_bundles_older_than_keep_days_are_pruned(tmp_path):
    """Measured: bundles were pruned by count and bytes, never by age. Now past keep_days they go."""
    root = tmp_path / "bundles"
    root.mkdir(mode=0o700)
    old = [_bundle(root, "a", 120), _bundle(root, "a", 91)]
    new = [_bundle(root, "a", 89), _bundle(root, "a", 1)]
    removed = prune(root, keep=50, max_bytes=10**9, keep_days=90)
    assert sorted(removed) == sorted(old)
    assert sorted(root.iterdir()) == sorted(new)


def test_incomplete_and_abandoned_partial_bundles_are_counted_and_pruned(tmp_path):
    """Measured: `-incomplete` and `.partial` bundles were never pruned or counted. Now they
    count toward keep and max_bytes and go oldest first; a partial still being written stays."""
    import psutil

    root = tmp_path / "bundles"
    root.mkdir(mode=0o700)
    incomplete = _bundle(root, "a", 10, complete=False)
    dead = _partial(root, "a", 9, {"pid": os.getpid(), "create_time": 1.0, "host": None})  # not this process
    me = psutil.Process()
    live = _partial(root, "a", 8, {"pid": me.pid, "create_time": me.create_time(), "host": None})
    complete = [_bundle(root, "a", d) for d in (3, 2, 1)]
    removed = prune(root, keep=4, max_bytes=10**9, keep_days=90)  # the live partial counts: 4 left
    assert sorted(removed) == sorted([incomplete, dead])
    assert sorted(root.iterdir()) == sorted([live, *complete])
    removed = prune(root, keep=50, max_bytes=3500, keep_days=90)  # 4 x 1000 bytes + manifests
    assert removed == [complete[0]] and live.exists()


def test_below_the_free_space_floor_no_bundle_is_started(tmp_path):
    """Measured: on a nearly full disk a capture took the last free bytes. Now below
    min_free_bytes no bundle is started (one line saying why), and no file takes the space
    below it."""
    root = tmp_path / "bundles"
    floor = CaptureConfig.min_free_bytes
    with pytest.raises(LowDiskSpace, match="below capture.min_free_bytes") as refused:
        BundleWriter(root, "a", floor, free_space=lambda path: floor - 1)
    assert "\n" not in str(refused.value) and list(root.iterdir()) == []
    writer = BundleWriter(root, "a", floor, free_space=lambda path: floor + 100)
    writer.write("small", b"x" * 50)
    with pytest.raises(LowDiskSpace, match="big not written"):
        writer.write("big", b"x" * 200)
    assert "big" not in writer.files


def test_a_disk_that_fills_mid_capture_gives_the_bundle_up_and_its_space_back(tmp_path, full_disk):
    """Measured on a 3 MB tmpfs (min_free_bytes 1KB): a write refused for lack of space left the
    `.partial` bundle holding the last free bytes for the daemon's whole life (its writer alive:
    only the next start adopts it), and state.json and journal writes failed after it. Now the
    partial is removed at once and the capture fails with one line naming the bundles dir;
    nothing of the bundle is made again, even with space back."""
    root = tmp_path / "bundles"
    writer = BundleWriter(root, "lab", 1024)  # statvfs shows room above the floor: the disk fills anyway
    writer.write("process.json", b"{}" * 500)
    disk = full_disk(root, free=1000)
    with pytest.raises(LowDiskSpace) as refused:
        writer.write("stacks/1.txt", b"x" * 5000)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{root}: no space left on device writing stacks/1.txt"), line
    assert disk.refused == 1 and list(root.iterdir()) == []  # the partial and all it held: gone
    disk.free = 10**9
    for late in (lambda: writer.write("log/tail.txt", b"y"), lambda: writer.tool_output("native/sample.txt"),
                 lambda: writer.finish({}, "summary")):
        with pytest.raises(LowDiskSpace, match="no space left on device writing stacks/1.txt"):
            late()
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("error", ["ENOSPC", "EDQUOT"])
def test_a_bundle_started_on_a_full_disk_leaves_no_partial(tmp_path, full_disk, error):
    """No room even for the partial's `.writer` file (or over a quota): nothing is left behind."""
    import errno

    root = tmp_path / "bundles"
    full_disk(root, free=10, error=getattr(errno, error))
    with pytest.raises(LowDiskSpace, match=f"^{root}: {os.strerror(getattr(errno, error)).lower()} writing .writer;"):
        BundleWriter(root, "lab", 1024)
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("how", ["below the floor", "filled mid-capture"])
async def test_a_full_disk_gets_a_note_instead_of_a_bundle_and_the_restart_still_happens(tmp_path, full_disk, how):
    """The watchdog journals the refusal (capture_failed, one line) and restarts all the same,
    whether the floor refused the bundle or the disk filled under a capture."""
    from mlxwatch.daemon.supervisor import Daemon
    from lab.ports import free_port

    state = tmp_path / "state"
    probe = ProbeConfig(interval=0.2, suspect_interval=0.1, first_token_timeout=0.5, timeout=1.0, failures=1,
                        endpoint_timeout=0.3, startup_timeout=30.0)
    restart = RestartConfig("command", argv=("true",))
    floor = 1024**4 if how == "below the floor" else 1024
    if how == "filled mid-capture":
        full_disk(state / "bundles", free=300)  # the partial's .writer fits, the next file does not
    cfg = Config(None, (InstanceConfig("gone", f"http://127.0.0.1:{free_port()}", None, None, probe, restart),),
                 state, (), CaptureConfig(snapshots=1, spacing=0.1, ceiling=5.0, min_free_bytes=floor))
    daemon, stop = Daemon(cfg, state, heartbeat=3600.0), asyncio.Event()
    task = asyncio.create_task(daemon.run(stop, load_config=lambda: cfg))
    journal = Journal(state)
    deadline = time.monotonic() + 60
    try:
        while not any(r["event"] == "restarting" or r.get("restarts") for r in journal.records()):
            assert not task.done() and time.monotonic() < deadline, [r["event"] for r in journal.records()]
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    failed = next(r for r in journal.records() if r["event"] == "capture_failed")
    assert failed["error"].startswith(f"LowDiskSpace: {state / 'bundles'}: ") and "min_free_bytes" in failed["error"]
    assert "\n" not in failed["error"]
    assert not (state / "bundles").exists() or not any((state / "bundles").iterdir())
    shutil.rmtree(state, ignore_errors=True)
