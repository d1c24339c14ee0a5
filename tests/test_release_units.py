"""Never relaunch into held memory (restart.release): the restart method runs only once the
stopped server's memory is given back, bounded by memory.release_timeout. Real processes:
a child that takes a while to go stands for a server still exiting."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from mlxwatch.config import InstanceConfig, MemoryConfig, RestartConfig
from mlxwatch.host.process import ProcessIdentity
from mlxwatch.restart import release
from mlxwatch.restart.methods import RestartContext, restart


def exiting_child() -> subprocess.Popen:
    """A process that stays until we end it (stands for a server still freeing its memory)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def end_later(child: subprocess.Popen, after: float, ended: dict) -> threading.Thread:
    def end() -> None:
        time.sleep(after)
        ended["at"] = time.time()
        child.kill()
        child.wait()
    t = threading.Thread(target=end, daemon=True)
    t.start()
    return t


async def test_the_restart_command_runs_only_once_the_old_server_is_gone(tmp_path):
    """Before: the command ran at once, beside the old process. Now it runs after it is gone."""
    child = exiting_child()
    ended: dict = {}
    try:
        gone = ProcessIdentity.of(child.pid)
        stamp = tmp_path / "started"
        argv = (sys.executable, "-c", f"import time; open({str(stamp)!r}, 'w').write(repr(time.time()))")
        inst = InstanceConfig("lab", "http://127.0.0.1:9", restart=RestartConfig("command", argv=argv, timeout=30.0),
                              memory=MemoryConfig(release_timeout=30.0))
        waiter = end_later(child, 1.5, ended)
        outcome = await restart(RestartContext(inst, None, None, gone=gone))
        waiter.join()
        assert float(stamp.read_text()) >= ended["at"]
        assert outcome.released is not None and outcome.released.released and outcome.released.waited >= 1.0
    finally:
        child.kill()
        child.wait()


async def test_a_server_that_never_goes_costs_at_most_the_bound_then_the_restart_runs(tmp_path):
    child = exiting_child()
    try:
        stamp = tmp_path / "started"
        argv = (sys.executable, "-c", f"open({str(stamp)!r}, 'w').write('x')")
        inst = InstanceConfig("lab", "http://127.0.0.1:9", restart=RestartConfig("command", argv=argv, timeout=30.0),
                              memory=MemoryConfig(release_timeout=1.0))
        outcome = await restart(RestartContext(inst, None, None, gone=ProcessIdentity.of(child.pid)))
        assert stamp.exists() and outcome.released is not None and not outcome.released.released
        assert outcome.released.slow and f"process {child.pid} still exiting after 1s" in outcome.detail
    finally:
        child.kill()
        child.wait()


def test_macos_waits_for_the_gpu_memory_to_fall_by_what_the_server_held():
    """The GPU's in-use memory, read each poll: released once down by 80 % of the footprint."""
    readings = iter([10_000, 9_000, 6_000, 2_000])
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    gone = ProcessIdentity(2**22 + 4321, 0.0, ())  # no such process: already gone
    done = release.wait_released(gone, 30.0, held=10_000, macos=True, gpu=lambda: next(readings),
                                 clock=lambda: now[0], sleep=sleep)
    assert done.released and "fell" in done.detail and done.waited == 2 * release.POLL


def test_the_gpu_memory_read_is_ioregs_in_use_system_memory():
    """The wait reads the GPU's "In use system memory" through mlxwatch.host.gpu (the command is
    tested against ioreg(8) in tests/test_gpu_macos.py), never the "(driver)" key beside it."""
    from test_macos_parsers import recorded
    from mlxwatch.host.gpu import parse_ioreg

    assert parse_ioreg(recorded("ioreg-lmstudiobench-m4max.txt")).in_use_bytes == 2363801600