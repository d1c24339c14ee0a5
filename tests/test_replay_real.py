"""Replay against the real mlx_lm.server (issue 35): a hang set off by a sequence of requests
(the lab's ``sequence`` fault: a prompt holding MARK_A, then within seconds a streamed prompt
holding MARK_B, livelocks it; either alone does not) is recorded by the door, kept by the
daemon's bundle, brought back by ``mlxwatch replay --launch``, and shrunk to the pair.

Twenty requests go through the door, the two that matter among them; the daemon (front door
recording, restart: none) judges the hang and captures. The replay and the shrink start servers
of their own from the bundle's recorded command line, with this environment (the lab's fault
injector and its control file) inherited."""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import Path

import pytest
from rich.console import Console

from mlxwatch.capture.requests import load_requests
from mlxwatch.cli.app import run
from mlxwatch.config import CaptureConfig, Config, FrontConfig, InstanceConfig, ProbeConfig, RestartConfig
from mlxwatch.journal.incidents import Journal
from lab.daemon import run_daemon_until
from lab.ports import free_port
from lab.sequence import A_AT, B_AT, FAULT, MARK_A, MARK_B, body, record_hang, send_twenty
from lab.server import LabServer

PROBE = ProbeConfig(interval=3.0, suspect_interval=1.0, first_token_timeout=4.0, timeout=8.0, failures=2,
                    grace_ceiling=30.0, endpoint_timeout=2.0, startup_timeout=90.0)
STALL = "1.5s"  # the replay's stall timeout: the tiny model answers in well under a second


def fault_env(monkeypatch: pytest.MonkeyPatch, lab: LabServer, tmp_path: Path) -> None:
    """This process's environment as the lab server's, the sequence fault in a control file of
    this test's: what a server the replay launches inherits."""
    fault = tmp_path / "fault"
    fault.write_text(FAULT)
    for key, value in {**lab.environment(), "MLXWATCH_FAULT_FILE": str(fault)}.items():
        monkeypatch.setenv(key, value)


def cli(argv: list[str]) -> tuple[int, str]:
    buffer = io.StringIO()
    code = run(argv, out=Console(file=buffer, width=400))
    return code, buffer.getvalue()


def test_the_daemon_records_the_sequence_and_replay_launch_brings_the_hang_back(lab, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    lab.set_fault(FAULT)
    front = FrontConfig(listen=("127.0.0.1", free_port()), stall_timeout=2.0, record=True)
    inst = InstanceConfig("lab", lab.url, lab.log_path, lab.pid_file, PROBE, RestartConfig(), "off", front)
    config = Config(None, (inst,), tmp_path / "state", (), CaptureConfig(snapshots=2, spacing=0.5, ceiling=20.0,
                                                                         dir=tmp_path / "bundles"))
    started: list[asyncio.Task] = []

    async def scenario() -> Journal:
        async def go() -> None:
            started.extend(await send_twenty(f"http://127.0.0.1:{front.listen[1]}"))

        journal = await run_daemon_until(config, lambda j: any(r["event"] == "captured" for r in j.records()),
                                         timeout=180, after_healthy=lambda: started.append(asyncio.ensure_future(go())))
        for task in started:
            task.cancel()
        await asyncio.gather(*started, return_exceptions=True)
        return journal

    journal = asyncio.run(scenario())
    bundle = Path(next(r for r in journal.records() if r["event"] == "captured")["bundle"])
    held = load_requests(bundle)
    assert [r.body for r in held] == [body(i) for i in range(1, len(held) + 1)] and len(held) >= B_AT
    summary = (bundle / "summary.md").read_text()
    working = summary.split("working on these when delivery stopped", 1)[1].split("\n\n", 1)[0]
    assert f"#{B_AT} " in working and "stream true" in working
    for text in (MARK_A, MARK_B):
        assert text not in caplog.text and text not in summary

    fault_env(monkeypatch, lab, tmp_path)
    code, out = cli(["replay", str(bundle), "--launch", "--stall-timeout", STALL, "--out", str(tmp_path / "replays")])
    assert code == 0, out
    assert "hang reproduced after request #" in out and "shape: livelock" in out, out
    in_flight = out.split("in flight: ", 1)[1].split("\n", 1)[0].split()
    assert f"#{B_AT}" in in_flight and f"#{A_AT}" not in in_flight, out
    code, out = cli(["replay", str(bundle), "--to", lab.url, "--stall-timeout", STALL])
    assert code == 2 and out == ""  # the bundle's own server: refused without --allow-bundle-url


@pytest.mark.newest_server_only
def test_shrink_finds_the_pair_among_twenty(lab, tmp_path, monkeypatch):
    """Recorded through a door of the test's own (no daemon), captured, then shrunk: the pair."""
    lab.set_fault(FAULT)

    bundle = asyncio.run(record_hang(lab.url, lab.pid, tmp_path / "bundles"))
    lab.relaunch()
    fault_env(monkeypatch, lab, tmp_path)
    code, out = cli(["replay", str(bundle), "--shrink", "--stall-timeout", STALL, "--max-trials", "40",
                     "--out", str(tmp_path / "shrunk")])
    assert code == 0, out
    assert "smallest sequence: 2 request(s)" in out, out
    assert f"  #{A_AT} at " in out and f"  #{B_AT} at " in out, out
    written = Path(out.split("written: ", 1)[1].split(" ", 1)[0])
    assert [r.body for r in load_requests(written)] == [body(A_AT), body(B_AT)]
