"""One kernel dump serves every instance, read in place (``KernelCounters.fresh``): most looks
of a large fleet need no thread (measured before: 100 instances @ 5 s reading through the
daemon's thread pool put the p99 gap between probes at 156 % of the interval)."""

from __future__ import annotations

import threading

from mlxwatch.evidence import Window
from mlxwatch.evidence.kernel import KernelSource
from mlxwatch.host.sockets import KernelCounters, Reading


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_fresh_dump_is_read_in_place_and_a_stale_one_is_not():
    clock, dumps = Clock(), []
    counters = KernelCounters(reader=lambda ports: dumps.append(set(ports)) or Reading(clock.t, ()), clock=clock)
    assert counters.fresh(8080) is None  # nothing dumped yet
    counters.read(8080, max_age=2.5)
    assert counters.fresh(8080, max_age=2.5) is not None and len(dumps) == 1
    assert counters.fresh(9090, max_age=2.5) is None  # a port the last dump did not ask about
    clock.t += 3.0
    assert counters.fresh(8080, max_age=2.5) is None  # too old: a new dump is needed
    counters.close()


def test_a_dump_under_way_in_another_thread_is_not_waited_for():
    started, release = threading.Event(), threading.Event()

    def slow(ports):
        started.set()
        release.wait(5)
        return Reading(0.0, ())

    counters = KernelCounters(reader=slow)
    dumper = threading.Thread(target=counters.read, args=(8080,))
    dumper.start()
    started.wait(5)
    assert counters.fresh(8080) is None  # the lock is held: never block the event loop
    release.set()
    dumper.join(5)
    counters.close()


async def test_looks_of_many_instances_share_one_dump_in_place():
    clock, dumps = Clock(), []
    counters = KernelCounters(reader=lambda ports: dumps.append(1) or Reading(clock.t, ()), clock=clock)
    sources = [KernelSource(counters, 8000 + i, lambda: 8.0, clock=clock) for i in range(50)]
    for s in sources:
        await s.look(Window(clock.t - 1, clock.t))
    assert len(dumps) <= 50  # each new port makes one dump ...
    clock.t += 5.0
    before, submitted = len(dumps), []
    executor = counters.executor

    class Counted:
        def submit(self, fn, *args):
            submitted.append(fn)
            return executor.submit(fn, *args)

    counters.executor = Counted()  # type: ignore[assignment]
    for s in sources:
        await s.look(Window(clock.t - 1, clock.t))
    assert len(dumps) - before == 1  # ... then one dump serves all fifty,
    assert len(submitted) == 1  # and the 49 others read it in place, no thread
    counters.executor = executor
    counters.close()
