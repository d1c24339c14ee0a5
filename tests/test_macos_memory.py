"""macOS memory deaths (capture.macos_memory, capture.death.macos_reports): parsed on reports
quoted in public issues (tests/data, each file names its source), the `log show` query built
as log(1)'s synopsis says. Not run on a Mac (docs/verified.md)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from mlxwatch.capture import death, macos_memory

DATA = Path(__file__).parent / "data"


def data(name: str) -> str:
    """The quoted output, below the fixture's header that names its source."""
    header, marker, body = (DATA / name).read_text().partition("# ----- output below, as quoted -----\n")
    assert marker and header.startswith("# source: https://"), name
    return body


def test_a_jetsam_report_names_the_killed_process_its_reason_and_pages():
    kill = macos_memory.parse_jetsam(data("jetsam-kscrash-278-entry.txt"), 4624)
    assert kill == macos_memory.JetsamKill(4624, "RebornTunnel", "per-process-limit", 960, 16384, None)
    assert kill.summary() == "killed by jetsam (per-process-limit) at 15 MiB resident"
    assert macos_memory.parse_jetsam(data("jetsam-kscrash-278-entry.txt"), 4625) is None  # another PID: not ours


def test_a_jetsam_reports_head_says_who_was_largest():
    text = data("jetsam-omlx-702-head.txt")
    assert macos_memory.is_jetsam_report(text)
    assert macos_memory.jetsam_header(text) == {"bug_type": "298", "largest": "Python", "page_size": "16384",
                                                "timestamp": "2026-04-10 05:05:26.00 -0500"}
    assert macos_memory.parse_jetsam(text, 4624) is None  # cut before the process list


def test_a_panic_report_says_why():
    assert macos_memory.parse_panic(data("panic-omlx-1384.txt")) == \
        '"completeMemory() prepare count underflow" @IOGPUMemory.cpp:550'
    assert macos_memory.parse_panic("no panic here") is None


def test_the_unified_logs_metal_out_of_memory_line_is_found():
    lines = macos_memory.metal_oom_lines(data("unified-log-mlx-serve-321.txt"))
    assert lines == ["Execution of the command buffer was aborted due to an error during execution. Insufficient "
                     "Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"]


def test_log_show_is_one_narrow_time_bounded_query_as_the_synopsis_says():
    """log(1): ``log show [--archive archive | --file file] [--predicate filter] [--process pid |
    process] [--source] [--style default | compact | json | ndjson | syslog] [--color ...]
    [--start date/time] [--end date/time] [--info] [--debug] [--last time] ...``; dates as
    "YYYY-MM-DD HH:MM:SS" (predicates: https://eclecticlight.co/2016/10/17/log-a-primer-on-predicates/)."""
    died = time.mktime((2026, 12, 7, 1, 30, 0, 0, 0, -1))
    argv = macos_memory.log_show_command(4242, died)
    assert Path(argv[0]).name == "log" and argv[1] == "show"
    opts = dict(zip(argv[2::2], argv[3::2], strict=True))
    assert set(opts) == {"--style", "--start", "--end", "--predicate"} and opts["--style"] == "compact"
    assert (opts["--start"], opts["--end"]) == ("2026-12-07 01:28:00", "2026-12-07 01:30:05")
    assert opts["--predicate"].startswith("processID == 4242 AND (")
    assert 'eventMessage CONTAINS "Insufficient Memory"' in opts["--predicate"]


def test_a_jetsam_report_naming_the_server_is_its_cause(tmp_path, monkeypatch):
    """The report on disk (written after the server started) names its PID: cause jetsam, the
    report copied; the unified log's query could not run here (no `log`), and says so."""
    (tmp_path / "JetsamEvent-2026-04-10-050526.ips").write_text(data("jetsam-kscrash-278-entry.txt"))
    monkeypatch.setattr(macos_memory, "REPORT_DIRS", (str(tmp_path),))
    gone = death.GoneProcess(4624, time.time() - 60)
    reports = death.macos_reports(gone, time.time())
    cause = death.why_gone(gone, None, linux=False, reports=reports)
    assert cause.cause == "jetsam" and cause.summary == "killed by jetsam (per-process-limit) at 15 MiB resident"
    assert "death/JetsamEvent-2026-04-10-050526.ips" in cause.files
    assert cause.sources["unified log"].startswith("log show:")
    os.utime(tmp_path / "JetsamEvent-2026-04-10-050526.ips", (0, 0))  # older than the server: not about it
    assert death.why_gone(gone, None, linux=False, reports=death.macos_reports(gone, time.time())).cause == "unknown"
