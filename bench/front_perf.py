"""What the front door costs a client, side by side with nginx: direct vs nginx vs the door.

    .venvs/test/bin/python -m bench.front_perf [--streams 1,16,64] [--seconds 8] [--repeats 3] [--real/--no-real]
    bash bench/run.sh front_perf ...          # the same, after installing nginx from Debian's package

Every piece is its own process, so that the proxy's CPU and RSS are read by PID (psutil) and
never mixed with the client's: a token-streaming stand-in (aiohttp: OpenAI-shaped SSE chunks,
one every ``--interval`` s per stream, ``--max-tokens`` chunks per stream), the proxy (nginx as a
plain reverse proxy, or ``mlxwatch.front.FrontDoor`` started by this module's ``door`` role as
the daemon starts it: one process, one event loop), and the client (aiohttp; ``--streams``
concurrent streams, each opening a new request when the last ended, starts staggered over the
first second; the arrival time of every SSE chunk). With ``--real`` the same is done against a
real ``mlx_lm.server`` (tests/lab: tiny random model on CPU) at ``--real-streams`` (it is
CPU-bound on the same cores as client and proxy, so there a proxy's CPU costs the server tokens).

Per cell (upstream, streams) and repeat, direct, nginx and the door run one after the other
(order alternating per repeat, so load drifts hit all three alike), each with a fresh proxy
process warmed by one request. Measured: first-token latency (median, p99), p99 inter-token
gap, tokens/s delivered in the steady window, proxy CPU s per 1,000 chunks and proxy RSS per
open stream ((RSS while the streams are open - idle RSS) / streams). The added numbers are
paired per repeat (proxy - direct of the same repeat); the table shows medians over repeats.

nginx: one worker process, as the door is one process on one event loop (like with like);
``proxy_buffering off``, HTTP/1.1 with upstream keepalive, access log off; found on PATH or in
``$MLXWATCH_VENVS/tools/bin`` (``bash bench/run.sh`` puts it there); without it the run
measures direct and the door and says so.

Writes ``bench/front_perf.json`` and the section "The front door's cost" of ``bench/RESULTS.md``
(replaced if there, else appended).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil

from bench.common import (
    ROOT,
    TEST_PYTHON,
    VENVS,
    git_commit,
    load_average,
    log,
    machine,
    paths_option,
    quantile,
    write_section,
)
from lab.nginx import NGINX_CONF, find_nginx

SECTION = "## The front door's cost (direct vs nginx vs the door)"
# The HTTP libraries weighed for the door, each joined as a plain pass-through with none of the
# door's work (bench/front_alternative.py): aiohttp (server and client, what the door was first
# built on) and uvicorn+httpx.
# bench/front_alternative.py's pass-throughs: the libraries weighed for the door, and the bare
# relays measured beside it with --also (what the door's hop could cost at least)
MEASURING_STICKS = ("relay", "relay+uvloop", "threads")
ALTERNATIVES = ("aiohttp", "uvicorn", *MEASURING_STICKS)
KINDS = ("direct", "nginx", "door", *ALTERNATIVES)  # table order
LABELS = {"aiohttp": "aiohttp alone", "uvicorn": "uvicorn+httpx", "relay": "bare relay (asyncio)",
          "relay+uvloop": "bare relay (uvloop)", "threads": "bare relay (threads)"}
GAP_TARGET_MS = 1.0  # added p99 inter-token gap at the most streams
RATE_TARGET = 0.97  # tokens/s, fraction of direct
TTFT_TARGET_X = 2.0  # added first-token latency, times nginx's
STAGGER = 1.0  # s over which the streams start; the steady window begins after it
SAMPLE_EVERY = 0.2  # s between RSS samples of the proxy
PATH_ = "/v1/chat/completions"

# --- the stand-in (role "standin") ------------------------------------------------------------


def _chunk(i: int, content: str | None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    event = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1764763200,
             "model": "standin", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _standin(interval: float, ready: Path) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        if not body.get("stream"):
            answer = {"choices": [{"index": 0, "message": {"content": "tok " * n}, "finish_reason": "length"}]}
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        start = loop.time()
        for k in range(n):  # on a fixed schedule: chunk k at start + (k + 1) * interval
            delay = start + (k + 1) * interval - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await resp.write(_chunk(k, f" tok{k}"))
        await resp.write(_chunk(n, None, "length") + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post(PATH_, completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    await _serve_until_term(ready, runner.addresses[0][1])
    await runner.cleanup()


async def _serve_until_term(ready: Path, port: int) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(str(port))
    os.replace(tmp, ready)
    await stop.wait()


# --- the door as users run it (role "door"): its own process, one event loop ------------------


async def _door(upstream: str, ready: Path) -> None:
    from mlxwatch.config import FrontConfig
    from mlxwatch.front import FrontDoor
    from mlxwatch.host.limits import raise_open_files_limit

    logging.basicConfig(level=logging.INFO)  # as the daemon: INFO; the door logs nothing per chunk
    raise_open_files_limit()  # as `mlxwatch run` does before its doors size their connection caps
    record = bool(os.environ.get("MLXWATCH_BENCH_RECORD"))  # door+record: front.record on (bench/replay.py)
    door = FrontDoor("bench", upstream, FrontConfig(listen=("127.0.0.1", 0), record=record))
    await door.start()
    try:
        await _serve_until_term(ready, door.address[1])
    finally:
        await door.stop(drain=1.0)


# --- the client (role "client") ---------------------------------------------------------------


async def _client(url: str, streams: int, seconds: float, max_tokens: int) -> dict[str, Any]:
    import aiohttp

    body = {"messages": [{"role": "user", "content": "count to a hundred"}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
    ttft: list[float] = []
    gaps: list[float] = []
    chunks = in_window = errors = 0
    t0 = time.monotonic()
    window = (t0 + STAGGER, t0 + seconds)

    async def worker(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal chunks, in_window, errors
        await asyncio.sleep(STAGGER * i / streams)
        while time.monotonic() < window[1]:
            sent = time.monotonic()
            last = None
            try:
                async with session.post(url + PATH_, json=body) as r:
                    if r.status != 200:
                        errors += 1
                        await r.read()
                        await asyncio.sleep(0.1)
                        continue
                    async for line in r.content:
                        if not line.startswith(b"data:") or b'"content"' not in line:
                            continue
                        now = time.monotonic()
                        if last is None:
                            ttft.append(now - sent)
                        else:
                            gaps.append(now - last)
                        last = now
                        chunks += 1
                        in_window += window[0] <= now <= window[1]
            except aiohttp.ClientError:
                errors += 1
                await asyncio.sleep(0.1)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(worker(session, i) for i in range(streams)))
    return {"t0": t0, "window": window, "ended": time.monotonic(), "chunks": chunks,
            "tokens_per_s": in_window / (window[1] - window[0]), "errors": errors,
            "ttft_ms": [round(x * 1e3, 3) for x in ttft], "gaps_ms": [round(x * 1e3, 3) for x in gaps]}


# --- processes --------------------------------------------------------------------------------


class Proc:
    """A child process we started, and its descendants; ended (TERM, then KILL) by PID only."""

    def __init__(self, argv: list[str], log_path: Path, **kw: Any) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      start_new_session=True, **kw)
        self.ps = psutil.Process(self.popen.pid)

    def tree(self) -> list[psutil.Process]:
        try:
            return [self.ps, *self.ps.children(recursive=True)]
        except psutil.Error:
            return []

    def cpu_s(self) -> float:
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def rss(self) -> int:
        total = 0
        for p in self.tree():
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        return total

    def stop(self) -> None:
        family = self.tree()
        for p in family:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(family, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
        self.popen.poll()
        self._log.close()


def _role_argv(role: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "bench.front_perf", "--role", role, *args]


def _wait_ready(proc: Proc, ready: Path, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready.exists():
            return int(ready.read_text())
        if proc.popen.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"{proc.log_path.name}: not ready in {timeout:g} s: {proc.log_path.read_text()[-800:]}")


def _wait_port(proc: Proc, port: int, timeout: float = 30.0) -> None:
    import socket
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            break
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{proc.log_path.name}: not listening on {port}: {proc.log_path.read_text()[-800:]}")


def start_proxy(kind: str, upstream: str, work: Path, nginx: str | None) -> tuple[Proc, str]:
    """A fresh proxy process in front of ``upstream``; (the process, the URL to send to)."""
    d = Path(tempfile.mkdtemp(prefix=f"{kind.replace('+', '-')}-", dir=work))
    if kind in ("door", "door+uvloop", "door+record"):  # door+uvloop: an experiment (bench/front_hop.py)
        env = {**os.environ, "MLXWATCH_BENCH_UVLOOP": "1"} if kind == "door+uvloop" else \
            {**os.environ, "MLXWATCH_BENCH_RECORD": "1"} if kind == "door+record" else None
        proc = Proc(_role_argv("door", "--upstream", upstream, "--ready", str(d / "port")), d / "door.log", env=env)
        try:
            return proc, f"http://127.0.0.1:{_wait_ready(proc, d / 'port')}"
        except BaseException:
            proc.stop()
            raise
    from lab.ports import free_port
    port = free_port()
    if kind in ALTERNATIVES:
        library, _, loop = kind.partition("+")
        proc = Proc([sys.executable, "-m", "bench.front_alternative", "--library", library,
                     "--listen", f"127.0.0.1:{port}", "--upstream", upstream] + (["--uvloop"] if loop else []),
                    d / f"{library}.log")
    else:
        assert nginx is not None
        (d / "nginx.conf").write_text(NGINX_CONF.format(dir=d, port=port, upstream_port=upstream.rsplit(":", 1)[1]))
        proc = Proc([nginx, "-p", f"{d}/", "-c", str(d / "nginx.conf"), "-e", str(d / "error.log"),
                     "-g", "daemon off;"], d / "nginx.out")
    try:
        _wait_port(proc, port)
    except BaseException:
        proc.stop()
        raise
    return proc, f"http://127.0.0.1:{port}"


def _warm(url: str) -> None:
    import httpx
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.Client(trust_env=False, timeout=120) as c, c.stream("POST", url + PATH_, json=body) as r:
        for _ in r.iter_lines():
            pass


def run_cell(kind: str, upstream: str, streams: int, seconds: float, max_tokens: int, work: Path,
             nginx: str | None) -> dict[str, Any]:
    """One measurement: a fresh proxy (none for direct), warmed, then the client for ``seconds``."""
    proxy, url = (None, upstream) if kind == "direct" else start_proxy(kind, upstream, work, nginx)
    client = None
    try:
        _warm(url)
        idle_rss = cpu0 = None
        if proxy is not None:
            time.sleep(0.3)
            idle_rss, cpu0 = proxy.rss(), proxy.cpu_s()
        out = work / f"client-{kind}-{streams}-{time.monotonic_ns()}.json"
        client = subprocess.Popen(_role_argv("client", "--url", url, "--streams", str(streams), "--seconds", str(seconds),
                                             "--max-tokens", str(max_tokens), "--out", str(out)),
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        samples: list[tuple[float, int]] = []
        while client.poll() is None:
            if proxy is not None:
                samples.append((time.monotonic(), proxy.rss()))
            time.sleep(SAMPLE_EVERY)
        if client.returncode != 0:
            raise RuntimeError(f"client for {kind} at {streams} streams exited {client.returncode}")
        res = json.loads(out.read_text())
        out.unlink()
        cell: dict[str, Any] = {
            "chunks": res["chunks"], "errors": res["errors"], "tokens_per_s": res["tokens_per_s"],
            "streams_done": len(res["ttft_ms"]),
            "ttft_median_ms": quantile(res["ttft_ms"], 0.5), "ttft_p99_ms": quantile(res["ttft_ms"], 0.99),
            "gap_median_ms": quantile(res["gaps_ms"], 0.5), "gap_p99_ms": quantile(res["gaps_ms"], 0.99)}
        if proxy is not None and cpu0 is not None and idle_rss is not None:
            cell["cpu_s_per_1k"] = (proxy.cpu_s() - cpu0) / max(1, res["chunks"]) * 1000
            lo, hi = res["window"]
            open_rss = [rss for t, rss in samples if lo + 0.3 <= t <= hi] or [rss for _, rss in samples]
            cell["rss_idle_mb"] = idle_rss / 2**20
            cell["rss_open_mb"] = statistics.median(open_rss) / 2**20 if open_rss else None
            cell["rss_kb_per_stream"] = ((statistics.median(open_rss) - idle_rss) / 1024 / streams
                                         if open_rss else None)
        return cell
    finally:
        if client is not None and client.poll() is None:
            client.kill()
            client.wait()
        if proxy is not None:
            proxy.stop()


# --- the run ----------------------------------------------------------------------------------


def measure(upstream: str, label: str, streams_list: list[int], seconds: float, repeats: int, max_tokens: int,
            kinds: list[str], work: Path, nginx: str | None) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {str(n): {k: [] for k in kinds} for n in streams_list}
    for r in range(repeats):
        for n in streams_list:
            order = kinds if r % 2 == 0 else list(reversed(kinds))
            for kind in order:
                cell = run_cell(kind, upstream, n, seconds, max_tokens, work, nginx)
                cell["repeat"], cell["load_average"] = r, load_average()
                runs[str(n)][kind].append(cell)
                log(f"front_perf {label} {n:>3} streams r{r} {kind:>6}: ttft {cell['ttft_median_ms']:.2f} ms, "
                    f"p99 gap {cell['gap_p99_ms']:.2f} ms, {cell['tokens_per_s']:.0f} tok/s"
                    + (f", {cell['cpu_s_per_1k']:.3f} cpu-s/1k, {cell['rss_kb_per_stream'] or 0:.0f} KB/stream"
                       if "cpu_s_per_1k" in cell else ""))
    return {"upstream": label, "max_tokens": max_tokens, "runs": runs, "summary": summarise(runs)}


def _med(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarise(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Medians over repeats; the added numbers paired with direct's run of the same repeat."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for n, by_kind in runs.items():
        direct = {c["repeat"]: c for c in by_kind.get("direct", [])}
        out[n] = {}
        for kind, cells in by_kind.items():
            row: dict[str, Any] = {key: _med([c.get(key) for c in cells]) for key in (
                "ttft_median_ms", "ttft_p99_ms", "gap_p99_ms", "tokens_per_s", "cpu_s_per_1k", "rss_kb_per_stream")}
            row["errors"] = sum(c["errors"] for c in cells)
            paired = [(c, direct[c["repeat"]]) for c in cells if c["repeat"] in direct]
            row["added_ttft_median_ms"] = _med([c["ttft_median_ms"] - d["ttft_median_ms"] for c, d in paired])
            row["added_ttft_p99_ms"] = _med([c["ttft_p99_ms"] - d["ttft_p99_ms"] for c, d in paired])
            row["added_gap_p99_ms"] = _med([c["gap_p99_ms"] - d["gap_p99_ms"] for c, d in paired])
            row["rate_vs_direct"] = _med([c["tokens_per_s"] / d["tokens_per_s"] for c, d in paired
                                          if d["tokens_per_s"]])
            out[n][kind] = row
    return out


def targets(standin: dict[str, Any]) -> list[dict[str, Any]]:
    """Pass/fail of the door against the issue's targets, on the stand-in."""
    summ = standin["summary"]
    most = str(max(int(n) for n in summ))
    out = []
    gap = summ[most]["door"]["added_gap_p99_ms"]
    over = "" if gap <= GAP_TARGET_MS else f", over by {gap - GAP_TARGET_MS:.2f} ms"
    out.append({"target": f"added p99 inter-token gap <= {GAP_TARGET_MS:g} ms at {most} streams",
                "measured": f"{gap:+.2f} ms (nginx {_fmt(summ[most].get('nginx', {}).get('added_gap_p99_ms'), '+.2f')} ms{over})",
                "met": gap <= GAP_TARGET_MS})
    worst = min(summ, key=lambda n: summ[n]["door"]["rate_vs_direct"])
    rate = summ[worst]["door"]["rate_vs_direct"]
    out.append({"target": f"tokens/s >= {RATE_TARGET:.0%} of direct (every stream count)",
                "measured": f"lowest {rate:.1%} (at {worst} streams)", "met": rate >= RATE_TARGET})
    for n in sorted(summ, key=int):
        if "nginx" not in summ[n]:
            continue
        door, ngx = summ[n]["door"]["added_ttft_median_ms"], summ[n]["nginx"]["added_ttft_median_ms"]
        bound = _ttft_bound(ngx)
        over = "" if door <= bound else f", over by {door - bound:.2f} ms"
        out.append({"target": f"added first-token latency <= {TTFT_TARGET_X:g}x nginx's, {n} stream(s) (median)",
                    "measured": f"door {door:+.2f} ms vs nginx {ngx:+.2f} ms (bound {bound:.2f} ms{over})",
                    "met": door <= bound})
    return out


def findings(standin: dict[str, Any]) -> list[str]:
    """The door next to nginx in a few sentences, from the numbers; and where the door's time goes."""
    summ = standin["summary"]
    ns = sorted(summ, key=int)
    def pairs(a: str, b: str, key: str, spec: str, unit: str = "") -> str:
        """``A vs B <unit>at N`` for each stream count: one measurement of two paths side by side."""
        return ", ".join(f"{_fmt(summ[n][a][key], spec)} vs {_fmt(summ[n][b][key], spec)}{unit} at {n}" for n in ns)

    cpu = pairs("door", "nginx", "cpu_s_per_1k", ".3f")
    rss = pairs("door", "nginx", "rss_kb_per_stream", ".0f", " KB")
    ttft = pairs("door", "nginx", "added_ttft_median_ms", "+.2f", " ms")
    libraries = []
    if all("aiohttp" in summ[n] and "uvicorn" in summ[n] and "nginx" in summ[n] for n in ns):
        weighed = ", ".join(f"{_fmt(summ[n]['aiohttp']['added_ttft_median_ms'], '+.2f')} and "
                            f"{_fmt(summ[n]['uvicorn']['added_ttft_median_ms'], '+.2f')} (door "
                            f"{_fmt(summ[n]['door']['added_ttft_median_ms'], '+.2f')}, bound "
                            f"{_ttft_bound(summ[n]['nginx']['added_ttft_median_ms']):.2f}) ms at {n}"
                            for n in ns)
        libraries = ["", "The HTTP libraries weighed for the door, each joined as a plain pass-through with none of "
                     f"the door's work: aiohttp alone and uvicorn+httpx add to the first token {weighed} stream(s); "
                     "CPU s per 1,000 chunks, door vs aiohttp alone vs uvicorn+httpx: " + ", ".join(
                         f"{_fmt(summ[n]['door']['cpu_s_per_1k'], '.3f')} vs "
                         f"{_fmt(summ[n]['aiohttp']['cpu_s_per_1k'], '.3f')} vs "
                         f"{_fmt(summ[n]['uvicorn']['cpu_s_per_1k'], '.3f')} at {n}" for n in ns)
                     + ". A library's server and client between two sockets cost more than the bound before any "
                     "work of the door's; so the door's HTTP is httptools' parser on asyncio's transports "
                     "(`mlxwatch/front/http1.py`), each chunk written to the client in the callback that reads it."]
    sticks = []
    if all("relay" in summ[n] and "threads" in summ[n] and "nginx" in summ[n] for n in ns):
        bounds = {n: _ttft_bound(summ[n]["nginx"]["added_ttft_median_ms"]) for n in ns}
        added = {(k, n): summ[n][k]["added_ttft_median_ms"] for k in ("relay", "threads", "door") for n in ns}
        within = {k: sum(added[k, n] is not None and added[k, n] <= bounds[n] for n in ns)
                  for k in ("relay", "threads", "door")}
        sticks = ["", "The floor under any hop in Python, measured beside the door: the bare relays of "
                  "`bench/front_alternative.py` (nothing but forwarding: no limits, counting, gate or errors). "
                  "Added first token, bare relay on asyncio's transports and httptools vs bare relay on a thread "
                  "per connection with blocking sockets vs the door: " + ", ".join(
                      f"{_fmt(added['relay', n], '+.2f')} vs {_fmt(added['threads', n], '+.2f')} vs "
                      f"{_fmt(added['door', n], '+.2f')} ms (bound {bounds[n]:.2f}) at {n}" for n in ns)
                  + f" stream(s). Within the bound: the asyncio relay at {within['relay']}, the threaded relay "
                  f"at {within['threads']}, the door at {within['door']} of {len(ns)} stream counts."]
    return [
        f"Door vs nginx, CPU s per 1,000 chunks: {cpu} stream(s); RSS per open stream: {rss}; added "
        f"first-token latency (median): {ttft}. Tokens/s are the same on every path. The p99 gaps are the "
        "upstream's schedule plus scheduler noise of a shared machine (and the stand-in's own timer), which "
        "moves a cell's p99 by a few milliseconds either way between repeats: added p99 gaps smaller than "
        "that are not resolved by this run (each repeat's values are in the JSON).",
        *libraries,
        *sticks,
    ]


def _ttft_bound(nginx_added_ms: float) -> float:
    """The door's allowed added first-token latency: twice nginx's. nginx's own can be below the
    noise (even negative): the bound is then twice a floor of 0.05 ms."""
    return TTFT_TARGET_X * max(nginx_added_ms, 0.05)


def _fmt(v: float | None, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def render(data: dict[str, Any]) -> str:
    m = data["machine"]
    load_note = data.get("machine_note") or "the machine was shared with other work, so absolute numbers carry that noise"
    lines = [SECTION, "",
             f"`{data['command']}` (`bench/front_perf.py`), run on {data['date']} from commit {data['commit']} on "
             f"{m.get('cpus', '?')} cores ({m.get('cpu') or m.get('system', '')}); load average "
             f"{data['load_before']} before, {data['load_after']} after ({load_note}); "
             "the paths ran one after the other in each repeat (order alternating), so drifts hit them alike. "
             f"Raw data in `bench/front_perf.json`. {data['repeats']} repeats of {data['seconds']:g} s per cell; "
             "the table shows medians over repeats, the added numbers paired per repeat (proxy - direct).", "",
             "Each piece is its own process: the upstream, the proxy, the client (aiohttp, one chunk's arrival "
             "time each). nginx {nginx}: one worker process, because the door is one process on one event loop "
             "(like with like); `proxy_buffering off`, HTTP/1.1, upstream keepalive, access log off. The door: "
             "`mlxwatch.front.FrontDoor` at the default `front:` settings in its own process, as the daemon runs it "
             "(`python -m bench.front_perf --role door`). aiohttp alone and uvicorn+httpx: the HTTP libraries "
             "weighed for the door (docs/front-door.md, \"Why httptools\"), each a minimal pass-through of its "
             "server and client without the door's ledger, token counting or gate (`bench/front_alternative.py`), "
             "in its own process. The bare relays (with `--also`): forwarding alone, on asyncio or on threads, the "
             "floor under the door's hop (`bench/front_alternative.py`). "
             "CPU and RSS are the proxy process's (nginx: master + worker), read by PID; "
             "RSS per stream = (median RSS while the streams are open - idle RSS after one warm-up request) / "
             "streams. Tokens/s = chunks delivered in the steady window (after the 1 s "
             "staggered start).".replace("{nginx}", data.get("nginx_version") or "(not found: not measured)"), ""]
    for up in data["upstreams"]:
        lines += [f"**{up['title']}**", "",
                  "| streams | path | first token median / p99 (ms) | added first token median / p99 (ms) "
                  "| p99 gap (ms) | added p99 gap (ms) | tokens/s (vs direct) | proxy CPU s / 1k chunks "
                  "| proxy RSS / stream (KB) | errors |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for n in sorted(up["summary"], key=int):
            for kind in KINDS:
                row = up["summary"][n].get(kind)
                if row is None:
                    continue
                added = "–" if kind == "direct" else (f"{_fmt(row['added_ttft_median_ms'], '+.2f')} / "
                                                      f"{_fmt(row['added_ttft_p99_ms'], '+.2f')}")
                share = row["rate_vs_direct"]
                rate = f"{row['tokens_per_s']:.0f}" + ("" if kind == "direct" or share is None else f" ({share:.1%})")
                path = LABELS.get(kind, kind)
                lines.append(f"| {n} | {path} | {_fmt(row['ttft_median_ms'], '.2f')} / {_fmt(row['ttft_p99_ms'], '.2f')} "
                             f"| {added} | {_fmt(row['gap_p99_ms'], '.2f')} "
                             f"| {'–' if kind == 'direct' else _fmt(row['added_gap_p99_ms'], '+.2f')} | {rate} "
                             f"| {_fmt(row['cpu_s_per_1k'], '.3f')} | {_fmt(row['rss_kb_per_stream'], '.0f')} "
                             f"| {row['errors']} |")
        lines += ["", up["note"], ""]
    lines += ["**Targets** (the door, on the stand-in):", "", "| target | measured | |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['measured']} | {'met' if t['met'] else '**missed**'} |" for t in data["targets"]]
    lines += ["", *data.get("findings", []), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front_perf", description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16,64", help="concurrent streams per cell, comma-separated")
    parser.add_argument("--seconds", type=float, default=8.0, help="client run per cell (the first second is ramp)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.02, help="stand-in: seconds between chunks per stream")
    parser.add_argument("--max-tokens", type=int, default=50, help="stand-in: chunks per stream")
    parser.add_argument("--real", action=argparse.BooleanOptionalAction, default=True,
                        help="also against a real mlx_lm.server (tests/lab, tiny model on CPU)")
    parser.add_argument("--real-streams", default="1,16,64")
    parser.add_argument("--real-max-tokens", type=int, default=32)
    parser.add_argument("--libraries", action=argparse.BooleanOptionalAction, default=True,
                        help="also the HTTP libraries weighed for the door as plain pass-throughs: aiohttp "
                             "alone and uvicorn + httpx (needs the 'bench' extra; bench/front_alternative.py)")
    parser.add_argument("--also", default="", help=f"more paths, comma-separated: {', '.join(MEASURING_STICKS)} "
                                                   "(bench/front_alternative.py's measuring sticks)")
    parser.add_argument("--machine-note", help="how loaded the machine was, for the section (default: shared)")
    parser.add_argument("--no-write", action="store_true", help="print the section; write neither JSON nor RESULTS.md")
    parser.add_argument("--render-only", action="store_true",
                        help="measure nothing: the section again from bench/front_perf.json, into RESULTS.md")
    parser.add_argument("--role", choices=("standin", "door", "client"), help=argparse.SUPPRESS)
    parser.add_argument("--ready", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--upstream", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "standin":
        asyncio.run(_standin(args.interval, args.ready))
        return 0
    if args.role == "door":
        if os.environ.get("MLXWATCH_BENCH_UVLOOP"):  # an experiment: the door on uvloop's event loop
            import uvloop
            uvloop.install()
        asyncio.run(_door(args.upstream, args.ready))
        return 0
    if args.role == "client":
        res = asyncio.run(_client(args.url, int(args.streams), args.seconds, args.max_tokens))
        args.out.write_text(json.dumps(res))
        return 0

    if args.render_only:
        data = json.loads((ROOT / "bench" / "front_perf.json").read_text())
        _write(data, args.no_write)
        return 0
    nginx = find_nginx(VENVS)
    kinds = ["direct", "nginx", "door"] if nginx else ["direct", "door"]
    if args.libraries:
        kinds += ["aiohttp", "uvicorn"]
    kinds += paths_option(parser, "--also", args.also, MEASURING_STICKS)
    if nginx is None:
        log("front_perf: nginx NOT FOUND (on PATH or in $MLXWATCH_VENVS/tools/bin; `bash bench/run.sh front_perf` "
            "installs it from Debian's package): measuring direct and the door only")
    nginx_version = None
    if nginx:
        v = subprocess.run([nginx, "-v"], capture_output=True, text=True)
        nginx_version = (v.stderr or v.stdout).strip().split(":", 1)[-1].strip()
    streams = [int(x) for x in args.streams.split(",")]
    command = "python -m bench.front_perf " + " ".join(argv if argv is not None else sys.argv[1:])
    data: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "started_at": datetime.now(timezone.utc).isoformat(
            timespec="seconds"), "commit": git_commit(), "machine": machine(), "command": command.strip(),
        "seconds": args.seconds, "repeats": args.repeats, "nginx_version": nginx_version,
        "load_before": load_average(), "machine_note": args.machine_note, "upstreams": []}
    work = Path(tempfile.mkdtemp(prefix="mlxwatch-front-perf-"))

    def terminated(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally blocks: every process we started is ended

    signal.signal(signal.SIGTERM, terminated)
    standin = None
    server = None
    try:
        standin = Proc(_role_argv("standin", "--interval", str(args.interval), "--ready", str(work / "standin.port")),
                       work / "standin.log")
        upstream = f"http://127.0.0.1:{_wait_ready(standin, work / 'standin.port')}"
        res = measure(upstream, "stand-in", streams, args.seconds, args.repeats, args.max_tokens, kinds, work, nginx)
        res["title"] = (f"Against the token-streaming stand-in: one chunk every {args.interval * 1e3:g} ms per stream "
                        f"({1 / args.interval:g} tok/s), {args.max_tokens} chunks per stream")
        res["note"] = ("The stand-in (aiohttp, its own process) schedules each chunk at a fixed time; its own "
                       "timer jitter at many streams is in every path's gaps alike.")
        data["upstreams"].append(res)
        standin.stop()
        standin = None
        if args.real:
            from lab.server import LabServer, server_version
            server = LabServer.start(str(TEST_PYTHON), work / "server")
            real_streams = [int(x) for x in args.real_streams.split(",")]
            res = measure(server.url, "real server", real_streams, args.seconds, args.repeats, args.real_max_tokens,
                          kinds, work, nginx)
            one = res["summary"][str(min(real_streams))]["direct"]["tokens_per_s"]
            res["title"] = (f"Against the real server (mlx-lm {server_version(str(TEST_PYTHON))}, tiny random model "
                            f"on CPU), {args.real_max_tokens} tokens per stream, at {args.real_streams} streams")
            res["note"] = (f"The real server here is a tiny random model on the CPU: about {one:.0f} tokens/s direct at "
                           f"{min(real_streams)} stream(s), as fast as it can, and CPU-bound on the same 2 shared cores "
                           "as the client and the proxy. So every proxy's CPU is taken from the server: this is where "
                           "the door's higher CPU per chunk shows as fewer tokens/s (a model on a GPU, at tens of "
                           "tokens/s per stream, does not compete so). Its own jitter is large (batching, the other "
                           "work on the machine): the door's fine cost is in the stand-in rows.")
            data["upstreams"].append(res)
    finally:
        if server is not None:
            server.stop()
        if standin is not None:
            standin.stop()
        shutil.rmtree(work, ignore_errors=True)
    data["load_after"] = load_average()
    _write(data, args.no_write)
    return 0


def _write(data: dict[str, Any], no_write: bool) -> None:
    """Targets and findings from the measurements, then the JSON and the RESULTS.md section."""
    kinds = {kind for up in data["upstreams"] for cells in up["summary"].values() for kind in cells}
    data["targets"] = targets(data["upstreams"][0]) if "door" in kinds else []
    data["findings"] = findings(data["upstreams"][0]) if "nginx" in kinds else []
    section = render(data)
    if no_write:
        print(section)
    else:
        md = write_section("front_perf", data, SECTION, section)
        log(f"front_perf: wrote {ROOT / 'bench' / 'front_perf.json'} and the section in {md}")
    for t in data["targets"]:
        log(f"  {'MET ' if t['met'] else 'MISS'} {t['target']}: {t['measured']}")


if __name__ == "__main__":
    sys.exit(main())
