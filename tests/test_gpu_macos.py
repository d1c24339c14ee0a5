"""The GPU's utilisation on macOS (``mlxwatch.host.gpu``, ``mlxwatch.evidence.gpu``): the
command as ioreg(8) documents it, the parser on real output quoted in a public source, and the
cadence's use of it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mlxwatch.evidence import Window
from mlxwatch.evidence.cadence import Cadence, Estimate, Speed
from mlxwatch.evidence.gpu import GpuSource, build
from mlxwatch.host.gpu import GpuReading, ioreg_argv, parse_ioreg
from test_macos_parsers import recorded


def test_the_command_is_ioregs_documented_synopsis():
    """ioreg(8) (macOS, e.g. unix.com/man-page/osx/8/ioreg): ``ioreg [-abfilrtx] [-c class]
    [-d depth] [-k key] [-n name] [-p plane] [-w width]``; -r roots the tree at the objects the
    -c class matches, -d 1 shows those roots only, -w 0 is an unlimited line width."""
    argv = ioreg_argv()
    assert Path(argv[0]).name == "ioreg"
    bare, valued, given = set("abfilrtx"), set("cdknpw"), {}
    args = iter(argv[1:])
    for arg in args:
        assert arg.startswith("-") and len(arg) == 2 and arg[1] in bare | valued, arg
        given[arg[1]] = next(args) if arg[1] in valued else True
    assert given == {"r": True, "c": "IOAccelerator", "d": "1", "w": "0"}


def test_the_parser_reads_a_real_m4_max_line():
    reading = parse_ioreg(recorded("ioreg-lmstudiobench-m4max.txt"))
    assert reading == GpuReading(busy=0.16, in_use_bytes=2363801600)


def test_the_parser_takes_the_busiest_accelerator_and_refuses_nonsense():
    two = ('"PerformanceStatistics" = {"Device Utilization %"=5}\n'
           '"PerformanceStatistics" = {"Renderer Utilization %"=70,"In use system memory"=7}\n')
    assert parse_ioreg(two) == GpuReading(0.7, 7)
    assert parse_ioreg('"PerformanceStatistics" = {"Device Utilization %"=101}').error
    assert parse_ioreg("ioreg: garbage").error and parse_ioreg("").busy is None


async def test_the_source_reads_on_a_mac_only_and_says_once_when_it_cannot():
    assert build(None, platform="linux") is None  # type: ignore[arg-type]
    assert isinstance(build(None, platform="darwin"), GpuSource)  # type: ignore[arg-type]
    calls = []

    async def fails() -> GpuReading:
        calls.append(1)
        return GpuReading(error="ioreg: not found")

    source = GpuSource(read=fails)
    first = await source.look(Window(0.0, 1.0, suspect=True))
    again = await source.look(Window(0.0, 1.5, suspect=True))  # within POLL: not read again
    assert first.notes and not again.notes and len(calls) == 1
    assert first.detail == {"gpu": {"unavailable": "ioreg: not found"}}


def test_a_chunk_running_late_on_a_busy_gpu_gets_one_more_chunk_and_no_more():
    cadence = Cadence(Speed(chunk=Estimate(10.0, 0.5, 9), step=Estimate(0.05, 0.01, 9)))
    owed = {"kernel": {"owed": [{"arrived": 0.0, "request_bytes": 30000, "streamed": True}], "streams": 1}}
    idle = cadence.judge(20.0, 0.0, {**owed, "gpu": {"busy": 0.0}})
    assert not idle.allows(20.0, 0.0)  # the chunk's bound (15 s) passed, the GPU idles: a stall
    busy = cadence.judge(20.0, 0.0, {**owed, "gpu": {"busy": 0.9}})
    assert busy.allows(20.0, 0.0) and "the GPU is 90% busy" in busy.owes
    assert not cadence.judge(31.0, 0.0, {**owed, "gpu": {"busy": 0.9}}).allows(31.0, 0.0)


def test_reading_the_gpu_runs_ioreg_bounded(monkeypatch):
    from mlxwatch.host import gpu
    from mlxwatch.host.commands import CommandResult

    seen = {}

    async def run(argv, timeout):
        seen.update(argv=argv, timeout=timeout)
        return CommandResult(list(argv), 0, b'"PerformanceStatistics" = {"Device Utilization %"=42}', b"", 0.01)

    monkeypatch.setattr(gpu, "run_command", run)
    assert asyncio.run(gpu.read_gpu()) == GpuReading(0.42, None)
    assert seen["argv"] == ioreg_argv() and seen["timeout"] <= 5.0
