"""Parsers of macOS output, on real output quoted in public sources (tests/data: each fixture
names its source above its marker line), and the capture steps that use them.

Where a rule has no real output to test it on (a branching ``sample`` graph, a nested block
with its own ``pid`` line in ``launchctl print``), the input is written here and says so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxwatch.capture import CaptureRequest, collector, macos
from mlxwatch.host import launchctl
from mlxwatch.host.commands import CommandResult

DATA = Path(__file__).parent / "data"
MARK = "# ----- output below, as quoted -----\n"


def recorded(name: str) -> str:
    header, marker, body = (DATA / name).read_text().partition(MARK)
    assert marker and header.startswith("# source: https://"), f"{name} names no source"
    return body


def test_every_fixture_names_its_public_source():
    names = [p.name for p in DATA.iterdir() if p.is_file()]
    assert names
    for name in names:
        recorded(name)


# --- launchctl print


def test_print_of_a_running_job_gives_pid_state_and_paths():
    """boxen/puppet-boxen#104: a running job (4-space indentation, OS X 10.10); nested blocks
    (arguments, environment) are skipped; the excerpt's missing closing brace is tolerated."""
    info = launchctl.parse_print(recorded("launchctl-print-boxen-104.txt"))
    assert info.pid == 24784 and info.state == "running"
    assert info.plist == Path("/Library/LaunchDaemons/dev.mysql.plist")
    assert info.stderr_path == info.stdout_path == Path("/opt/boxen/log/mysql/console.log")


def test_print_of_a_loaded_job_that_is_not_running_has_no_pid():
    """aspelldenny/advisory-cron (Darwin 25.5.0, gui/501): tabs, no pid line, nested event
    triggers whose `service =` lines are not the job's."""
    info = launchctl.parse_print(recorded("launchctl-print-advisory-cron.txt"))
    assert info.pid is None and info.state == "not running"
    assert info.plist == Path("/Users/nguyenhuuanh/Library/LaunchAgents/com.advisorycron.probe-p005.plist")
    assert info.stderr_path == Path("/tmp/advisory-cron-probe-p005.stderr.log")


def test_print_reads_only_the_job_blocks_own_pid_and_state():
    """Written here, not recorded: newer macOS prints coalition blocks one level down with their
    own `state` and `pid` lines; only the job's top-level lines count, wherever they come."""
    text = ("gui/501/x = {\n\tresource coalition = {\n\t\tstate = active\n\t\tpid = 1\n\t}\n"
            "\tstate = running\n\tpid = 36019\n\tjetsam coalition = {\n\t\tpid = 1\n\t}\n}\n")
    info = launchctl.parse_print(text)
    assert (info.pid, info.state) == (36019, "running")


@pytest.mark.parametrize("text", ["", "Bad request.\n", "gui/501/x = {\n\tpid = abc\n}\n", "\x00\x01{{{"])
def test_print_output_it_cannot_read_gives_nothing_not_an_error(text):
    info = launchctl.parse_print(text)
    assert info.pid is None and info.plist is None


def test_job_status_prefers_the_plist_files_log_path(monkeypatch, tmp_path):
    """The paths come from the job's plist (`path =`) when it can be read, from print otherwise."""
    plist = tmp_path / "dev.mysql.plist"
    import plistlib
    plist.write_bytes(plistlib.dumps({"Label": "dev.mysql", "StandardErrorPath": str(tmp_path / "err.log")}))
    text = recorded("launchctl-print-boxen-104.txt").replace("/Library/LaunchDaemons/dev.mysql.plist", str(plist))
    monkeypatch.setattr(launchctl, "runner", lambda argv: launchctl.Result(0, text, ""))
    status = launchctl.job_status("dev.mysql", "system")
    assert status.loaded and status.pid == 24784 and status.log == tmp_path / "err.log"
    monkeypatch.setattr(launchctl, "runner",
                        lambda argv: launchctl.Result(0, recorded("launchctl-print-boxen-104.txt"), ""))
    assert launchctl.job_status("dev.mysql", "system").log == Path("/opt/boxen/log/mysql/console.log")


def test_job_status_of_an_unknown_label_says_launchds_reason(monkeypatch):
    """NixOS/nix#9978 quotes `launchctl print system/org.nixos.darwin-store` answering
    "Bad request." then "Could not find service ...": the reason, not "Bad request.", is kept."""
    monkeypatch.setattr(launchctl, "runner", lambda argv: launchctl.Result(
        113, "", 'Bad request.\nCould not find service "org.nixos.darwin-store" in domain for system\n'))
    status = launchctl.job_status("org.nixos.darwin-store", "system")
    assert not status.loaded and status.pid is None
    assert status.detail.endswith('Could not find service "org.nixos.darwin-store" in domain for system')


def test_job_status_without_launchctl(monkeypatch):
    def missing(argv):
        raise launchctl.LaunchctlMissing("launchctl: not found (launchd exists only on macOS)")
    monkeypatch.setattr(launchctl, "runner", missing)
    assert "not found" in launchctl.job_status("x", "gui", 501).detail


# --- sample


def test_sample_header_and_call_graph():
    """quicksilver/Quicksilver#1689: a real sample of a hung app."""
    report = macos.parse_sample(recorded("sample-quicksilver-1689.txt"))
    assert report.process == "Quicksilver [78156]"
    assert report.header["OS Version"] == "Mac OS X 10.9 (13A603)"
    (thread,) = report.threads
    assert thread.heading.startswith("Thread_1447670") and thread.samples == 2569
    assert thread.path[0] == "start_wqthread  (in libsystem_pthread.dylib)"
    assert thread.leaf == "_dispatch_queue_invoke  (in libdispatch.dylib)"


def test_sample_threads_of_a_fragment_with_and_without_graph_lines():
    """quicksilver/Quicksilver#1388: the last thread of a graph has no `+` marks; a frame before
    any thread heading (the tail of an earlier thread) is skipped."""
    report = macos.parse_sample(recorded("sample-quicksilver-1388.txt"))
    assert [t.heading.split()[0] for t in report.threads] == ["Thread_417632:", "Thread_434309"]
    marking, worker = report.threads
    assert marking.leaf == "__psynch_cvwait  (in libsystem_kernel.dylib)" and len(marking.path) == 7
    assert worker.leaf == "_dispatch_call_block_and_release  (in libdispatch.dylib)" and len(worker.path) == 5
    assert report.findings()[0].startswith("Thread_417632: 2651 samples, heaviest path ends ")


def test_sample_follows_the_heaviest_branch():
    """Written here, not recorded (no public sample with MLX threads was found): a branching
    graph; the lighter sibling's subtree must not be grafted onto the heavier path."""
    text = "\n".join([
        "Call graph:",
        "    100 Thread_7   DispatchQueue_1: com.apple.main-thread  (serial)",
        "    + 100 start  (in dyld) + 1  [0x1]",
        "    +   60 mlx::core::eval_impl(std::vector<mlx::core::array>, bool)  (in libmlx.dylib) + 2  [0x2]",
        "    +   ! 60 std::condition_variable::wait(std::unique_lock<std::mutex>&)  (in libc++.1.dylib) + 3  [0x3]",
        "    +   ! : 60 __psynch_cvwait  (in libsystem_kernel.dylib) + 8  [0x4]",
        "    +   40 _PyEval_EvalFrameDefault  (in Python) + 4  [0x5]",
        "    +     40 deeper_in_python  (in Python) + 5  [0x6]",
        "    100 Thread_8: com.Metal.CompletionQueueDispatch",
        "      100 _dispatch_worker_thread  (in libdispatch.dylib) + 1  [0x7]",
        "",
        "Total number in stack (recursive counted multiple times):",
        "        100 start  (in dyld) + 1  [0x1]",
    ])
    report = macos.parse_sample(text)
    main, metal = report.threads
    assert [f.split("  (in ")[0] for f in main.path] == [
        "start", "mlx::core::eval_impl(std::vector<mlx::core::array>, bool)",
        "std::condition_variable::wait(std::unique_lock<std::mutex>&)", "__psynch_cvwait"]
    assert metal.path == ["_dispatch_worker_thread  (in libdispatch.dylib)"]
    findings = report.findings()
    assert "[MLX/Metal]" in findings[0] and "[MLX/Metal]" in findings[1]


def test_sample_of_something_else_gives_no_threads():
    assert macos.parse_sample("sample: no such process\n").threads == []


# --- crash reports


def test_ips_crash_report_two_json_objects():
    """DozaVisuals/doza-assist#23: header line (bug_type 309) + body (pid, procName)."""
    text = recorded("python-doza-assist-23.ips")
    report = macos.parse_crash_report(text)
    assert (report.pid, report.process, report.bug_type) == (2266, "Python", "309")
    assert macos.crash_report_matches(text, 2266) and not macos.crash_report_matches(text, 2267)
    assert macos.crash_report_matches(text, None)  # no PID: a Python process is ours to look at


def test_an_ips_of_another_bug_type_is_not_a_crash_report():
    """The same real report with its header's bug_type changed: not a crash, never collected."""
    text = recorded("python-doza-assist-23.ips").replace('"bug_type":"309"', '"bug_type":"288"', 1)
    assert not macos.crash_report_matches(text, 2266)


@pytest.mark.parametrize("name, pid", [("python-omlx-1548.crash", 65813), ("python-omlx-410.crash", 22793)])
def test_text_crash_reports_of_a_metal_abort(name, pid):
    """jundot/omlx#1548 and #410: MLX's Python aborted on Metal's completion queue (mlx < 0.32);
    the older "Thread N Crashed:: Dispatch queue:" and newer "Triggered by Thread:" layouts."""
    text = recorded(name)
    report = macos.parse_crash_report(text)
    assert (report.pid, report.process, report.exception) == (pid, "Python", "EXC_CRASH (SIGABRT)")
    assert report.crashed_queue == "com.Metal.CompletionQueueDispatch"
    assert macos.crash_report_matches(text, pid) and not macos.crash_report_matches(text, pid + 1)


def _reports_dir(tmp_path: Path) -> Path:
    d = tmp_path / "DiagnosticReports"
    d.mkdir()
    return d


def test_recent_crash_reports_filter_by_time_and_pid(tmp_path):
    d = _reports_dir(tmp_path)
    (d / "Python-2026-05-12-185638.ips").write_text(recorded("python-doza-assist-23.ips"))
    old = d / "Python-2026-05-30-151330.crash"
    old.write_text(recorded("python-omlx-1548.crash"))
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    (d / "notes.txt").write_text(recorded("python-omlx-1548.crash"))
    found = macos.recent_crash_reports(2266, since=time.time() - 3600, dirs=(str(d),), alive=True)
    assert [p.name for p in found] == ["Python-2026-05-12-185638.ips"]
    assert macos.recent_crash_reports(65813, since=time.time() - 3600, dirs=(str(d),), alive=True) == []


def test_a_dead_servers_report_is_waited_for(tmp_path):
    """ReportCrash writes a moment after the death: the search is retried for a few seconds."""
    d = _reports_dir(tmp_path)
    target = d / "Python-2026-05-30-151330.crash"

    def write_late():
        time.sleep(1.0)
        target.write_text(recorded("python-omlx-1548.crash"))

    import threading
    writer = threading.Thread(target=write_late)
    writer.start()
    started = time.monotonic()
    found = macos.recent_crash_reports(65813, since=time.time() - 60, dirs=(str(d),), alive=False, settle=5.0)
    writer.join()
    assert found == [target] and 0.9 < time.monotonic() - started < 4.0
    started = time.monotonic()
    assert macos.recent_crash_reports(1, since=time.time() - 60, dirs=(str(d),), alive=True, settle=5.0) == []
    assert time.monotonic() - started < 0.5  # a live process is not waited for


# --- the capture steps on a "Mac": spindump's stdout, sample's parsed graph


@pytest.fixture
def fake_mac(monkeypatch):
    monkeypatch.setattr(macos, "is_macos", lambda platform=None: True)
    monkeypatch.setattr(macos, "tool_available", lambda name: True)


def _runner_for(outputs: dict[str, bytes], calls: list[list[str]]):
    async def runner(argv, timeout):
        argv = list(argv)
        calls.append(argv)
        tool = Path(argv[2] if argv[0] == "sudo" else argv[0]).name
        if tool == "sample":
            Path(argv[argv.index("-file") + 1]).write_bytes(outputs["sample"])
            return CommandResult(argv, 0, b"", b"", 0.1)
        if tool in outputs:
            return CommandResult(argv, 0, outputs[tool], b"", 0.1)
        return CommandResult(argv, None, b"", b"", 0.0, f"{argv[0]}: not found")
    return runner


async def test_spindump_report_is_written_by_mlxwatch_private_and_listed(tmp_path, fake_mac, monkeypatch):
    """Run as root or under sudo, spindump no longer writes a file (that file was root's: the
    chmod failed and it was missing from the manifest); its stdout is written by mlxwatch."""
    monkeypatch.setattr(collector.os, "geteuid", lambda: 0)
    spindump = recorded("spindump-quicksilver-2166.txt").encode()
    calls: list[list[str]] = []
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        bundle = await collector.capture_bundle(
            CaptureRequest(pid=server.pid, out_dir=tmp_path / "bundles", snapshots=1, spacing=0.1, ceiling=20.0),
            runner=_runner_for({"spindump": spindump, "sample": recorded("sample-quicksilver-1689.txt").encode()},
                               calls))
    finally:
        server.kill()
        server.wait()
    written = bundle.path / "native" / "spindump.txt"
    assert written.read_bytes() == spindump
    assert written.stat().st_mode & 0o777 == 0o600
    assert "native/spindump.txt" in bundle.manifest["files"]
    (spin,) = [c for c in calls if Path(c[0]).name == "spindump" or "spindump" in " ".join(c[:3])]
    assert "-o" not in spin and "-stdout" in spin
    threads = json.loads((bundle.path / "native" / "sample-threads.json").read_text())
    assert threads["process"] == "Quicksilver [78156]" and threads["threads"][0]["samples"] == 2569


async def test_a_failed_spindump_keeps_what_it_printed_and_says_why(tmp_path, fake_mac, monkeypatch):
    monkeypatch.setattr(collector.os, "geteuid", lambda: 0)

    async def runner(argv, timeout):
        if "spindump" in " ".join(argv):
            return CommandResult(list(argv), 77, b"", b"spindump must be run as root when sampling the live system\n",
                                 0.1, "exit 77: spindump must be run as root when sampling the live system")
        return CommandResult(list(argv), None, b"", b"", 0.0, f"{argv[0]}: not found")

    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        bundle = await collector.capture_bundle(
            CaptureRequest(pid=server.pid, out_dir=tmp_path / "bundles", snapshots=1, spacing=0.1, ceiling=20.0),
            runner=runner)
    finally:
        server.kill()
        server.wait()
    step = next(s for s in bundle.manifest["steps"] if s["name"] == "spindump")
    assert step["outcome"] == "failed" and "must be run as root" in step["error"]
    assert not (bundle.path / "native" / "spindump.txt").exists()


# --- the classifier's Metal out-of-memory lines say which mlx versions abort and which raise


def _metal_log(thread_died: bool = True):
    from mlxwatch.serverlog.markers import scan

    # Written here, not recorded: the shape of mlx >= 0.32's raise (mlx/backend/metal/device.cpp
    # at PR #3523 formats "[METAL] Command buffer execution failed: {}.") ending a thread's traceback.
    error = ("RuntimeError: [METAL] Command buffer execution failed: Insufficient Memory "
             "(00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory).")
    head = ["Exception in thread Thread-1 (_generate):", "Traceback (most recent call last):",
            '  File "/v/lib/python3.12/site-packages/mlx_lm/generate.py", line 1369, in _step']
    return scan("\n".join((head if thread_died else []) + [error]) + "\n")


def test_a_metal_oom_in_a_dead_thread_names_mlx_032_and_is_not_counted_as_more_evidence():
    from mlxwatch.capture.classify import Evidence, classify

    result = classify(Evidence(log=_metal_log(), probe_ran=True, probe_failure="first_token_timeout"))
    assert result.kind == "dead_thread"
    assert any("PR #3523" in line and "mlx >= 0.32.0" in line for line in result.evidence)
    # One death signal (/health 503) plus the Metal line: still one signal, so not "high".
    alone = classify(Evidence(log=_metal_log(thread_died=False), health_status=503, probe_ran=True))
    assert alone.kind == "dead_thread" and alone.confidence == "medium"
    assert any("PR #3523" in line for line in alone.evidence)


def test_a_crash_after_a_metal_oom_names_the_abort_of_mlx_before_032():
    from mlxwatch.capture.classify import Evidence, classify

    result = classify(Evidence(process_alive=False, log=_metal_log()))
    assert result.kind == "crashed"
    assert any("on mlx < 0.32" in line and "aborts the whole process" in line for line in result.evidence)


def test_without_python_stacks_the_classification_shows_what_sample_saw():
    """py-spy often fails on a Mac: the bundle's classification then lists sample's findings
    (each thread's heaviest native path), from a real sample (quicksilver/Quicksilver#1689)."""
    from mlxwatch.capture.classify import Evidence, classify

    findings = macos.parse_sample(recorded("sample-quicksilver-1689.txt")).findings()
    ev = Evidence(stacks_error="py-spy: Operation timed out (os error 60)", native_findings=findings,
                  probe_ran=True, process_cpu=2.0)
    result = classify(ev)
    assert any(line.startswith("sample: Thread_1447670") and "_dispatch_queue_invoke" in line
               for line in result.evidence)
    assert any("no stacks" in line for line in result.competing)


# --- nettop's logging-mode CSV (kernel sight on macOS)
#
# vrlda/netglass's capture (macOS 26.5.2, `nettop -n -L 1 -J bytes_in,bytes_out,interface,
# state,time`, not root). Expectations are read off the fixture by eye: OpenCode Helper.71830
# serves 127.0.0.1:52122 to two clients; Tunnel.41723 serves 127.0.0.1:10808 to its own
# clients (30 rows `tcp4 127.0.0.1:10808<->127.0.0.1:N,lo0,Established`, one `Closed` with no
# counts, a listener, and a udp4 socket on the same port).

NETTOP_CSV = "nettop-netglass-capture.csv"


def test_nettop_gives_each_server_end_with_bytes_out_as_sent():
    """Only the server's ends (local port 52122): not its listener, not the clients' ends
    (`127.0.0.1:62377<->127.0.0.1:52122`, whose remote port is the server's)."""
    from mlxwatch.host import nettop

    conns = {c.client: c for c in nettop.parse(recorded(NETTOP_CSV), {52122})}
    assert set(conns) == {("127.0.0.1", 62377), ("127.0.0.1", 52142)}
    # `tcp4 127.0.0.1:52122<->127.0.0.1:52142,lo0,Established,608,264370376,`
    c = conns[("127.0.0.1", 52142)]
    assert (c.port, c.bytes_sent, c.bytes_received) == (52122, 264370376, 608)
    assert (conns[("127.0.0.1", 62377)].bytes_sent, conns[("127.0.0.1", 62377)].bytes_received) == (219091, 2316)
    assert c.idle_send is None and not c.own


def test_nettop_lists_tcp_connections_that_can_still_send_and_nothing_else():
    """Port 10808: 30 established server ends; the `Closed` row (no counts), the listener and
    the udp4 socket on the same port are left out; listeners alone (51560) give nothing."""
    from mlxwatch.host import nettop

    conns = nettop.parse(recorded(NETTOP_CSV), {10808})
    assert len(conns) == 30 and {c.port for c in conns} == {10808}
    assert ("127.0.0.1", 62345) not in {c.client for c in conns}  # the Closed one
    assert len({c.key for c in conns}) == 30
    assert nettop.parse(recorded(NETTOP_CSV), {51560, 5000, 7000}) == ()
    both = nettop.parse(recorded(NETTOP_CSV), {10808, 52122})
    assert len(both) == 32


def test_nettop_time_wait_rows_keep_their_counts_and_are_closed_connections():
    """A connection that closed first from its local end stays listed in TimeWait with its
    byte counts (the fixture's `tcp4 127.0.0.1:62345<->127.0.0.1:10808,lo0,TimeWait,2484,1396`,
    the client end of a connection to 10808): a server end left so by a server that answered
    and closed is read as closed, with what it carried (kernel sight counts that answer). The
    FinWait1 row (`198.18.0.1:65364<->17.248.214.67:443,utun8,FinWait1,0,1771`) is one too:
    its local end sent its FIN."""
    from mlxwatch.host import nettop

    [c] = nettop.parse(recorded(NETTOP_CSV), {62345})
    assert c.closed and c.counted and (c.client, c.bytes_sent, c.bytes_received) == (("127.0.0.1", 10808), 1396, 2484)
    [fin] = nettop.parse(recorded(NETTOP_CSV), {65364})
    assert fin.closed and fin.bytes_sent == 1771
    assert not any(c.closed for c in nettop.parse(recorded(NETTOP_CSV), {10808, 52122}))  # all Established


def test_nettop_keys_are_stable_and_own_client_ends_are_marked():
    """The same connection has the same key in another reading (it is the 4-tuple: nettop
    shows no socket id); a server end whose client end is one of ours is `own`."""
    from mlxwatch.host import nettop

    text = recorded(NETTOP_CSV)
    first = {c.client: c for c in nettop.parse(text, {52122}, {("127.0.0.1", 62377, 52122)})}
    again = {c.client: c for c in nettop.parse(text, {52122})}
    assert {k: c.key for k, c in first.items()} == {k: c.key for k, c in again.items()}
    assert first[("127.0.0.1", 62377)].own and not first[("127.0.0.1", 52142)].own
    # Our socket to another port with the same client port is not this connection.
    assert not any(c.own for c in nettop.parse(text, {52122}, {("127.0.0.1", 62377, 9999)}))


def test_nettop_asks_for_our_own_sockets_only_when_it_found_a_connection():
    from mlxwatch.host import nettop

    calls = []
    nettop.parse(recorded(NETTOP_CSV), {51560}, lambda: calls.append(1) or set())
    assert calls == []
    nettop.parse(recorded(NETTOP_CSV), {52122}, lambda: calls.append(1) or set())
    assert calls == [1]


def test_nettop_ipv6_endpoints_are_address_dot_port():
    """Written here, not recorded: the capture has no established tcp6 connection, only tcp6
    listeners (`tcp6 *.51560<->*.*`) and a quic6 row in the same addr.port form; this applies
    that form to a connection, and an IPv4-mapped client to our socket's plain address."""
    from mlxwatch.host import nettop

    text = ("time,,interface,state,bytes_in,bytes_out,\n"
            "00:00:00.000001,tcp6 ::1.8080<->::1.50001,lo0,Established,120,4096,\n"
            "00:00:00.000002,tcp6 ::ffff:127.0.0.1.8080<->::ffff:127.0.0.1.50002,lo0,FinWait2,7,9,\n")
    conns = {c.client: c for c in nettop.parse(text, {8080}, {("127.0.0.1", 50002, 8080)})}
    assert set(conns) == {("::1", 50001), ("::ffff:127.0.0.1", 50002)}
    assert conns[("::1", 50001)].bytes_sent == 4096 and not conns[("::1", 50001)].own
    assert conns[("::ffff:127.0.0.1", 50002)].own


def test_nettop_finds_columns_by_the_header_not_by_position():
    """nettop prints columns in its own order whatever -J asks (netglass's notes quote the
    manual: "The ordering is currently as per nettop default"); the fixture's rows with the
    columns rearranged, as another macOS could print them, read the same."""
    from mlxwatch.host import nettop

    lines = recorded(NETTOP_CSV).splitlines()
    order = [5, 4, 3, 0, 1, 2, 6]  # bytes_out,bytes_in,state,time,(unnamed),interface,(trailing)
    shuffled = "\n".join(",".join(line.split(",")[i] for i in order) for line in lines)
    assert shuffled.startswith("bytes_out,bytes_in,state,time,,interface,")
    assert nettop.parse(shuffled, {52122, 10808}) == nettop.parse(recorded(NETTOP_CSV), {52122, 10808})


@pytest.mark.parametrize(("text", "says"), [
    ("", "printed nothing"),
    # Written here: what nettop prints for a column it does not know is its usage (netglass's
    # notes), not a CSV header; the exact usage text is not quoted anywhere public.
    ("usage: nettop [-ncd] [-m <mode>] [-t <type>] [-s <seconds>] [-p <process-name|pid>] [-n]"
     " [-l <samples>] [-L <samples>] [-P] [-j|k|J <column-name[,column-name]...>]\n", "no CSV header"),
    ("time,,interface,bytes_in\n00:00,tcp4 127.0.0.1:8080<->127.0.0.1:5,lo0,1\n", "lacks state, bytes_out"),
    ("time,,state,bytes_in,bytes_out,\n0,tcp4 127.0.0.1:8080<->127.0.0.1:5,Established,1.2 KiB,3,\n",
     "bytes_in is not a byte count: '1.2 KiB'"),
    ("time,,state,bytes_in,bytes_out,\n0,tcp4 127.0.0.1:8080<->127.0.0.1:5,Established,1,\n", "a tcp row has 5 fields"),
])
def test_nettop_output_it_cannot_read_is_a_format_error(text, says):
    from mlxwatch.host import nettop

    with pytest.raises(nettop.NettopFormatError, match=re.escape(says)) as caught:
        nettop.parse(text, {8080})
    assert "\n" not in str(caught.value)
