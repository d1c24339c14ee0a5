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
- ``sequence A B [SECONDS]`` a hang triggered by request content in sequence, as the field
            report's was: a completion whose prompt holds the text ``A``, followed within
            SECONDS (default 5) by a *streamed* completion whose prompt holds ``B``, livelocks
            the server (``spin``, for good: until it is restarted); every other request, and
            either one alone, is served normally.

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
    try:
        arg = float(words[1]) if len(words) > 1 else None
    except ValueError:  # ``sequence`` takes words (read_words)
        arg = None
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


SEQUENCE_WINDOW = 5.0  # ``sequence``: seconds from a request holding A to a streamed one holding B


def prompt_text(body: object) -> str:
    """The prompt a completion request carries: ``prompt`` (text completions) or the messages'
    text (chat), joined."""
    if not isinstance(body, dict):
        return ""
    parts = [body["prompt"]] if isinstance(body.get("prompt"), str) else []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts += [p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "\n".join(parts)


class SequenceTrigger:
    """The ``sequence`` fault's memory: when a prompt holding A last arrived, and whether the
    streamed B that followed it in time has set the livelock off (for the process's life)."""

    def __init__(self) -> None:
        self.a_at: float | None = None
        self.tripped = False
        self.lock = threading.Lock()

    def arrived(self, fault: str, args: list[str], body: object) -> None:
        if fault != "sequence" or len(args) < 2:
            return
        marker_a, marker_b = args[0], args[1]
        window = float(args[2]) if len(args) > 2 else SEQUENCE_WINDOW
        text = prompt_text(body)
        now = time.monotonic()
        with self.lock:
            streamed = isinstance(body, dict) and body.get("stream") is True
            if streamed and marker_b in text and self.a_at is not None and now - self.a_at <= window:
                self.tripped = True
            if marker_a in text:
                self.a_at = now


def read_words(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().split()
    except OSError:
        return []


def install(fault_file: str) -> None:
    """Patch the server's batch generator so that each step consults ``fault_file``."""
    import mlx_lm.server as server

    base = server.BatchGenerator
    trigger = SequenceTrigger()

    class FaultyBatchGenerator(base):  # type: ignore[misc, valid-type]
        def next(self, *args, **kwargs):
            fault, arg = read_fault(fault_file)
            if fault == "die":
                raise RuntimeError("[metal::malloc] Resource limit (499000) exceeded.")
            if fault == "block":
                _block_forever()
            if fault == "gil":
                _hold_gil_forever()
            if fault == "spin" or trigger.tripped:
                return _spin_step()
            if fault == "slow":
                time.sleep(arg if arg is not None else 0.5)
            return super().next(*args, **kwargs)

    server.BatchGenerator = FaultyBatchGenerator  # type: ignore[misc]  # the fault, patched in place

    handler = server.APIHandler
    handle_completion = handler.handle_completion  # called once per completion, its body parsed

    def watched_completion(self, *args, **kwargs):
        words = read_words(fault_file)
        if words:
            trigger.arrived(words[0], words[1:], getattr(self, "body", None))
        return handle_completion(self, *args, **kwargs)

    handler.handle_completion = watched_completion  # type: ignore[method-assign]  # the fault, patched in place

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
