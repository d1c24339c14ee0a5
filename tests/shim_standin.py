"""A stand-in ``mlx_lm`` package for the shim's tests: no MLX, no model, milliseconds to start.

``write_standin(root, seam=True)`` writes ``root/mlx_lm/{__init__,generate,server}.py``. Its
server runs a batch loop shaped like mlx-lm's (a ``ResponseGenerator`` whose generation thread
calls ``BatchGenerator.next()`` and inserts requests with ``insert``), steered by the first
word of the file named in ``$STANDIN_MODE_FILE``:

    work    keep one request in flight, 5 tokens each (default)
    idle    insert nothing (no request in flight)
    spin    requests in flight, ``next`` returns ([], []): steps without tokens
    block   ``next`` waits forever (GIL released)
    gil     ``next`` holds the GIL forever in libc sleep (ctypes.PyDLL)
    die     ``next`` raises RuntimeError
    die_outside   the loop raises outside ``next``
    stop    the loop ends cleanly (``_stop``)
    shape   ``next`` returns a list, not (prompt, generation) responses

``$STANDIN_STYLE`` 31 (default) makes the thread's target ``_generate`` (the exception reaches
threading.excepthook, like mlx-lm 0.31); 32 wraps it in ``_run_generate`` that logs and
swallows it (like 0.32). ``seam=False`` writes a server without ``BatchGenerator`` (a future
mlx-lm whose seam is gone). ``python -m mlx_lm.server`` and ``import mlx_lm.server; main()``
both work.
"""

from __future__ import annotations

from pathlib import Path

INIT = '__version__ = "0.0.0-standin"\n'

GENERATE = '''
import ctypes, os, threading, time
from dataclasses import dataclass
from typing import Optional


def mode():
    try:
        with open(os.environ["STANDIN_MODE_FILE"]) as fh:
            words = fh.read().split()
        return words[0] if words else "work"
    except (KeyError, OSError):
        return "work"


@dataclass
class PromptResponse:
    uid: int
    progress: tuple


@dataclass
class GenResponse:
    uid: int
    token: int
    finish_reason: Optional[str]


class BatchGenerator:
    def __init__(self):
        self.active = {}
        self.next_uid = 0
        self.prompted = set()

    def insert_segments(self, segments, max_tokens=None):
        uids = []
        for _, n in zip(segments, max_tokens or [5] * len(segments)):
            self.active[self.next_uid] = n
            uids.append(self.next_uid)
            self.next_uid += 1
        return uids

    def insert(self, prompts, max_tokens=None):
        return self.insert_segments([[p] for p in prompts], max_tokens)

    def next(self):
        m = mode()
        if m == "block":
            threading.Event().wait()
        if m == "gil":
            while True:
                ctypes.PyDLL(None).sleep(3600)
        if m == "die":
            raise RuntimeError("[metal::malloc] Resource limit (499000) exceeded.")
        if m == "spin":
            time.sleep(0.01)
            return [], []
        if m == "shape":
            return []
        prompt = [PromptResponse(u, (3, 3)) for u in self.active if u not in self.prompted]
        self.prompted.update(r.uid for r in prompt)
        gen = []
        for uid in list(self.active):
            self.active[uid] -= 1
            done = self.active[uid] == 0
            gen.append(GenResponse(uid, 42, "length" if done else None))
            if done:
                del self.active[uid]
        return prompt, gen

    def remove(self, uids):
        for uid in uids:
            self.active.pop(uid, None)

    def close(self):
        self.active.clear()


def stream_generate(n=3):
    for i in range(n):
        yield GenResponse(0, i, "length" if i == n - 1 else None)
'''

SERVER = '''
import logging, os, sys, threading, time
from queue import Queue
{imports}


class ResponseGenerator:
    def __init__(self):
        self.requests = Queue()
        self._stop = False
        self._generation_failed = False
        target = self._run_generate if os.environ.get("STANDIN_STYLE") == "32" else self._generate
        self._generation_thread = threading.Thread(target=target)
        self._generation_thread.start()

    def _run_generate(self):
        try:
            self._generate()
        except Exception as e:
            logging.exception(f"mlx_lm.server generation thread died: {{e}}")
            self._generation_failed = True

    def _generate(self):
{loop}


def main():
    logging.basicConfig(level=logging.INFO)
    print("standin: serving", flush=True)
    rg = ResponseGenerator()
    while rg._generation_thread.is_alive() or os.environ.get("STANDIN_STAY") == "1":
        time.sleep(0.1)
    print("standin: generation thread ended", flush=True)


if __name__ == "__main__":
    main()
'''

LOOP_WITH_SEAM = '''
        bg = BatchGenerator()
        while not self._stop:
            m = mode()
            if m == "stop":
                self._stop = True
                break
            if m == "die_outside":
                raise ValueError("died outside next")
            if m != "idle" and not bg.active:
                bg.insert([[1, 2, 3]], [5])
            if m == "single":
                for _ in stream_generate(3):
                    pass
            if bg.active or m in ("block", "gil", "die", "shape"):
                bg.next()
            time.sleep(0.01)
'''

LOOP_WITHOUT_SEAM = '''
        while not self._stop:
            if mode() == "stop":
                self._stop = True
            time.sleep(0.01)
'''


def write_standin(root: Path, seam: bool = True) -> Path:
    pkg = root / "mlx_lm"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(INIT)
    (pkg / "generate.py").write_text(GENERATE)
    if seam:
        imports = "from .generate import BatchGenerator, mode, stream_generate"
        loop = LOOP_WITH_SEAM
    else:
        imports = "from .generate import mode"
        loop = LOOP_WITHOUT_SEAM
    (pkg / "server.py").write_text(SERVER.format(imports=imports, loop=loop.rstrip("\n")))
    if not seam:
        text = (pkg / "generate.py").read_text()
        (pkg / "generate.py").write_text(text.replace("class BatchGenerator:", "class _NotTheSeam:"))
    return root
