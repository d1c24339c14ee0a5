"""The front door in the daemon, against the real mlx_lm.server (each mlx-lm version under test).

An open-loop client (the official openai SDK, a new streaming request every second, as a busy
app sends them) talks only to the door. Through each fault shape, one after another in one
daemon run (each restart relaunches the lab server): no request ends as an empty success, each
failed one gets an explicit error from the door (never a client timeout), and after recovery the
next answer is correct with nothing changed on the client. A healthy server under the same load:
no verdict, every answer identical to the direct one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from mlxwatch.config import CaptureConfig, Config, FrontConfig, InstanceConfig, ProbeConfig, RestartConfig
from mlxwatch.daemon.supervisor import Daemon
from mlxwatch.journal.incidents import Journal
from lab.ports import free_port
from lab.server import LabServer, relaunch_argv

PROBE = ProbeConfig(interval=3.0, suspect_interval=1.0, first_token_timeout=5.0, timeout=10.0, failures=2,
                    grace_ceiling=30.0, endpoint_timeout=2.0, startup_timeout=90.0)
PROMPT = [{"role": "user", "content": "Count from one to ten."}]
MAX_TOKENS = 12
PER_FAULT = 90.0  # seconds a fault may take from switch-on to a correct answer after recovery (generous: 2 loaded cores)


@dataclass
class Outcome:
    sent: float  # monotonic
    ended: float
    kind: str  # ok | empty | error
    text: str = ""
    error: str = ""
    explicit: bool = True  # an error the door (or server) wrote, not the client's own timeout or lost connection


class OpenLoop:
    """A new streaming request every ``every`` seconds, whatever the earlier ones are doing."""

    def __init__(self, base_url: str, every: float = 1.0) -> None:
        self.client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
        self.every = every
        self.outcomes: list[Outcome] = []
        self.tasks: set[asyncio.Task] = set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            task = asyncio.create_task(self.one())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            try:
                await asyncio.wait_for(stop.wait(), self.every)
            except TimeoutError:
                pass
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.close()

    async def one(self) -> None:
        sent = time.monotonic()
        text, finished = "", False
        try:
            stream = await self.client.chat.completions.create(model="default_model", messages=PROMPT, stream=True,
                                                               max_tokens=MAX_TOKENS, temperature=0.0)
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finished = finished or chunk.choices[0].finish_reason is not None
        except openai.APIConnectionError as exc:  # includes the client's own timeout: not explicit
            self.outcomes.append(Outcome(sent, time.monotonic(), "error", text, repr(exc), explicit=False))
            return
        except openai.APIError as exc:
            self.outcomes.append(Outcome(sent, time.monotonic(), "error", text, f"{type(exc).__name__}: {exc.message}"))
            return
        self.outcomes.append(Outcome(sent, time.monotonic(), "ok" if text and finished else "empty", text))


def config_for(lab: LabServer, state_dir: Path, front: FrontConfig) -> Config:
    restart = RestartConfig("command", argv=relaunch_argv(lab.workdir), timeout=120.0, backoff=1.0, budget=10)
    inst = InstanceConfig("lab", lab.url, lab.log_path, lab.pid_file, PROBE, restart, "off", front)
    return Config(None, (inst,), state_dir, (), CaptureConfig(snapshots=2, spacing=0.5, ceiling=20.0))


def events(journal: Journal) -> list[dict]:
    return [r for r in journal.records() if r.get("instance") == "lab"]


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)


def direct_answer(lab: LabServer) -> str:
    """The answer straight from the server (no door), streamed the same way."""
    client = openai.OpenAI(base_url=lab.url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    try:
        stream = client.chat.completions.create(model="default_model", messages=PROMPT, stream=True,
                                                max_tokens=MAX_TOKENS, temperature=0.0)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    finally:
        client.close()


async def test_through_every_fault_clients_get_errors_never_empty_answers(lab, tmp_path):
    """spin, block, die, gil and a crash, each in turn, with the open-loop client on the door."""
    expected = direct_answer(lab)
    assert expected
    front = FrontConfig(listen=("127.0.0.1", free_port()), stall_timeout=3.0, request_stall_timeout=30.0)
    config = config_for(lab, tmp_path / "state", front)
    stop, client_stop = asyncio.Event(), asyncio.Event()
    daemon = Daemon(config, config.state_dir)
    task = asyncio.create_task(daemon.run(stop))
    journal = Journal(config.state_dir)
    loop_client = OpenLoop(f"http://127.0.0.1:{front.listen[1]}")
    client_task = None
    report: list[str] = []
    try:
        await until(lambda: (getattr(daemon, "state", None) and (daemon.state.instance("lab").get("last_probe") or {})
                             .get("ok")), 60, "a healthy probe")
        client_task = asyncio.create_task(loop_client.run(client_stop))
        await until(lambda: any(o.kind == "ok" for o in loop_client.outcomes), 30, "a first answer through the door")
        for fault in ("spin", "block", "die", "gil", "crash"):
            lab.refresh()
            seen = len([r for r in events(journal) if r["event"] == "recovered"])
            switched = time.monotonic()
            if fault == "crash":
                os.kill(lab.pid, signal.SIGKILL)
            else:
                lab.set_fault(fault)
            await until(lambda: len([r for r in events(journal) if r["event"] == "recovered"]) > seen,  # noqa: B023  awaited here
                        PER_FAULT, f"{fault}: recovered")
            recovered_at = time.monotonic()
            await until(lambda: any(o.kind == "ok" and o.sent > recovered_at for o in loop_client.outcomes),  # noqa: B023  awaited here
                        30, f"{fault}: a correct answer after recovery")
            during = [o for o in loop_client.outcomes if o.ended > switched and o.sent < recovered_at]
            report.append(f"{fault}: {time.monotonic() - switched:.0f}s, "
                          f"{sum(o.kind == 'error' for o in during)} errors, {sum(o.kind == 'ok' for o in during)} ok")
    finally:
        client_stop.set()
        if client_task is not None:
            await client_task
        stop.set()
        await task
    outcomes = loop_client.outcomes
    empty = [o for o in outcomes if o.kind == "empty"]
    implicit = [o for o in outcomes if o.kind == "error" and not o.explicit]
    wrong = [o for o in outcomes if o.kind == "ok" and o.text != expected]
    assert not empty, f"empty successes: {empty}; {report}"
    assert not implicit, f"errors that were not explicit: {implicit[:3]}; {report}"
    assert not wrong, f"answers that differ from the direct one: {wrong[:3]}; {report}"
    assert any(o.kind == "error" for o in outcomes), report
    records = events(journal)
    verdicts = [r for r in records if r["event"] == "verdict"]
    assert len(verdicts) == 5, [r["event"] for r in records]
    in_flight_at_verdict: list[int] = []
    for captured in (r for r in records if r["event"] == "captured"):
        requests = json.loads((Path(captured["bundle"]) / "front" / "requests.json").read_text())
        assert isinstance(requests, list)
        # sizes and ages, never the prompt itself (capture.requests: metadata, the default)
        assert all("body" not in r and PROMPT[0]["content"] not in json.dumps(r) and r["prompt_bytes"] > 0
                   for r in requests), requests
        in_flight_at_verdict.append(len(requests))
    assert sum(in_flight_at_verdict) > 0  # the stalls (spin, block, gil) had requests in flight


async def test_a_healthy_server_under_load_through_the_door_gets_no_verdict(lab, tmp_path):
    """Twenty seconds of open-loop traffic (two requests a second) through the door: every answer
    is the direct one, no verdict, and the door's metrics count them."""
    expected = direct_answer(lab)
    front = FrontConfig(listen=("127.0.0.1", free_port()), stall_timeout=3.0)
    config = config_for(lab, tmp_path / "state", front)
    stop, client_stop = asyncio.Event(), asyncio.Event()
    daemon = Daemon(config, config.state_dir)
    task = asyncio.create_task(daemon.run(stop))
    loop_client = OpenLoop(f"http://127.0.0.1:{front.listen[1]}", every=0.5)
    try:
        await until(lambda: getattr(daemon, "state", None) is not None, 30, "the daemon")
        client_task = asyncio.create_task(loop_client.run(client_stop))
        await asyncio.sleep(20.0)  # the load's duration is the point of the test, not a wait for a condition
        client_stop.set()
        await client_task
        state = daemon.state.instance("lab")
    finally:
        stop.set()
        await task
    outcomes = loop_client.outcomes
    assert len(outcomes) >= 20
    assert [o for o in outcomes if o.kind != "ok" or o.text != expected] == []
    assert "verdict" not in [r["event"] for r in events(Journal(config.state_dir))]
    assert state["state"] in ("healthy", "starting")
