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
- ``prefill MS [idle] [hang [CHUNKS] | livelock]``  a big model reading a prompt: each batch step
            costs MS milliseconds per prompt token it read (the step's own count of them, the one its
            stats report; a step reads at most one ``--prefill-step-size`` chunk of each prompt),
            paid after the real work and before the step's ``Prompt processing progress: X/Y``.
            By default the cost is real MLX work on the CPU (the process computes); with ``idle``
            the thread sleeps (the process idles, as a Mac's does while its GPU computes). A
            request served alone (a ``seed``) pays the same per chunk. Write it before the server
            starts and it is on from the first request, so probes see the same speed. Then:
    - ``hang [CHUNKS]``: once a prompt longer than one chunk has read CHUNKS chunks (default 1;
      ``X/Y`` with X < Y logged), the next step blocks for good, as ``block`` does.
    - ``livelock``: once a prompt longer than one chunk is read to its end (``N/N`` logged),
      every step returns nothing while burning CPU, as ``spin`` does: the livelock of the
      report, after the prefill. It lasts while the file says so.

    Each prints ``mlxwatch lab: prefill hang|livelock begins at UNIX_TIME`` to the server's log
    when it begins (the onset a benchmark times from). Both are the batch loop's only: a
    request served alone pays the cost and never hangs.

Both mlx-lm 0.31.3 and 0.32.x read a chunk a prompt a step in ``BatchGenerator._next`` and
count the tokens it read (0.32: ``_counters.prompt_tokens``; 0.31.3: ``_prompt_tokens_counter``),
so ``prefill`` behaves the same on both.
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
from dataclasses import dataclass

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


@dataclass(frozen=True)
class PrefillFault:
    """``prefill MS [idle] [hang [CHUNKS] | livelock]``, parsed (see the module's docstring)."""

    ms: float  # per prompt token read
    idle: bool = False  # sleep instead of computing
    then: str = ""  # "", "hang" or "livelock"
    chunks: int = 1  # hang: after this many chunks of a long prompt


def parse_prefill(text: str) -> PrefillFault:
    """The ``prefill`` fault's words; ValueError naming the bad word."""
    words = text.split()
    if not words or words[0] != "prefill":
        raise ValueError(f"not a prefill fault: {text!r}")
    if len(words) < 2:
        raise ValueError("prefill: give the milliseconds per prompt token, e.g. 'prefill 12'")
    try:
        ms = float(words[1])
    except ValueError:
        raise ValueError(f"prefill: milliseconds per prompt token must be a number, not {words[1]!r}") from None
    if not ms >= 0:
        raise ValueError(f"prefill: milliseconds per prompt token must be >= 0, not {words[1]!r}")
    rest = words[2:]
    idle = rest[:1] == ["idle"]
    rest = rest[1:] if idle else rest
    then, chunks = "", 1
    if rest[:1] == ["hang"]:
        then, rest = "hang", rest[1:]
        if rest:
            if not rest[0].isdigit() or int(rest[0]) < 1:
                raise ValueError(f"prefill: hang after how many chunks (>= 1), not {rest[0]!r}")
            chunks, rest = int(rest[0]), rest[1:]
    elif rest[:1] == ["livelock"]:
        then, rest = "livelock", rest[1:]
    if rest:
        raise ValueError(f"prefill: unexpected {rest[0]!r} (expected idle, then hang [CHUNKS] or livelock)")
    return PrefillFault(ms, idle, then, chunks)


def read_prefill(path: str) -> PrefillFault | None:
    """The control file's ``prefill`` fault, or None when it names another (or none)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return None
    return parse_prefill(text) if text.split()[:1] == ["prefill"] else None


def _pay(seconds: float, idle: bool) -> None:
    """Take ``seconds`` of wall time: asleep (``idle``) or computing real MLX work."""
    if seconds <= 0:
        return
    if idle:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        _spin_step()


def _prompt_tokens_read(generator) -> int:
    """The prompt tokens ``generator`` has counted as read so far (0.32: ``_counters``; 0.31.3 its own)."""
    counters = getattr(generator, "_counters", None)
    if counters is not None:
        return counters.prompt_tokens
    return generator._prompt_tokens_counter


def _long_prompt_read(generator, chunks: int) -> bool:
    """A prompt longer than one chunk has read at least ``chunks`` chunks and has more to read
    (``_currently_processing`` rows are ``[segments, read, total]`` in 0.31.3 and 0.32.x)."""
    step = generator.prefill_step_size
    return any(total > step and read >= chunks * step and total - read > 1
               for _, read, total in generator._currently_processing)


def _stamp(shape: str) -> None:
    """The onset, in the server's log (a benchmark times from it)."""
    print(f"mlxwatch lab: prefill {shape} begins at {time.time():.3f}", file=sys.stderr, flush=True)


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

    threading.Thread(target=_leak_while_asked, args=(fault_file,), name="lab-leak", daemon=True).start()

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
            if fault == "prefill":
                return self._prefill_next(*args, **kwargs)
            return super().next(*args, **kwargs)

        def _prefill_next(self, *args, **kwargs):
            spec = read_prefill(fault_file) or PrefillFault(0.0)  # the file changed since read_fault
            if spec.then == "livelock" and getattr(self, "_lab_livelocked", False):
                return _spin_step()
            if spec.then == "hang" and _long_prompt_read(self, spec.chunks):
                _stamp("hang")
                _block_forever()
            before = _prompt_tokens_read(self)
            prompt_responses, generation_responses = super().next(*args, **kwargs)
            _pay((_prompt_tokens_read(self) - before) * spec.ms / 1000.0, spec.idle)
            if spec.then == "livelock" and any(
                    r.end_of_prompt and r.progress[1] > self.prefill_step_size for r in prompt_responses):
                self._lab_livelocked = True  # this step's N/N still goes out; nothing after it
                _stamp("livelock")
            return prompt_responses, generation_responses

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
        progress = kwargs.get("prompt_progress_callback")
        if progress is not None:  # prefill: each chunk's cost, paid before its progress is reported
            read = [0]

            def paying_progress(processed, total):
                spec = read_prefill(fault_file)
                if spec is not None:
                    _pay((processed - read[0]) * spec.ms / 1000.0, spec.idle)
                read[0] = processed
                progress(processed, total)

            kwargs["prompt_progress_callback"] = paying_progress
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
