"""What one hop through a proxy adds to a first token, alone: direct vs nginx vs a bare CPython
relay vs the front door, on a server that answers at once.

    .venvs/test/bin/python -m bench.front_hop [--rounds 8] [--requests 1000] [--idle-requests 200]
    bash bench/run.sh front_hop ...           # the same, after installing nginx from Debian's package

``bench/front_perf.py`` measures the door as clients meet it (streams of 50 tokens at 50 tok/s);
there a hop's fraction of a millisecond sits under the stand-in's own timing noise, and a
1-stream cell holds about ten first tokens. This bench takes the server's time out: an upstream
that answers each streaming request at once (head, one token, finish, ``[DONE]``), and one client
on one kept-alive connection timing, per request, send to the first token's arrival
(raw sockets, no client library). Two modes:

- **hot**: requests back to back (``--requests`` per cell): the hop's cost on a busy proxy;
- **idle**: ``--pause`` s between requests (``--idle-requests`` per cell): the proxy has slept
  since the last token, as it has between the tokens of a 50 tok/s stream, and wakes cold.

Paths: direct; nginx (one worker, as in front_perf); ``relay``: asyncio's transports and httptools
with nothing else (``bench/front_alternative.py --library relay``), the least an asyncio proxy
does, so the floor under the door; the door (``mlxwatch.front.FrontDoor``, its own process, as the
daemon runs it); the relay and the door on uvloop's event loop (what that loop would buy); and
``threads``: the relay's work on a thread per connection with blocking sockets (what CPython's
other I/O model would buy). ``--kinds`` measures some of them only.
Every proxy runs for the whole bench; the cells of a round run in a shuffled order, and each
path's added latency is paired with direct's cell of the same round (median over rounds).

``--upstream-closes``: the upstream answers as mlx_lm.server does (``http.server``: HTTP/1.0, the
body until it closes the connection), so every proxy connects to it once per request, and a
direct client too (its time counts from its connect). This is the hop mlx_lm.server's users get.
The threaded relay connects again after each close; the asyncio relay, which only keeps its
server connections, is not measured in this mode.

Writes ``bench/front_hop.json`` and the section "The front door's hop, alone" of ``bench/RESULTS.md``
(with ``--upstream-closes``: ``bench/front_hop_closing.json`` and its own section).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench.common import ROOT, VENVS, git_commit, load_average, log, machine, paths_option, write_section
from bench.front_perf import Proc, _wait_ready, find_nginx, start_proxy

SECTION = "## The front door's hop, alone (direct vs nginx vs a bare relay vs the door)"
SECTION_CLOSING = "## The front door's hop in front of a server that closes every connection (as mlx_lm.server)"
CLOSING_KINDS = ("direct", "nginx", "door", "door+uvloop", "threads")  # the asyncio relay keeps its server connections
KINDS = ("direct", "nginx", "relay", "door", "relay+uvloop", "door+uvloop", "threads")
LABELS = {"relay": "bare CPython relay (asyncio + httptools)", "door": "front door",
          "relay+uvloop": "bare relay on uvloop", "door+uvloop": "front door on uvloop",
          "threads": "bare relay on threads (blocking sockets)"}
PATH_ = "/v1/chat/completions"
BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "stream": True}).encode()
REQUEST = (b"POST " + PATH_.encode() + b" HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
WARM = 20  # requests per connection before timing (the connection and the proxy's upstream connection made)
PER_CONNECTION = 500  # timed requests per client connection


def _event(delta: dict[str, Any], finish: str | None) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


TOKEN = _event({"content": " tok"}, None)
END = _event({}, "length") + b"data: [DONE]\n\n"


async def _upstream(ready: Path, closes: bool) -> None:
    """The instant server (role ``upstream``): each request answered at once, head and token in one
    write, then the end; keep-alive, or (``closes``) HTTP/1.0 ending each answer with the connection."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if closes:  # one answer, its body ending with the connection
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(_length(head))
                writer.write(b"HTTP/1.0 200 OK\r\nContent-type: text/event-stream\r\nCache-Control: no-cache\r\n\r\n"
                             + TOKEN)
                writer.write(END)
                await writer.drain()
                writer.close()
                return
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(_length(head))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                             + b"%x\r\n%b\r\n" % (len(TOKEN), TOKEN))
                writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(END), END))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(str(server.sockets[0].getsockname()[1]))
    os.replace(tmp, ready)
    await stop.wait()
    server.close()


def _length(head: bytes) -> int:
    return next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                 if line.lower().startswith(b"content-length:")), 0)


def time_direct_closing(port: int, requests: int, pause: float) -> list[float]:
    """First-token times (µs) straight to a server that closes every connection: a client
    connects for each request, so its time counts from the connect."""
    out: list[float] = []
    for i in range(WARM + requests):
        if pause:
            time.sleep(pause)
        sent = time.perf_counter()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(REQUEST)
            buf, first = b"", None
            while data := sock.recv(65536):
                buf += data
                if first is None and b'"content"' in buf:
                    first = time.perf_counter() - sent
        if first is None:
            raise RuntimeError(f"port {port}: an answer without its token")
        if i >= WARM:
            out.append(first * 1e6)
    return out


def time_cell(port: int, requests: int, pause: float) -> list[float]:
    """First-token times (µs) of ``requests`` requests, on kept-alive connections of at most
    PER_CONNECTION requests (nginx closes one after 1,000), the first WARM of each not timed."""
    out: list[float] = []
    while len(out) < requests:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(WARM + min(PER_CONNECTION, requests - len(out))):
                if pause:
                    time.sleep(pause)
                sent = time.perf_counter()
                sock.sendall(REQUEST)
                buf, first = b"", None
                while not buf.endswith(b"0\r\n\r\n"):
                    data = sock.recv(65536)
                    if not data:
                        raise RuntimeError(f"port {port}: the connection closed mid-answer")
                    buf += data
                    if first is None and b'"content"' in buf:
                        first = time.perf_counter() - sent
                if i >= WARM and first is not None:
                    out.append(first * 1e6)
    return out


def summarise(rounds: list[dict[str, float]], kinds: list[str]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for kind in kinds:
        med = [r[kind] for r in rounds if kind in r]
        added = [r[kind] - r["direct"] for r in rounds if kind in r and "direct" in r]
        out[kind] = {"first_token_us": statistics.median(med) if med else None,
                     "added_us": statistics.median(added) if added and kind != "direct" else None}
    ngx = out.get("nginx", {}).get("added_us")
    for kind in kinds:
        a = out[kind]["added_us"]
        out[kind]["x_nginx"] = a / ngx if a is not None and ngx and ngx > 0 else None
    return out


def _output(closes: bool) -> tuple[str, str]:
    """Where a run writes: its JSON's name (``bench/<name>.json``) and its RESULTS.md section."""
    return ("front_hop_closing", SECTION_CLOSING) if closes else ("front_hop", SECTION)


def render(data: dict[str, Any]) -> str:
    m = data["machine"]
    closes = data.get("upstream_closes", False)
    name, section = _output(closes)
    lines = [section, "",
             f"`{data['command']}` (`bench/front_hop.py`), run on {data['date']} from commit {data['commit']} on "
             f"{m.get('cpus', '?')} cores; load average {data['load_before']} before, {data['load_after']} after "
             f"({data.get('machine_note') or 'shared machine'}). Raw data in `bench/{name}.json`. "
             f"{data['rounds']} rounds; per round and path one cell of {data['requests']} requests back to back "
             f"(hot) and one of {data['idle_requests']} requests {data['pause'] * 1e3:g} ms apart (idle), cells "
             "in a shuffled order. First token: median of a cell, then the median over rounds; added: paired "
             "with direct's cell of the same round. nginx " + (data.get("nginx_version") or "not found") + "."
             + (" The upstream answers as mlx_lm.server does (HTTP/1.0, the body until it closes the connection): "
                "each request needs a new connection to it. A direct client connects for each, timed from its "
                "connect; nginx and the threaded relay connect for each too (nginx as in front_perf: HTTP/1.1 to "
                "the upstream, which answers HTTP/1.0); the door connects ahead, so a request goes out on a "
                "connection made before it came (`UpstreamPool`, since commit c195957)." if closes else ""), "",
             "| path | hot: first token (µs) | hot: added (µs) | hot: × nginx's | idle: first token (µs) "
             "| idle: added (µs) | idle: × nginx's |", "|---|---|---|---|---|---|---|"]

    def cell(row: dict[str, float | None], key: str, spec: str) -> str:
        v = row.get(key)
        return "–" if v is None else format(v, spec)

    for kind in data["kinds"]:
        hot, idle = data["summary"]["hot"][kind], data["summary"]["idle"][kind]
        lines.append(f"| {LABELS.get(kind, kind)} | {cell(hot, 'first_token_us', '.0f')} | "
                     f"{cell(hot, 'added_us', '+.0f')} | {cell(hot, 'x_nginx', '.1f')} | "
                     f"{cell(idle, 'first_token_us', '.0f')} | {cell(idle, 'added_us', '+.0f')} | "
                     f"{cell(idle, 'x_nginx', '.1f')} |")
    lines += ["", *data.get("findings", []), ""]
    return "\n".join(lines)


def findings(data: dict[str, Any]) -> list[str]:
    s = data["summary"]
    if "nginx" not in data["kinds"]:
        return []
    out = []
    for mode in ("hot", "idle"):
        if data.get("upstream_closes"):
            door, ngx, uv_door, threaded = (s[mode].get(k, {}).get("added_us")
                                            for k in ("door", "nginx", "door+uvloop", "threads"))
            if door is None or ngx is None or ngx <= 0:
                continue
            line = (f"- **{mode}**: nginx adds {ngx:+.0f} µs, connecting for each request; the door "
                    f"{door:+.0f} µs ({door / ngx:.1f}x nginx's), on a connection made ahead.")
            if uv_door is not None:
                line += f" The door on uvloop {uv_door:+.0f} µs ({uv_door / ngx:.1f}x)."
            if threaded is not None:
                line += (f" The bare relay on threads, connecting for each request, {threaded:+.0f} µs "
                         f"({threaded / ngx:.1f}x).")
            out.append(line)
            continue
        door, relay, ngx = (s[mode].get(k, {}).get("added_us") for k in ("door", "relay", "nginx"))
        if None in (door, relay, ngx) or ngx <= 0:
            continue
        line = (f"- **{mode}**: nginx adds {ngx:+.0f} µs, the bare CPython relay {relay:+.0f} µs ({relay / ngx:.1f}x "
                f"nginx's), the door {door:+.0f} µs ({door / ngx:.1f}x): the door's own work (parsing the request "
                f"for the ledger, a task per request, the gate, the relay's bookkeeping) adds {door - relay:+.0f} µs "
                "over the relay.")
        uv_door, uv_relay = (s[mode].get(k, {}).get("added_us") for k in ("door+uvloop", "relay+uvloop"))
        if uv_door is not None and uv_relay is not None:
            line += f" On uvloop: the relay {uv_relay:+.0f} µs, the door {uv_door:+.0f} µs."
        threaded = s[mode].get("threads", {}).get("added_us")
        if threaded is not None:
            line += f" On threads: the relay {threaded:+.0f} µs ({threaded / ngx:.1f}x nginx's)."
        out.append(line)
    return out


def _write(data: dict[str, Any], no_write: bool) -> None:
    data["findings"] = findings(data)
    section = render(data)
    print(section)
    if no_write:
        return
    name, heading = _output(data.get("upstream_closes", False))
    md = write_section(name, data, heading, section)
    log(f"front_hop: wrote bench/{name}.json and the section in {md}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front_hop", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests", type=int, default=1000, help="hot: requests per cell, back to back")
    parser.add_argument("--idle-requests", type=int, default=200, help="idle: requests per cell, --pause apart")
    parser.add_argument("--pause", type=float, default=0.02, help="idle: seconds between requests")
    parser.add_argument("--uvloop", action=argparse.BooleanOptionalAction, default=True,
                        help="also the relay and the door on uvloop (needs the 'bench' extra)")
    parser.add_argument("--kinds", help="comma-separated paths to measure (default: all; direct is always measured)")
    parser.add_argument("--upstream-closes", action="store_true",
                        help="the upstream closes every connection, as mlx_lm.server does (paths: "
                             + ", ".join(CLOSING_KINDS) + ")")
    parser.add_argument("--machine-note")
    parser.add_argument("--no-write", action="store_true", help="print the section; write neither JSON nor RESULTS.md")
    parser.add_argument("--render-only", action="store_true",
                        help="measure nothing: the section again from bench/front_hop.json, into RESULTS.md")
    parser.add_argument("--role", choices=("upstream",), help=argparse.SUPPRESS)
    parser.add_argument("--closes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "upstream":
        asyncio.run(_upstream(args.ready, args.closes))
        return 0
    if args.render_only:
        name, _ = _output(args.upstream_closes)
        _write(json.loads((ROOT / "bench" / f"{name}.json").read_text()), args.no_write)
        return 0

    nginx = find_nginx(VENVS)
    offered = CLOSING_KINDS if args.upstream_closes else KINDS
    kinds = [k for k in offered if (nginx or k != "nginx") and (args.uvloop or "uvloop" not in k)]
    if args.kinds:
        wanted = {"direct", *paths_option(parser, "--kinds", args.kinds, offered)}
        kinds = [k for k in kinds if k in wanted]
    nginx_version = None
    if nginx:
        import subprocess
        v = subprocess.run([nginx, "-v"], capture_output=True, text=True)
        nginx_version = (v.stderr or v.stdout).strip().split(":", 1)[-1].strip()
    command = "python -m bench.front_hop " + " ".join(argv if argv is not None else sys.argv[1:])
    data: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": git_commit(), "machine": machine(),
        "command": command.strip(), "rounds": args.rounds, "requests": args.requests,
        "idle_requests": args.idle_requests, "pause": args.pause, "kinds": kinds, "nginx_version": nginx_version,
        "load_before": load_average(), "machine_note": args.machine_note, "upstream_closes": args.upstream_closes}
    work = Path(tempfile.mkdtemp(prefix="mlxwatch-front-hop-"))

    def terminated(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks: every process we started is ended

    signal.signal(signal.SIGTERM, terminated)
    procs: list[Proc] = []
    try:
        up = Proc([sys.executable, "-m", "bench.front_hop", "--role", "upstream", "--ready", str(work / "up.port")]
                  + (["--closes"] if args.upstream_closes else []), work / "upstream.log")
        procs.append(up)
        upstream = f"http://127.0.0.1:{_wait_ready(up, work / 'up.port')}"
        ports = {"direct": int(upstream.rsplit(":", 1)[1])}
        for kind in kinds[1:]:
            proc, url = start_proxy(kind, upstream, work, nginx)
            procs.append(proc)
            ports[kind] = int(url.rsplit(":", 1)[1])
        rounds: dict[str, list[dict[str, float]]] = {"hot": [], "idle": []}
        for r in range(args.rounds):
            for mode, n, pause in (("hot", args.requests, 0.0), ("idle", args.idle_requests, args.pause)):
                order = random.sample(kinds, len(kinds))
                medians = {kind: statistics.median(
                    (time_direct_closing if kind == "direct" and args.upstream_closes else time_cell)(ports[kind], n, pause))
                    for kind in order}
                rounds[mode].append(medians)
                log(f"front_hop r{r} {mode}: " + ", ".join(f"{k} {medians[k]:.0f}" for k in kinds) + " µs")
        data["rounds_data"] = rounds
        data["summary"] = {mode: summarise(rounds[mode], kinds) for mode in rounds}
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(work, ignore_errors=True)  # the proxies' configs and logs: nothing is kept
    data["load_after"] = load_average()
    _write(data, args.no_write)
    return 0

if __name__ == "__main__":
    sys.exit(main())
