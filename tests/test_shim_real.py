"""The launch shim on the real mlx_lm.server, each mlx-lm version under test: a lab server
started through the real `mlxwatch launch --record` (LabServer(shim=...)), its faults switched on
at the seam the shim counts at. Requests recorded into a bundle and replayed, stacks with py-spy
made unavailable, the heartbeat through load, livelock and block, the daemon's early verdict,
thread death, and byte-identical answers (with the recorder on)."""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from mlxwatch import stacks
from mlxwatch.capture import CaptureRequest, capture_bundle, pyspy
from mlxwatch.capture.requests import load_requests
from mlxwatch.cli.app import run
from mlxwatch.config import (
    CaptureConfig,
    Config,
    InstanceConfig,
    ProbeConfig,
    RestartConfig,
)
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.journal.incidents import Journal
from lab.clients import retry_every
from lab.server import LabServer
from mlxwatch.shim import heartbeat, layout, spool
from mlxwatch.shim.stacks import parse_dump
from mlxwatch.shim.watch import POLL

_servers: dict[str, LabServer] = {}


def _model_of(lab_root: Path, server_python: str) -> Path | None:
    """The conftest lab's model for this version, if made: shared so answers can be compared."""
    for spec in lab_root.glob("server-*/lab.json"):
        if json.loads(spec.read_text())["python"] == str(Path(server_python).absolute()):
            return spec.parent / "model"
    return None


@pytest.fixture
def shim_lab(server_python: str, lab_root: Path):
    """A healthy real server started through `mlxwatch launch`; relaunched if a test broke it."""
    server = _servers.get(server_python)
    if server is None:
        server = LabServer.start(server_python, lab_root / f"shim-{len(_servers)}", shim=("--record",))
        _servers[server_python] = server
    elif server.fault_file.read_text().strip() or not server.owned_process_alive():
        server.relaunch()
    yield server


@pytest.fixture(scope="module", autouse=True)
def _stop_shim_servers():
    """Stop the shim servers this module started (by their PIDs) when it is done."""
    yield
    for server in _servers.values():
        server.stop()
    _servers.clear()


def hb_of(server: LabServer) -> heartbeat.Heartbeat:
    hb, problem = heartbeat.find(server.pid, server.create_time)
    assert hb is not None, problem
    return hb


def wait_hb(server: LabServer, predicate, timeout: float = 20.0, what: str = "condition") -> heartbeat.Heartbeat:
    deadline = time.monotonic() + timeout
    hb = None
    while time.monotonic() < deadline:
        hb, _ = heartbeat.find(server.pid, server.create_time)
        if hb is not None and predicate(hb):
            return hb
        time.sleep(0.2)
    raise AssertionError(f"{what} not seen within {timeout}s; last: {hb and hb.summary()}")


def cli(argv: list[str]) -> tuple[int, str]:
    buffer = io.StringIO()
    code = run(argv, out=Console(file=buffer, width=400))
    return code, buffer.getvalue()


def _spooled(server: LabServer) -> list[dict]:
    hb = hb_of(server)
    return spool.read(hb.directory, server.pid, now_mono=time.monotonic(), max_age=600, max_bytes=1 << 30)[0]


def test_a_request_recorded_by_launch_record_is_in_the_bundle_byte_for_byte_and_replays(shim_lab, tmp_path):
    """First in this module: the shared server has served little else, so the replay is short.
    A streamed and a whole request (one with a credential) go straight to the server, no door;
    `mlxwatch capture` puts them in the bundle's requests/ exactly; `mlxwatch replay --to` sends
    them again, and the shim records the same bytes arriving a second time."""
    marker = uuid.uuid4().hex
    streamed = json.dumps({"messages": [{"role": "user", "content": f"stream {marker}"}], "max_tokens": 4,
                           "temperature": 0, "stream": True}).encode()
    whole = json.dumps({"messages": [{"role": "user", "content": f"whole {marker} \u00e9"}], "max_tokens": 3,
                        "temperature": 0}, ensure_ascii=False).encode()
    with httpx.Client(trust_env=False, timeout=60) as client:
        with client.stream("POST", f"{shim_lab.url}/v1/chat/completions", content=streamed,
                           headers={"Content-Type": "application/json"}) as r:
            assert r.status_code == 200 and b"[DONE]" in r.read()
        r = client.post(f"{shim_lab.url}/v1/chat/completions", content=whole,
                        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-never-kept"})
        assert r.status_code == 200
    wait_hb(shim_lab, lambda h: (h.record or {}).get("state") == "on" and not h.record["in_flight"],
            what="the recorder on, nothing in flight")
    code, out = cli(["capture", str(shim_lab.pid), "--url", shim_lab.url, "--out", str(tmp_path / "bundles"),
                     "--snapshots", "1", "--ceiling", "30s", "--json"])
    assert code == 0, out
    bundle = next(p for p in (tmp_path / "bundles").iterdir() if not p.name.startswith("."))
    held = load_requests(bundle)
    ours = [r for r in held if marker.encode() in r.body]
    assert [r.body for r in ours] == [streamed, whole]
    s, w = (r.meta for r in ours)
    assert (s["status"], s["stream"], s["finish_reason"], s["in_flight"]) == (200, True, "length", False)
    assert s["tokens"] >= 1 and s["first_token_after_s"] is not None
    assert (w["status"], w["stream"], w["max_tokens"], w["tokens"]) == (200, False, 3, 3)
    assert w["dropped_headers"] == ["Authorization"] and "sk-never-kept" not in (bundle / "requests/requests.json").read_text()
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["requests"]["source"] == "shim" and "recorded by the launch shim" in (bundle / "summary.md").read_text()
    assert held[-1].body == whole  # the capture's own requests (its probe) came after it began: not kept

    before = len([r for r in _spooled(shim_lab) if marker.encode() in r["body"]])
    code, out = cli(["replay", str(bundle), "--to", shim_lab.url, "--allow-bundle-url", "--speed", "1000",
                     "--stall-timeout", "5s"])
    assert code == 1 and "not reproduced: " in out, out  # no hang: exit 1
    again = [r["body"] for r in _spooled(shim_lab) if marker.encode() in r["body"]]
    # the server got the same bytes (in the order the machine kept: a loaded one swapped the two)
    assert len(again) == before + 2 and sorted(again[-2:]) == sorted([streamed, whole])


def trigger(server: LabServer, fault: str) -> None:
    server.set_fault(fault)
    try:
        httpx.post(f"{server.url}/v1/chat/completions", trust_env=False, timeout=2.0,
                   json={"messages": [{"role": "user", "content": "trigger"}], "max_tokens": 2})
    except httpx.HTTPError:
        pass


@pytest.mark.parametrize("fault, mark, kind", [("block", "_block_forever", "blocked"),
                                               ("gil", "_hold_gil_forever", "wedged")])
def test_stacks_shim_shows_the_generation_thread_without_py_spy(shim_lab, tmp_path, monkeypatch, fault, mark, kind):
    """py-spy made unavailable; the bundle's stacks come from the shim's faulthandler dumps, on a
    loop blocked with the GIL released and on one holding the GIL in a native call. The request
    that set the fault off is in the bundle, in flight (the shim records: --record)."""
    monkeypatch.setattr(pyspy, "find_py_spy", lambda: None)
    trigger(shim_lab, fault)
    time.sleep(1.0)
    bundle = asyncio.run(capture_bundle(CaptureRequest(
        pid=shim_lab.pid, out_dir=tmp_path, url=shim_lab.url, log=shim_lab.log_path, label="lab", snapshots=3,
        spacing=1.0, ceiling=40.0, probe_first_token_timeout=3.0, probe_timeout=5.0, stacks="shim")))
    steps = {s["name"]: s for s in bundle.manifest["steps"]}
    assert steps["stacks"]["outcome"] == "ok", steps["stacks"]
    dumps = sorted((bundle.path / "stacks").glob("shim-*.txt"))
    assert len(dumps) == 3 and not list((bundle.path / "stacks").glob("pyspy-*")), (steps["stacks"], dumps)
    for dump in dumps:
        threads = parse_dump(dump.read_text(), hb_of(shim_lab).thread_names())
        gen = stacks.generation_thread(threads)
        assert gen is not None, dump.read_text()
        names = [f.name for f in gen.frames]
        assert mark in names and "_generate" in names and "next" in names
    # The request the server hung on, recorded by the shim (--record) before the hang: read from
    # its spool even while the GIL is held (no dump thread, no heartbeat then)
    recorded = bundle.manifest["requests"]
    assert recorded["source"] == "shim", recorded
    assert [r["prompt_chars"] for r in recorded["in_flight"]] == [len("trigger")], recorded
    assert "working on these when delivery stopped" in (bundle.path / "summary.md").read_text()
    c = bundle.classification
    assert c.kind == kind, c
    if fault == "gil":
        assert any(line.startswith("shim: no heartbeat") for line in c.evidence), c
    else:
        assert any(line.startswith("shim:") for line in c.evidence), c


def test_heartbeat_advances_under_load_shows_a_livelock_and_freezes_when_blocked(shim_lab):
    now = time.time()
    start = wait_hb(shim_lab, lambda h: h.published_at > now, what="a fresh heartbeat")  # counts the ready probe
    assert start.seam_ok and start.data["mlx_lm"], start.data["seam"]
    body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 40, "temperature": 0}
    answer = httpx.post(f"{shim_lab.url}/v1/chat/completions", json=body, trust_env=False, timeout=60).json()
    produced = answer["usage"]["completion_tokens"]
    loaded = wait_hb(shim_lab, lambda h: h.tokens >= start.tokens + produced, what="the tokens of the answer")
    assert loaded.tokens - start.tokens == produced  # each delivered token counted once
    assert (loaded.tokens_per_s or 0) > 0 and loaded.since_last_token < 10 and loaded.in_flight == 0

    trigger(shim_lab, "spin")
    spun = wait_hb(shim_lab, lambda h: h.in_flight >= 1 and h.stalled_for > 2, what="a livelock")
    later = wait_hb(shim_lab, lambda h: h.published_at > spun.published_at + 1.5, what="a later heartbeat")
    change = heartbeat.Change.between(spun, later)
    assert change.steps > 0 and change.tokens == 0, change

    shim_lab.set_fault("block")  # the spinning loop reads it at its next step and stays there
    frozen = wait_hb(shim_lab, lambda h: (h.in_step_for or 0) > 2, what="a blocked step")
    after = wait_hb(shim_lab, lambda h: h.published_at > frozen.published_at + 1.5, what="a later heartbeat")
    assert after.steps == frozen.steps and after.tokens == frozen.tokens and not after.stale


STALL, FIRST, TOTAL, INTERVAL = 6.0, 3.0, 5.0, 30.0
# the stall is seen at the first heartbeat read after STALL (POLL apart), then one probe (FIRST),
# then the capture starts; slack for a loaded 2-core machine
FOUND_BOUND = STALL + POLL + FIRST + 4.0


async def test_a_livelock_with_a_retrying_client_is_found_within_stall_timeout_plus_one_probe(shim_lab, tmp_path):
    """Probes every 30 s: without the shim the first failure alone could take that long. With the
    heartbeat the stall makes the server suspect at once and the next probe decides."""
    p = ProbeConfig(interval=INTERVAL, first_token_timeout=FIRST, timeout=TOTAL, failures=2, grace_ceiling=60.0,
                    endpoint_timeout=2.0, startup_timeout=90.0, stall_timeout=STALL)
    inst = InstanceConfig("lab", shim_lab.url, shim_lab.log_path, shim_lab.pid_file, p, RestartConfig(), shim="required")
    config = Config(None, (inst,), tmp_path, (), CaptureConfig(snapshots=2, spacing=0.5, ceiling=25.0))
    stop, retry_stop = asyncio.Event(), threading.Event()
    daemon = Daemon(config, tmp_path)
    task = asyncio.create_task(daemon.run(stop))
    journal = Journal(tmp_path)
    switched = None
    try:
        deadline = time.monotonic() + 120
        while not hasattr(daemon, "state") or not (daemon.state.instance("lab").get("last_probe") or {}).get("ok"):
            assert time.monotonic() < deadline, "never healthy"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the watcher is now waiting out its 30 s interval, reading the heartbeat
        switched = time.time()
        shim_lab.set_fault("spin")
        threading.Thread(target=retry_every, args=(shim_lab.url, 2.0, retry_stop), daemon=True).start()
        while not any(r["event"] == "captured" for r in journal.records()):
            assert time.monotonic() < deadline, [r["event"] for r in journal.records()]
            await asyncio.sleep(0.2)
    finally:
        retry_stop.set()
        stop.set()
        await task
    records = journal.records()
    stall = next(r for r in records if r["event"] == "shim_stall")
    verdict = next(r for r in records if r["event"] == "verdict")
    captured = next(r for r in records if r["event"] == "captured")
    assert "no token for" in stall["reason"] and stall["pid"] == shim_lab.pid
    assert stall["ts"] - switched >= STALL - 0.5  # not before the stall_timeout
    print(f"stall journaled {stall['ts'] - switched:.1f}s and verdict {verdict['detected_at'] - switched:.1f}s "
          "after the fault was switched on")
    assert verdict["detected_at"] - switched < FOUND_BOUND, (verdict["detected_at"] - switched, records)
    assert len(verdict["failures"]) == 1  # one probe confirmed what the heartbeat showed
    assert captured["kind"] == "livelock"
    manifest = json.loads((Path(captured["bundle"]) / "manifest.json").read_text())
    assert any(line.startswith("shim:") for line in manifest["classification"]["evidence"])


def test_exit_on_thread_death_ends_the_process_with_its_traceback_kept(server_python, lab_root, tmp_path):
    model = _model_of(lab_root, server_python)
    workdir = tmp_path / "dies"
    workdir.mkdir()
    if model is not None:
        (workdir / "model").symlink_to(model)
    server = LabServer.start(server_python, workdir, shim=("--exit-on-thread-death",))
    try:
        popen = server._popen
        trigger(server, "die")
        assert popen.wait(30) == layout.THREAD_DEATH_EXIT
        hb, problem = heartbeat.read(server.pid, server.create_time, layout.runtime_dir())
        assert hb is not None, problem
        exc = hb.thread_exception
        assert hb.thread_died and exc["type"] == "RuntimeError" and "metal::malloc" in exc["message"]
        assert "Traceback" in exc["traceback"] and "fault_server.py" in exc["traceback"]
        log = server.log_path.read_text()
        # The server's own report first. Python writes "Exception in thread " and the thread's
        # name in separate writes, so a request's log line can land between them (seen in CI).
        own = "generation thread died" if "(_run_generate)" in hb.thread["name"] else "Exception in thread "
        assert log.index(own) < log.index("mlxwatch shim: the generation thread died")
    finally:
        server.stop()


REQUESTS = [
    {"messages": [{"role": "user", "content": "Tell me a story about a lighthouse."}], "max_tokens": 32},
    {"messages": [{"role": "user", "content": "List three colours."}], "max_tokens": 24},
    {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why?"}], "max_tokens": 16},
    {"messages": [{"role": "user", "content": "Seeded, so served alone."}], "max_tokens": 20, "seed": 7},
]


def _answers(url: str) -> list:
    out = []
    with httpx.Client(trust_env=False, timeout=120) as client:
        for body in REQUESTS:
            r = client.post(f"{url}/v1/chat/completions", json={**body, "temperature": 0})
            data = r.json()
            out.append((r.status_code, data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"],
                        data["usage"]))
        streamed = []
        with client.stream("POST", f"{url}/v1/chat/completions",
                           json={**REQUESTS[0], "temperature": 0, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0].get("delta") or {}
                    streamed.append(delta.get("content") or "")
        out.append(("stream", "".join(streamed)))
    # two at once: batched together in the same steps
    results: dict[int, str] = {}

    def one(i: int) -> None:
        with httpx.Client(trust_env=False, timeout=120) as c:
            results[i] = c.post(f"{url}/v1/chat/completions",
                                json={**REQUESTS[i], "temperature": 0}).json()["choices"][0]["message"]["content"]

    threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.append(("batched", results[0], results[1]))
    return out


def test_answers_are_byte_identical_with_and_without_the_shim(server_python, lab_root, tmp_path):
    """Same model, fresh servers, the same requests in the same order at temperature 0: batched,
    streamed, concurrent and seeded (served one at a time, through stream_generate). The shim's
    server records them too (--record): its tees on the handler's rfile and wfile change nothing."""
    model = _model_of(lab_root, server_python)
    answers = {}
    for label, shim in (("plain", None), ("shim", ("--record",))):
        workdir = tmp_path / label
        workdir.mkdir()
        if model is not None:
            (workdir / "model").symlink_to(model)
        elif label == "shim":
            (workdir / "model").symlink_to(tmp_path / "plain" / "model")
        server = LabServer.start(server_python, workdir, shim=shim)
        try:
            answers[label] = _answers(server.url)
            if shim is not None:
                # the heartbeat is published about once a second: wait for the one that counts them all
                hb = wait_hb(server, lambda h: h.tokens > 0 and (h.record or {}).get("recorded", 0) >= 7,
                             what="tokens and 7 requests recorded")
                assert hb.seam_ok and hb.record is not None and hb.record["state"] == "on"
                assert hb.record["errors"] == 0
        finally:
            server.stop()
    assert answers["shim"] == answers["plain"]
    assert all(a[0] == 200 for a in answers["plain"][:4])


async def _watch_during_long_seeded_generation(server: LabServer, state_dir: Path, tokens: int) -> tuple[list, str]:
    """Run the daemon (probes every second, 2 s to the first token, 2 failures make a verdict)
    while another client streams a long seeded generation: seeded requests are served one at a
    time, so every probe waits behind it. Returns the journal records and the daemon's log."""
    import logging

    p = ProbeConfig(interval=1.0, suspect_interval=1.0, first_token_timeout=2.0, timeout=4.0, failures=2,
                    grace_ceiling=120.0, endpoint_timeout=2.0, startup_timeout=90.0, stall_timeout=30.0)
    inst = InstanceConfig("lab", server.url, server.log_path, server.pid_file, p, RestartConfig())
    config = Config(None, (inst,), state_dir, (), CaptureConfig(snapshots=1, spacing=0.5, ceiling=20.0))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("mlxwatch.watchdog")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    stop = asyncio.Event()
    daemon = Daemon(config, state_dir)
    task = asyncio.create_task(daemon.run(stop))
    done = threading.Event()

    def generate() -> None:
        body = {"messages": [{"role": "user", "content": "write"}], "max_tokens": tokens, "seed": 3, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, trust_env=False, timeout=300) as r:
            for _ in r.iter_raw():
                pass
        done.set()

    try:
        deadline = time.monotonic() + 120
        while not hasattr(daemon, "state") or not (daemon.state.instance("lab").get("last_probe") or {}).get("ok"):
            assert time.monotonic() < deadline, "never healthy"
            await asyncio.sleep(0.1)
        threading.Thread(target=generate, daemon=True).start()
        while not done.is_set():
            assert time.monotonic() < deadline, "the long generation did not finish"
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        await task
        logger.removeHandler(handler)
        logger.setLevel(level)
    return Journal(state_dir).records(), "\n".join(r.getMessage() for r in records)


async def test_tokens_to_other_clients_hold_the_verdict_that_the_log_alone_cannot(shim_lab, lab, tmp_path):
    """The case the log cannot see (README: "What stays invisible from outside the server"): a
    probe queued behind another client's long non-batchable generation. Without the shim the
    daemon judges that working server hung; with it, the tokens delivered to the other client
    hold the verdict until the generation ends."""
    tokens = 8000  # ~15 s on the tiny model, served alone
    shimmed, said = await _watch_during_long_seeded_generation(shim_lab, tmp_path / "shim", tokens)
    assert not [r for r in shimmed if r["event"] == "verdict"], said
    assert "lab: shim: " in said and "token(s) delivered to other clients" in said
    plain, said_plain = await _watch_during_long_seeded_generation(lab, tmp_path / "plain", tokens)
    assert [r for r in plain if r["event"] == "verdict"], said_plain  # the false verdict the shim prevents
