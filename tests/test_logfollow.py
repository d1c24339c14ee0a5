"""Following a rotated log (docs/deciding.md, "Following the log"): no progress lost, none invented.

Real files, a real writer's descriptor (an append-mode file object kept open across the
rotation, as a server's stderr is), the rotation styles of newsyslog, logrotate and symlinked logs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from mlxwatch.probes import CheckReport, EndpointResult, GenerationProbeResult
from mlxwatch.serverlog.follow import LogFollower, open_by
from mlxwatch.evidence.log import ProgressTracker
from lab.evidence import LogLooks

TURNED_OVER = "Jul  5 08:20:00 mac newsyslog[123]: logfile turned over\n"


def failed_probe() -> CheckReport:
    gen = GenerationProbeResult(url="u", started_at=0, status=200)
    return CheckReport("u", gen, EndpointResult("/health"), EndpointResult("/v1/models"))


def step(x: int, y: int = 25660) -> str:
    return f"2026-07-05 08:20:00,000 - INFO - Prompt processing progress: {x}/{y}\n"


def started_log(tmp_path: Path) -> tuple[Path, object]:
    """A server log and the server's own (append-mode, line-buffered) descriptor on it."""
    log = tmp_path / "server.log"
    log.write_text("2026-07-05 08:19:00,000 - INFO - Starting httpd at 127.0.0.1 on port 8082...\n" + step(1024))
    return log, open(log, "a", buffering=1)


def test_rename_rotation_while_the_writer_stays_on_the_old_file(tmp_path):
    """newsyslog renames the log and creates a new one; the server (a launchd job's stderr) keeps
    writing to the renamed file. Measured: a false verdict 0.3 s after the rotation. Its progress
    lines still count, for as long as they keep coming, and the new file's lines are read too."""
    log, server = started_log(tmp_path)
    tracker = LogLooks(ProgressTracker(log))
    tracker.prime()
    with server:
        log.rename(tmp_path / "server.log.0")
        log.write_text(TURNED_OVER)
        for x in (2048, 4096, 6144):
            server.write(step(x))
            got = tracker.observe(failed_probe())
            assert got.progress == (f"log: prompt processing advanced (1 step(s), now {x}/25660)",), (x, got)
        assert tracker.observe(failed_probe()).progress == ()  # a pause: the old file is idle, not left
        server.write(step(8192))
        with open(log, "a") as other:
            other.write(step(9000, 9999))  # something else writes to the new file meanwhile
        chunk_signals = tracker.observe(failed_probe()).progress
    assert chunk_signals == ("log: prompt processing advanced (2 step(s), now 9000/9999)",)


def test_rename_then_reopen_later_loses_nothing_and_lets_the_old_file_go(tmp_path):
    """The writer goes on in the renamed file, then reopens the log's name (SIGHUP, a restart):
    the last lines of the old file and the first of the new one both count, in order; once the
    old file is idle and the new one has data, the old one is let go (its descriptor closed)."""
    log, server = started_log(tmp_path)
    follower = LogFollower(log)
    follower.prime()
    log.rename(tmp_path / "server.log.0")
    log.touch()  # newsyslog's B flag: a new, empty file
    server.write(step(2048))
    chunk = follower.read_new()
    assert chunk.event == "rotated" and chunk.lines == [step(2048).rstrip("\n")]
    server.write(step(3072))
    server.close()
    with open(log, "a", buffering=1) as server:  # reopened by name: now the new file
        server.write(step(4096))
        assert follower.read_new().lines == [step(3072).rstrip("\n"), step(4096).rstrip("\n")]
        assert len(follower.rotated) == 1  # it was still growing at that read
        server.write(step(5120))
        assert follower.read_new().lines == [step(5120).rstrip("\n")]
    assert follower.rotated == []  # idle, and the new file has data: let go
    follower.close()


def test_reopen_into_an_empty_new_file_reads_it_from_its_start(tmp_path):
    """The rotation and the reopen both happen between two reads: nothing is lost."""
    log, server = started_log(tmp_path)
    tracker = LogLooks(ProgressTracker(log))
    tracker.prime()
    server.write(step(2048))
    server.close()
    log.rename(tmp_path / "server.log.0")
    with open(log, "a", buffering=1) as server:
        server.write(step(4096))
    assert tracker.observe(failed_probe()).progress == ("log: prompt processing advanced (2 step(s), now 4096/25660)",)


def test_copy_truncate_is_still_handled(tmp_path):
    """logrotate's copytruncate: the log is copied, then truncated in place; the writer (O_APPEND)
    goes on at the new start."""
    log, server = started_log(tmp_path)
    tracker = LogLooks(ProgressTracker(log))
    tracker.prime()
    with server:
        server.write(step(2048))
        (tmp_path / "server.log.0").write_bytes(log.read_bytes())
        os.truncate(log, 0)
        got = tracker.observe(failed_probe())
        assert got.progress == () and any(n.startswith("log truncated") for n in got.notes)
        server.write(step(4096))
        assert tracker.observe(failed_probe()).progress == ("log: prompt processing advanced (1 step(s), now 4096/25660)",)


def test_a_symlink_swapped_to_an_old_file_is_history_not_progress(tmp_path):
    """Measured: a symlinked log swapped to an old file gave one cycle of fake progress. Lines
    an older file already held are history; what is written to it afterwards counts."""
    current = tmp_path / "server-today.log"
    current.write_text(step(100, 900))
    old = tmp_path / "server-yesterday.log"
    old.write_text("".join(step(x) for x in (2048, 4096, 6144, 8192)))
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    log = tmp_path / "server.log"
    log.symlink_to(current)
    tracker = LogLooks(ProgressTracker(log))
    tracker.prime()
    log.unlink()
    log.symlink_to(old)
    got = tracker.observe(failed_probe())
    assert got.progress == ()
    assert any(n.startswith("log relinked: ") and "history" in n for n in got.notes), got.notes
    with open(old, "a") as fh:
        fh.write(step(512, 700))
    assert tracker.observe(failed_probe()).progress == ("log: prompt processing advanced (1 step(s), now 512/700)",)


def test_a_symlink_swapped_to_a_new_file_is_read_from_its_start(tmp_path):
    """A log manager that starts a new file and points the link at it: the new file's lines are
    new; the old target, which the server still has open, is read on."""
    first = tmp_path / "server-1.log"
    first.write_text(step(100, 900))
    log = tmp_path / "server.log"
    log.symlink_to(first)
    tracker = LogLooks(ProgressTracker(log))
    tracker.prime()
    with open(first, "a", buffering=1) as server:
        second = tmp_path / "server-2.log"
        second.write_text(step(2048))
        log.unlink()
        log.symlink_to(second)
        server.write(step(200, 900))
        got = tracker.observe(failed_probe())
    assert set(got.progress) == {"log: prompt processing advanced (2 step(s), now 2048/25660)"}, got


def test_a_writer_that_still_has_the_old_file_open_keeps_it_followed(tmp_path):
    """With the writer's PID known, its open files decide: an old file it still has open is read
    on even while it is idle and the new file grows (a launchd job's stderr until it restarts);
    once the writer is gone, the idle old file is let go."""
    log = tmp_path / "server.log"
    log.write_text("")
    with open(log, "a") as stderr:
        writer = subprocess.Popen([sys.executable, "-u", "-c",
                                   "import sys\n"
                                   "for line in sys.stdin: sys.stderr.write(line); sys.stderr.flush()\n"],
                                  stdin=subprocess.PIPE, stderr=stderr, text=True)
    try:
        follower = LogFollower(log, writer_pid=lambda: writer.pid)
        follower.prime()
        st = os.stat(log)
        assert (st.st_dev, st.st_ino) in (open_by(writer.pid) or set())
        log.rename(tmp_path / "server.log.0")
        log.write_text(TURNED_OVER)
        assert follower.read_new().lines == [TURNED_OVER.rstrip("\n")]
        with open(log, "a") as other:
            other.write("another writer's line\n")  # the new file grows, the old one is idle
        assert follower.read_new().lines == ["another writer's line"]
        assert len(follower.rotated) == 1  # still open by the writer: kept
        writer.stdin.write(step(2048))
        writer.stdin.flush()
        deadline = time.monotonic() + 30
        lines: list[str] = []
        while not lines and time.monotonic() < deadline:
            lines = follower.read_new().lines
            time.sleep(0.02)
        assert lines == [step(2048).rstrip("\n")]
    finally:
        writer.stdin.close()
        writer.wait(10)
    follower.read_new()
    assert follower.rotated == []  # the writer is gone, the old file idle, the new one grew: let go
    follower.close()


# --- the daemon: a stand-in server whose probe fails, a writer process, a rotated log

WRITER = """
import sys, time
log, stop_after = sys.argv[1], time.monotonic() + 120
with open(log, "a", buffering=1) as fh:  # opened once, kept across the rotation, as a server's stderr
    x = 512
    while time.monotonic() < stop_after:  # a chunk of 512 tokens every 20 ms, stamped as mlx-lm's logging does
        now = time.time()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(now)) + f",{int(now % 1 * 1000):03d}"
        fh.write(f"{stamp} - INFO - Prompt processing progress: {x}/1000000000\\n")
        x += 512
        time.sleep(0.02)
"""


async def test_daemon_gives_no_verdict_while_progress_goes_on_in_the_rotated_log(tmp_path):
    """Measured on main: newsyslog's rename-and-create drew a false verdict about 0.3 s after the
    rotation while prompt processing went on in the renamed file. The daemon follows the renamed
    file: no verdict while the writer's progress continues there; once it stops, the verdict comes."""
    import asyncio

    from mlxwatch.config import CaptureConfig, Config, InstanceConfig, ProbeConfig
    from mlxwatch.daemon.supervisor import Daemon
    from mlxwatch.journal.incidents import Journal
    from lab.daemon import remember_pace
    from lab.ports import free_port
    from lab.standin import STANDIN

    port = free_port()
    mode = tmp_path / "mode"
    mode.write_text("ok")
    server = subprocess.Popen([sys.executable, STANDIN, "--ports", str(port),
                               "--mode-file", str(mode)], stdout=subprocess.PIPE, text=True)
    log = tmp_path / "server.log"
    log.write_text("")
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(log)])
    probe = ProbeConfig(interval=0.2, suspect_interval=0.1, first_token_timeout=0.5, timeout=1.0, failures=2,
                        endpoint_timeout=0.3, startup_timeout=30.0, quiet_window=1.0)
    cfg = Config(None, (InstanceConfig("rotated", f"http://127.0.0.1:{port}", log, None, probe),), tmp_path / "state",
                 (), CaptureConfig(snapshots=1, spacing=0.1, ceiling=5.0))
    # a pace learned before (1 s a chunk): the writer's chunks come every 20 ms, too fast to time,
    # and a loaded machine's probes hint up to the prior (a minute a chunk), the test's whole bound
    remember_pace(cfg.state_dir / "state.json", 1.0, name="rotated", url=f"http://127.0.0.1:{port}")
    daemon = Daemon(cfg, cfg.state_dir, heartbeat=3600.0)
    stop, reload = asyncio.Event(), asyncio.Event()
    journal = Journal(cfg.state_dir)
    failed: list[float] = []

    async def until(predicate, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if task.done():
                task.result()
            assert time.monotonic() < deadline, f"timed out waiting for {what}; journal: {events()}"
            await asyncio.sleep(0.02)

    def events() -> list[str]:
        return [r["event"] for r in journal.records()]

    def failed_probes(n: int):
        def enough() -> bool:
            p = daemon.state.instance("rotated").get("last_probe") if hasattr(daemon, "state") else None
            if p and not p["ok"] and (not failed or failed[-1] != p["at"]):
                failed.append(p["at"])
            return len(failed) >= n
        return enough

    try:
        assert server.stdout.readline().strip() == "ready"
        task = asyncio.create_task(daemon.run(stop, reload, load_config=lambda: cfg))
        await until(lambda: hasattr(daemon, "state") and (daemon.state.instance("rotated").get("last_probe") or {})
                    .get("ok"), "a healthy probe")
        mode.write_text("hang")
        await until(failed_probes(3), "three failed probes")
        assert "verdict" not in events()  # progress in the log holds it
        log.rename(tmp_path / "server.log.0")
        log.write_text(TURNED_OVER)
        await until(failed_probes(3 + 6), "six failed probes after the rotation")
        assert "verdict" not in events(), "a verdict while progress went on in the rotated log"
        writer.kill()
        writer.wait(10)
        await until(lambda: "verdict" in events(), "the verdict once the progress stopped")
    finally:
        stop.set()
        if "task" in locals():
            await asyncio.wait_for(task, 30)
        for proc in (writer, server):  # only the PIDs this test started
            proc.kill()
            proc.wait(10)
        server.stdout.close()


# --- capture: the bundle's log tail and window across a rotation


async def test_the_bundles_log_tail_and_window_span_a_rotation(tmp_path):
    """A capture just after newsyslog rotated the log: log-tail.txt holds the last lines of the
    rotated file and then the new file's; progress the server writes to the rotated file during
    the window counts in the window (measured on main: the tail was the new file's one line)."""
    from mlxwatch.capture import CaptureRequest, capture_bundle

    log, server = started_log(tmp_path)
    with server:
        for x in (2048, 3072):
            server.write(step(x))
        log.rename(tmp_path / "server.log.0")
        (tmp_path / "server.log.1.bz2").write_bytes(b"BZh9 an older, compressed rotation")
        log.write_text(TURNED_OVER)

        def on_step(name: str, state: str) -> None:
            if (name, state) == ("process", "start"):  # during the window, still to the renamed file
                server.write(step(4096))

        bundle = await capture_bundle(CaptureRequest(pid=None, out_dir=tmp_path / "bundles", log=log, snapshots=1,
                                                     spacing=0.1, ceiling=20.0, log_tail_lines=4), on_step=on_step)
    tail = (bundle.path / "log-tail.txt").read_text().splitlines()
    assert tail == [step(2048).rstrip("\n"), step(3072).rstrip("\n"), step(4096).rstrip("\n"),
                    TURNED_OVER.rstrip("\n")], tail
    assert bundle.manifest["log_window"]["prompt_progress_advances"] == 1, bundle.manifest["log_window"]
    assert bundle.manifest["log_window"]["last_advance"] == [4096, 25660]
