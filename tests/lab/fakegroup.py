"""A stand-in ``mlx.launch`` group with no model, for the fast tier: real processes, real ports.

Two small scripts written into ``workdir/bin`` under the names mlxwatch recognizes:
``mlx.launch`` (starts ``-n N`` ranks with ``MLX_RANK`` and an ``MLX_HOSTFILE`` of the ring's
addresses, pipes their output to its own as the real launcher does, and ends the others and
exits non-zero when one rank exits non-zero) and ``mlx_lm.server`` (rank 0 serves the
chat-completions stream on ``--port``, every other rank waits). What the real ones do that the
issue measured, they do too: a rank whose launcher was killed keeps the port, and each request
it cannot log (its output pipe broken) is closed with no response; a rank 0 that cannot bind
says ``OSError: [Errno 98] Address already in use`` and waits for ever; a rank that loses its
peer's pipe exits. ``mode`` (a file) switches rank 0's answers: ``ok``, ``hang``, ``slow S``.
Under ``tests/lab/keepalive.py`` (always) it is relaunched whenever the launcher exits::

    group = FakeGroup.start(tmp_path)
    group.kill_launcher(); group.stop()
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lab.ports import free_port
from mlxwatch.host.group import Group, find_group
from mlxwatch.host.process import lookup_server

KEEPALIVE = str(Path(__file__).with_name("keepalive.py"))

LAUNCHER = r'''
import json, os, subprocess, sys, tempfile, threading, time
args = sys.argv[1:]
n = int(args[args.index("-n") + 1])
port = int(args[args.index("--starting-port") + 1])
command = args[args.index("--") + 1:]
fd, hostfile = tempfile.mkstemp()
os.write(fd, json.dumps([["127.0.0.1:%d" % (port + r)] for r in range(n)]).encode())
os.close(fd)
ranks = [subprocess.Popen(command, env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": hostfile},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(n)]
def forward(proc):
    for line in proc.stdout:
        sys.stdout.buffer.write(line)
        sys.stdout.buffer.flush()
for proc in ranks:
    threading.Thread(target=forward, args=(proc,), daemon=True).start()
while True:
    codes = [p.poll() for p in ranks]
    if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
        for r, c in enumerate(codes):
            if c not in (None, 0):
                print("[WARNING] Node with rank %d exited with code %d" % (r, c), flush=True)
        for p in ranks:
            if p.poll() is None:
                p.terminate()
        for p in ranks:
            p.wait()
        sys.exit(1 if any(c not in (None, 0) for c in codes) else 0)
    time.sleep(0.1)
'''

SERVER = r'''
import json, os, socket, sys, threading, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
mode_file = args[args.index("--mode-file") + 1]
rank = int(os.environ["MLX_RANK"])
import signal
def on_term(signum, frame):  # the signals a rank got, in a file (its output pipe may be broken)
    with open(os.path.join(os.path.dirname(mode_file), "signals"), "a") as fh:
        fh.write("rank %d %s\n" % (rank, signal.Signals(signum).name))
    os._exit(0)
signal.signal(signal.SIGTERM, on_term)
def say(text):
    print("rank %d: %s" % (rank, text), flush=True)
def mode():
    try:
        return open(mode_file).read().split() or ["ok"]
    except OSError:
        return ["ok"]
def answer(conn):
    try:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                return
            head += chunk
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        say(line)  # as mlx-lm logs each request: a broken pipe here drops the request unanswered
        words = mode()
        if " /v1/chat/completions" not in line:
            body = b'{"status": "ok"}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                         b"Connection: close\r\n\r\n%s" % (len(body), body))
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        if words[0] == "hang":
            time.sleep(3600)
        if words[0] == "slow":
            time.sleep(float(words[1]))
        for text in ("O", "K"):
            conn.sendall(b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text},
                                                              "finish_reason": None}]}).encode() + b"\n\n")
        conn.sendall(b"data: [DONE]\n\n")
    except OSError:
        pass
    finally:
        conn.close()
if rank != 0:
    while True:  # waits for rank 0 in the collective; ends with its launcher's group
        time.sleep(1)
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    sock.bind(("127.0.0.1", port))
except OSError as exc:
    say("OSError: %s" % exc)  # the real rank 0 then waits in threading._shutdown for ever
    while True:
        time.sleep(1)
sock.listen(64)
say("listening on %d" % port)
while True:
    conn, _ = sock.accept()
    threading.Thread(target=answer, args=(conn,), daemon=True).start()
'''


@dataclass
class FakeGroup:
    workdir: Path
    port: int
    ring_port: int
    ranks: int = 2
    backend: str = "ring"  # as the launcher's command line says (what mlxwatch reads)
    _popen: subprocess.Popen | None = field(default=None, repr=False)

    @classmethod
    def start(cls, workdir: Path, ranks: int = 2, ready_timeout: float = 30.0, backend: str = "ring") -> "FakeGroup":
        bindir = workdir / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        for name, text in (("mlx.launch", LAUNCHER), ("mlx_lm.server", SERVER)):
            (bindir / name).write_text(f"#!{sys.executable}\n{text}")
            (bindir / name).chmod(0o755)
        group = cls(workdir, free_port(), free_port(), ranks, backend)
        group.set_mode("ok")
        group.launch(ready_timeout)
        return group

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "group.log"

    def command(self) -> list[str]:
        bindir = self.workdir / "bin"
        return [sys.executable, str(bindir / "mlx.launch"), "-n", str(self.ranks), "--backend", self.backend,
                "--starting-port", str(self.ring_port), "--", sys.executable, str(bindir / "mlx_lm.server"),
                "--port", str(self.port), "--mode-file", str(self.workdir / "mode")]

    def set_mode(self, *words: str) -> None:
        tmp = self.workdir / "mode.tmp"
        tmp.write_text(" ".join(words))
        os.replace(tmp, self.workdir / "mode")

    def launch(self, ready_timeout: float = 30.0) -> None:
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen([sys.executable, KEEPALIVE, "--grace", "2", "--", *self.command()],
                                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           cwd=self.workdir)
        if ready_timeout > 0:
            assert self.wait_answers(ready_timeout), self.log_path.read_text()[-2000:]

    def answers(self, timeout: float = 5.0) -> bool:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        try:
            with httpx.Client(trust_env=False, timeout=timeout) as client:
                response = client.post(f"{self.url}/v1/chat/completions", json=body)
                return response.status_code == 200 and "[DONE]" in response.text
        except httpx.HTTPError:
            return False

    def wait_answers(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.answers(2.0):
                return True
            time.sleep(0.1)
        return False

    def group(self) -> Group | None:
        found = lookup_server(self.url)
        return find_group(found.identity.pid) if found.identity else None

    def signals(self) -> list[str]:
        """"rank N SIGNAME" for each SIGTERM a rank got (a SIGKILL leaves no line)."""
        try:
            return (self.workdir / "signals").read_text().splitlines()
        except FileNotFoundError:
            return []

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """End the supervisor by its PID: it ends, by PID, every process below it (orphans too:
        it is their subreaper)."""
        proc, self._popen = self._popen, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
