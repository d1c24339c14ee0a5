"""The memory trend (daemon.memwatch) and the readings it is fed (host.memuse)."""

from __future__ import annotations

import os
import sys

import pytest

from mlxwatch.config import MemoryConfig
from mlxwatch.daemon.memwatch import MIN_READINGS, MemoryWatch, describe, slope
from mlxwatch.host import memuse
from mlxwatch.host.memuse import MemoryReading

MiB = 1024 * 1024


def reading(used_mib: float, limit_mib: float = 200, bound: str = "cgroup /lab") -> MemoryReading:
    used = int(used_mib * MiB)
    return MemoryReading(used, "rss", int(limit_mib * MiB), int(limit_mib * MiB) - used, bound)


def test_a_steady_leak_says_when_the_room_runs_out():
    """2 MiB/s from 100 of 200 MiB: 50 s left, said once, as the warning's first look."""
    watch = MemoryWatch(MemoryConfig())
    looks = [watch.add(float(t), reading(100 + 2 * t)) for t in range(MIN_READINGS)]
    assert [look.minutes_left is None for look in looks] == [True] * (MIN_READINGS - 1) + [False]
    last = looks[-1]
    assert last.rate == pytest.approx(2 * MiB) and last.minutes_left == pytest.approx((200 - 110) / 2 / 60)
    assert last.warn and not last.restart  # restart_early is off by default
    assert not watch.add(6.0, reading(112)).warn  # once an episode
    assert describe(last.to_dict()) == ("memory: 110 MiB of 200 MiB (cgroup /lab), +2.0 MiB/s: out of memory in "
                                        "about 1 minute")


def test_a_flat_or_shrinking_server_has_no_minutes_left_and_a_new_episode_warns_again():
    watch = MemoryWatch(MemoryConfig(warn_within=60.0))
    for t in range(10):
        look = watch.add(float(t), reading(100 - t))
    assert look.minutes_left is None and not look.warn
    watch.forget()
    slow = [watch.add(float(t), reading(100 + 0.1 * t)) for t in range(8)]  # 0.1 MiB/s: 16 min, beyond 60 s
    assert slow[-1].minutes_left == pytest.approx((200 - 100.7) / 0.1 / 60, rel=1e-3) and not any(s.warn for s in slow)


def test_the_window_drops_old_readings_so_a_new_leak_is_not_diluted():
    watch = MemoryWatch(MemoryConfig(window=10.0))
    for t in range(0, 100, 2):
        watch.add(float(t), reading(100))  # flat for 100 s
    for t in range(100, 112, 2):
        look = watch.add(float(t), reading(100 + 3 * (t - 98)))  # then 3 MiB/s
    assert look.rate == pytest.approx(3 * MiB, rel=0.2)


def test_restart_early_is_asked_once_within_restart_within():
    """2 MiB/s towards 200 MiB: asked from the first look with 30 s or less left (again at
    each look while no quiet moment came), and no more once the restart is under way."""
    watch = MemoryWatch(MemoryConfig(restart_early=True, restart_within=30.0))
    looks = [watch.add(float(t), reading(100 + 2 * t)) for t in range(30)]
    asked = [look for look in looks if look.restart]
    assert asked and all(look.minutes_left * 60 <= 30 for look in asked)
    assert all(look.minutes_left * 60 > 30 for look in looks[MIN_READINGS - 1:looks.index(asked[0])])
    watch.asked_restart()
    assert not watch.add(31.0, reading(162)).restart
    assert not any(look.restart for look in
                   (MemoryWatch(MemoryConfig()).add(float(t), reading(100 + 2 * t)) for t in range(30)))


def test_slope_is_least_squares():
    assert slope([(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) == pytest.approx(2.0)
    assert slope([(1.0, 1.0), (1.0, 2.0)]) is None and slope([]) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's reading")
def test_this_process_is_read_with_its_bound():
    """Resident size, and the room under this process's cgroup limit or the machine's memory."""
    r = memuse.read_memory(os.getpid())
    assert r is not None and r.measure == "rss" and r.used > 0 and r.limit and r.room is not None
    assert r.bound == "machine memory" or r.bound.startswith("cgroup ")
    assert memuse.read_memory(2**22 + 12345) is None  # no such process


def test_sysctl_command_follows_the_man_page_synopsis():
    """sysctl(8): ``sysctl [-bdehiNnoqx] name[=value] ...``; without -n each answer is
    ``name: value``, so the answer names itself."""
    argv = memuse.sysctl_command()
    assert argv[0].endswith("/sysctl") and all(not a.startswith("-") and "=" not in a for a in argv[1:])
    assert set(argv[1:]) == {"iogpu.wired_limit_mb", "kern.memorystatus_vm_pressure_level", "hw.memsize"}


def test_status_shows_the_memory_line_and_its_minutes_left(tmp_path):
    """What the watcher saved (the state file's ``memory``) as status shows it, damaged values dropped."""
    from mlxwatch.config import Config, InstanceConfig
    from mlxwatch.daemon.status import collect_status
    from mlxwatch.journal.state import StateFile
    from mlxwatch.output.status import status_lines

    state = StateFile(tmp_path, None)
    state.update("gemma", state="healthy", url="http://127.0.0.1:8000",
                 memory={"used": 150 * MiB, "limit": 180 * MiB, "room": 30 * MiB, "bound": "cgroup /lab",
                         "measure": "rss", "rate": 2.0 * MiB, "minutes_left": 0.25, "pressure": None})
    state.flush()
    status = collect_status(Config(None, (InstanceConfig("gemma", "http://127.0.0.1:8000"),), tmp_path), tmp_path)
    memory = status["instances"][0]["memory"]
    assert memory["minutes_left"] == 0.25 and memory["bound"] == "cgroup /lab"
    lines = [t.plain for t in status_lines(status, 120)]
    assert ("  memory: 150 MiB of 180 MiB (cgroup /lab), +2.0 MiB/s: out of memory in less than a minute"
            in lines), lines
