"""Run the real ``mlx_lm.server`` with a fault that a control file switches on at run time.

Run with the *server's* interpreter; it imports nothing from mlxwatch::

    python fault_server.py --fault-file PATH -- --model DIR --port 8080

It replaces ``mlx_lm.server.BatchGenerator`` with a subclass whose ``next()`` (the one call the
server's batch loop makes per step) reads the control file and misbehaves the way real servers
were seen to. Everything else is the stock server, so a probe meets the real HTTP, queueing and
streaming code. Faults (the file's first word; empty or missing file = healthy):

- ``die``   raise the OOM seen in the field: the generation thread dies.
- ``block`` wait forever on a lock: thread alive, 0% CPU, identical stacks.
- ``spin``  return no results while burning CPU in real MLX work: the loop keeps stepping
            and nothing reaches any client (the livelock of mlx-lm #1493).
- ``slow [SECONDS]`` delay each step (default 0.5 s), and each token of a request served
            alone (the non-batched path: a ``seed``); output stays correct.
- ``gil``   hold the GIL forever in a native call (libc ``sleep`` through ctypes.PyDLL, which
            keeps the GIL): no Python thread runs, HTTP included; 0% CPU.
- ``leak [MIB_PER_S]`` the process grows by that much resident memory a second (default 4),
            served or idle (a thread of its own, not the batch step), until it is killed; the
            server answers meanwhile.

Once ``block`` has started it never returns; ``spin`` and ``slow`` follow the file each step.
"""

from __future__ import annotations

import os
import sys
import threading
import time

FAULT_FILE_ENV = "MLXWATCH_FAULT_FILE"


def read_fault(path: str) -> tuple[str, float | None]:
    """The fault named in the control file, and its optional number."""
    try:
        with open(path, encoding="utf-8") as fh:
            words = fh.read().split()
    except OSError:
        return "", None
    if not words:
        return "", None
    arg = float(words[1]) if len(words) > 1 else None
    return words[0], arg


def _block_forever() -> None:
    threading.Event().wait()


def _hold_gil_forever() -> None:
    import ctypes

    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call
    while True:
        libc.sleep(3600)


def _spin_step() -> tuple[list, list]:
    import mlx.core as mx

    a = mx.random.normal((256, 256))
    for _ in range(4):
        a = a @ a
        a = a / mx.abs(a).max()
    mx.eval(a)
    return [], []


LEAK_TICK = 0.1  # seconds between the leak's allocations


def _leak_while_asked(fault_file: str) -> None:
    """The ``leak`` fault: touched (resident) pages, kept, at the asked rate while the file asks."""
    kept = []
    while True:
        fault, arg = read_fault(fault_file)
        if fault == "leak":
            kept.append(b"\xa5" * int((arg if arg is not None else 4.0) * 1024 * 1024 * LEAK_TICK))
        time.sleep(LEAK_TICK)


def install(fault_file: str) -> None:
    """Patch the server's batch generator so that each step consults ``fault_file``."""
    import mlx_lm.server as server

    threading.Thread(target=_leak_while_asked, args=(fault_file,), name="lab-leak", daemon=True).start()

    base = server.BatchGenerator

    class FaultyBatchGenerator(base):  # type: ignore[misc, valid-type]
        def next(self, *args, **kwargs):
            fault, arg = read_fault(fault_file)
            if fault == "die":
                raise RuntimeError("[metal::malloc] Resource limit (499000) exceeded.")
            if fault == "block":
                _block_forever()
            if fault == "gil":
                _hold_gil_forever()
            if fault == "spin":
                return _spin_step()
            if fault == "slow":
                time.sleep(arg if arg is not None else 0.5)
            return super().next(*args, **kwargs)

    server.BatchGenerator = FaultyBatchGenerator  # type: ignore[misc]  # the fault, patched in place

    single = server.stream_generate  # a request that cannot be batched (a seed) is served by it

    def slow_stream_generate(*args, **kwargs):
        for item in single(*args, **kwargs):
            fault, arg = read_fault(fault_file)
            if fault == "slow":
                time.sleep(arg if arg is not None else 0.5)
            yield item

    server.stream_generate = slow_stream_generate


def main(argv: list[str]) -> None:
    fault_file = os.environ.get(FAULT_FILE_ENV, "")
    if len(argv) >= 2 and argv[0] == "--fault-file":
        fault_file, argv = argv[1], argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not fault_file:
        sys.exit("fault_server.py: give --fault-file PATH or set " + FAULT_FILE_ENV)
    install(fault_file)
    import mlx_lm.server as server

    sys.argv = ["mlx_lm.server", *argv]
    server.main()


if __name__ == "__main__":
    main(sys.argv[1:])
