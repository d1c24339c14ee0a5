"""Why a server died (capture.death), from the kernel's log, the memory cgroup and the server's
log. The kernel records below are the ones this machine's kernel wrote (6.18, cgroup v1) when a
process in a 50 MiB memory cgroup allocated 200 MiB (2026-12-07), in /dev/kmsg's record form."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxwatch.capture import death
from mlxwatch.host import cgroup, kernlog
from mlxwatch.serverlog.markers import scan

PID = 6124
RECORDS = [
    "4,1200,198349000,-;python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
    "6,1201,198349400,-;memory: usage 51200kB, limit 51200kB, failcnt 104",
    "6,1202,198349603,-;Tasks state (memory values in pages):",
    "6,1203,198349645,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/mlxw-probe,task_memcg=/mlxw-probe,task=python3,pid=6124,uid=0",
    "3,1204,198349695,-;Memory cgroup out of memory: Killed process 6124 (python3) total-vm:221368kB, "
    "anon-rss:50816kB, file-rss:6708kB, shmem-rss:0kB, UID:0 pgtables:164kB oom_score_adj:0",
    "6,1205,210000000,-;python3[7001]: segfault at 0 ip 00007f1c2a0b1c3d sp 00007ffd3e1a2b40 error 4 in libc.so.6",
]


def kernel_log(records=RECORDS) -> kernlog.KernelLog:
    return kernlog.KernelLog(tuple(r for r in (kernlog.parse_record(x) for x in records) if r is not None))


def v1_cgroup(root: Path, name: str = "mlxw-probe", limit: int = 50 * 1024 * 1024, oom_kill: int = 1) -> Path:
    d = root / "memory" / name
    d.mkdir(parents=True)
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.usage_in_bytes").write_text("0\n")
    (d / "memory.max_usage_in_bytes").write_text(f"{limit}\n")
    (d / "memory.failcnt").write_text("104\n")
    (d / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n")
    (d / "memory.stat").write_text(f"cache 0\nrss 0\nhierarchical_memory_limit {limit}\n")
    return d


def test_a_kmsg_record_is_read_as_dmesg_prints_it():
    rec = kernlog.parse_record(RECORDS[4] + "\n SUBSYSTEM=memory\n")
    assert rec is not None and rec.seconds == pytest.approx(198.349695)
    assert rec.line().startswith("[  198.349695] Memory cgroup out of memory: Killed process 6124 (python3)")
    assert kernlog.parse_record("not a record") is None


def test_the_lines_about_a_pid_are_its_oom_report_and_kill_not_anothers():
    lines = kernel_log().about(PID)
    texts = [r.text for r in lines]
    assert texts[0].startswith("python3 invoked oom-killer") and "Killed process 6124" in texts[-1]
    assert not any("7001" in t for t in texts)
    assert kernel_log().about(PID, since_boot=199.0) == []  # a PID reused later: the old kill is not its
    kill = kernlog.oom_kill(lines)
    assert kill == kernlog.OomKill("/mlxw-probe", "CONSTRAINT_MEMCG", 50816)
    assert [r.text for r in kernel_log().about(7001)] == [RECORDS[5].split(";", 1)[1]]


def test_an_oom_kill_is_named_with_the_kernels_line_and_the_cgroups_limit(tmp_path):
    v1_cgroup(tmp_path)
    cause = death.why_gone(death.GoneProcess(PID, None), None, read_kernel_log=kernel_log, cgroup_root=tmp_path)
    assert cause.cause == "oom_killer"
    assert cause.summary == ("killed by the kernel's OOM killer (memory cgroup /mlxw-probe, limit 50 MiB) "
                             "at 50 MiB resident")
    assert "Killed process 6124 (python3)" in cause.evidence[0]
    assert cause.cgroup == {"limit": 50 * 1024 * 1024, "usage": 0, "peak": 50 * 1024 * 1024, "failcnt": 104,
                            "oom_kill": 1}
    assert "Killed process 6124" in cause.files["death/kernel.log"]
    assert cause.signal == "SIGKILL" and cause.to_dict()["signal"] == "SIGKILL"


def test_an_oom_kill_whose_cgroup_is_gone_still_names_the_cgroup(tmp_path):
    cause = death.why_gone(death.GoneProcess(PID, None), None, read_kernel_log=kernel_log, cgroup_root=tmp_path)
    assert cause.cause == "oom_killer" and "memory cgroup /mlxw-probe" in cause.summary
    assert cause.sources["memory cgroup"] == "/mlxw-probe: gone (its counters went with it)"


def test_a_segfault_line_is_a_native_crash(tmp_path):
    cause = death.why_gone(death.GoneProcess(7001, None), None, read_kernel_log=kernel_log, cgroup_root=tmp_path)
    assert cause.cause == "native_crash" and "segfault at 0" in cause.summary and cause.signal == "SIGSEGV"


def test_an_unreadable_kernel_log_falls_back_to_the_servers_log_and_says_so(tmp_path):
    unreadable = lambda: kernlog.KernelLog(error="/dev/kmsg: Operation not permitted")  # noqa: E731
    log = scan("Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nValueError: bad model\n")
    cause = death.why_gone(death.GoneProcess(5, None), log, read_kernel_log=unreadable, cgroup_root=tmp_path)
    assert cause.cause == "traceback" and cause.summary == "a Python exception: ValueError: bad model"
    assert cause.sources["kernel log"] == "/dev/kmsg: Operation not permitted"
    fatal = scan("Fatal Python error: Segmentation fault\n\nCurrent thread 0x0001 (most recent call first):\n")
    assert death.why_gone(death.GoneProcess(5, None), fatal, read_kernel_log=unreadable).cause == "native_crash"
    nothing = death.why_gone(death.GoneProcess(5, None), scan(""), read_kernel_log=unreadable)
    assert nothing.cause == "unknown" and "Operation not permitted" in nothing.summary


def test_a_dead_thread_with_a_metal_memory_error_died_of_out_of_memory():
    log = scan("Exception in thread Thread-1 (_generate):\nTraceback (most recent call last):\n"
               "RuntimeError: [metal::malloc] Resource limit (499000) exceeded.\n")
    cause = death.why_thread_died(log)
    assert cause is not None and cause.cause == "out_of_memory"
    assert cause.summary == "out of memory (Metal): RuntimeError: [metal::malloc] Resource limit (499000) exceeded."
    assert death.why_thread_died(scan("Exception in thread Thread-1 (_generate):\nValueError: x\n")) is None


def test_the_cgroup_of_a_process_on_v1_and_v2(tmp_path):
    v1 = cgroup.of_lines("12:pids:/x\n5:memory:/lab/server\n0::/user.slice\n", tmp_path)
    assert v1 == cgroup.MemoryCgroup(1, "/lab/server", tmp_path) and v1.dir == tmp_path / "memory/lab/server"
    assert cgroup.of_lines("0::/lab\n", tmp_path) is None  # no memory controller on a v2 root here
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    v2 = cgroup.of_lines("0::/lab/server\n", tmp_path)
    assert v2 == cgroup.MemoryCgroup(2, "/lab/server", tmp_path)
    (tmp_path / "lab/server").mkdir(parents=True)
    (tmp_path / "lab/memory.max").write_text("104857600\n")
    (tmp_path / "lab/server/memory.max").write_text("max\n")
    (tmp_path / "lab/server/memory.current").write_text("5000\n")
    (tmp_path / "lab/server/memory.events").write_text("low 0\nhigh 0\nmax 7\noom 2\noom_kill 1\n")
    assert v2.read() == {"usage": 5000, "oom": 2, "oom_kill": 1, "max_events": 7, "limit": 104857600}


@pytest.mark.skipif(not os.path.exists("/proc/self/cgroup"), reason="Linux /proc only")
def test_this_process_cgroup_is_read_from_proc():
    cg = cgroup.memory_cgroup(os.getpid())
    if cg is not None:
        assert "usage" in cg.read()


def test_a_death_is_counted_by_cause_and_shown_in_status(tmp_path):
    """The captured record's cause: one death in the metrics' cause label, named in status."""
    from mlxwatch.config import Config, InstanceConfig
    from mlxwatch.daemon.metrics import Metrics
    from mlxwatch.journal.incidents import Incident, Journal
    from mlxwatch.journal.state import StateFile
    from mlxwatch.output.status import state_label, status_lines

    config = Config(None, (InstanceConfig("gemma", "http://127.0.0.1:8000"),), None)
    journal, state = Journal(tmp_path), StateFile(tmp_path, None)
    metrics = Metrics(lambda: config, state)
    journal.observers.append(metrics.on_record)
    inc = Incident("gemma")
    journal.record("capturing", inc, state="capturing")
    inc.kind, inc.cause, inc.cause_summary = "crashed", "oom_killer", "killed by the kernel's OOM killer (memory cgroup /lab)"
    journal.record("captured", inc, state="capturing")
    text = metrics.exposition().decode()
    assert 'mlxwatch_deaths_total{cause="oom_killer",server="gemma"} 1.0' in text
    assert 'mlxwatch_deaths_total{cause="jetsam",server="gemma"} 0.0' in text
    opened = {"id": inc.id, "stopped_at_event": "captured", "kind": "crashed", "cause": "oom_killer",
              "cause_summary": inc.cause_summary}
    instance = {"name": "gemma", "configured": True, "state": "hung", "failures": 2, "restarts_in_window": 0,
                "budget": 3, "last_probe": None, "last_incident": None, "open_incident": opened}
    assert state_label(instance) == "down (crashed: oom_killer)"
    status = {"state_dir": str(tmp_path), "state_problem": None, "config": None,
              "daemon": {"running": True, "pid": 1, "stalled": False, "updated_at": 0}, "instances": [instance]}
    lines = [t.plain for t in status_lines(status, 120)]
    assert "  why it died: killed by the kernel's OOM killer (memory cgroup /lab)" in lines
