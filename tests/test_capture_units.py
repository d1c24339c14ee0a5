"""Capture's pure parts: classification rules, tool command lines, log markers, bundle storage
and redaction. macOS-only tools (sample, spindump, crash reports) are tested in
test_macos_commands.py and test_macos_parsers.py; they cannot run on Linux CI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

import mlxwatch.probes
from mlxwatch import stacks
from mlxwatch.capture import CaptureRequest, capture_bundle, collector, delivery, procstats, pyspy
from mlxwatch.capture.bundle import (
    WRITER,
    BundleWriter,
    LowDiskSpace,
    adopt_partials,
    list_bundles,
    prune,
)
from mlxwatch.capture.classify import Evidence, classify
from mlxwatch.capture.export import export_bundle, redact_file
from mlxwatch.capture.redact import PRIVATE, redact_environment
from mlxwatch.capture.results import VersionsResult
from mlxwatch.capture.runner import StepRunner
from mlxwatch.capture.summary import render_summary
from mlxwatch.host.commands import CommandResult, run_command
from mlxwatch.host.sockets import KernelCounters
from mlxwatch.serverlog.markers import scan, since_last_start
from mlxwatch.serverlog.markers import prompt_advances
from lab.evidence import KernelShows


def thread(name="Thread-1 (_generate)", frames=(("_step", 1369), ("next", 1415), ("_generate", 853))):
    return stacks.ThreadStack(name, 101, True, False,
                             [stacks.Frame(fn, "/x/mlx_lm/server.py", line) for fn, line in frames])


MAIN = stacks.ThreadStack("MainThread", 100, False, False, [stacks.Frame("serve_forever", "socketserver.py", 233)])
SAME = [[MAIN, thread()] for _ in range(3)]
MOVING = [[MAIN, thread(frames=((f"f{i}", i), ("_generate", 853)))] for i in range(3)]
NO_GEN = [[MAIN] for _ in range(3)]
PROBE_FAILED = dict(probe_ran=True, probe_ok=False, probe_failure="no_first_token", health_status=200, models_status=200)


@pytest.mark.parametrize("evidence, kind, confidence", [
    (Evidence(process_alive=False), "crashed", "high"),
    (Evidence(probe_ran=True, probe_ok=True, probe_tokens=4, snapshots=SAME), "healthy", "high"),
    (Evidence(**{**PROBE_FAILED, "endpoints_answered": False}, snapshots=SAME, process_cpu=0.0), "wedged", "high"),
    (Evidence(**PROBE_FAILED, snapshots=NO_GEN, process_cpu=0.0), "dead_thread", "high"),
    (Evidence(**{**PROBE_FAILED, "health_status": 503}, snapshots=[], process_cpu=0.0), "dead_thread", "medium"),
    (Evidence(**PROBE_FAILED, snapshots=SAME, process_cpu=0.5), "blocked", "high"),
    (Evidence(**PROBE_FAILED, snapshots=MOVING, process_cpu=0.5), "livelock", "low"),  # it steps: CPU only argues
    (Evidence(**PROBE_FAILED, snapshots=MOVING, process_cpu=98.0), "livelock", "high"),
    (Evidence(**PROBE_FAILED, snapshots=MOVING, process_cpu=12.0), "livelock", "medium"),
    (Evidence(**PROBE_FAILED, snapshots=SAME, process_cpu=98.0), "livelock", "high"),
    (Evidence(**PROBE_FAILED, snapshots=SAME, process_cpu=98.0, log_progress_advanced=True), "busy", "medium"),
    (Evidence(**PROBE_FAILED, snapshots=SAME, process_cpu=12.0), "livelock", "medium"),
    (Evidence(**PROBE_FAILED, snapshots=SAME), "blocked", "low"),
    (Evidence(**PROBE_FAILED, snapshots=SAME[:1], process_cpu=98.0), "livelock", "medium"),
    (Evidence(**PROBE_FAILED, snapshots=[], stacks_error="py-spy not found", process_cpu=0.0), "blocked", "low"),
    (Evidence(**PROBE_FAILED, snapshots=[], stacks_error="py-spy not found", process_cpu=12.0), "livelock", "low"),
    (Evidence(snapshots=[], stacks_error="needs root", process_cpu=0.0), "unknown", "low"),
    (Evidence(**PROBE_FAILED, snapshots=SAME, process_cpu=0.5,
              delivered_to_clients=["kernel: 700 bytes of tokens sent to clients in the last 3s"]), "busy", "high"),
])
def test_classification_rules(evidence, kind, confidence):
    """Each kind from the evidence that defines it, with the confidence that evidence earns."""
    result = classify(evidence)
    assert (result.kind, result.confidence) == (kind, confidence), result
    assert result.evidence


def test_cpu_alone_never_means_busy():
    """A burning CPU with no delivery and no visible progress is a livelock, never 'busy'."""
    result = classify(Evidence(**PROBE_FAILED, snapshots=MOVING, process_cpu=100.0))
    assert result.kind == "livelock"


def test_idle_server_without_probe_is_not_called_blocked():
    """No URL, generation thread parked in _next_request: an idle server, not a hang."""
    idle = [[MAIN, thread(frames=(("Queue.get", 180), ("_next_request", 477), ("_generate", 725)))]] * 3
    assert classify(Evidence(snapshots=idle, process_cpu=0.0)).kind == "healthy"


def test_ambiguity_is_reported():
    """A generation thread in the stacks contradicts /health 503: dead_thread, with the conflict named."""
    result = classify(Evidence(**{**PROBE_FAILED, "health_status": 503}, snapshots=SAME, process_cpu=0.0))
    assert result.kind == "dead_thread" and result.confidence == "medium"
    assert any("generation thread appears" in c for c in result.competing)


@pytest.mark.parametrize("kw, argv", [
    (dict(as_json=True, native=True), ["py-spy", "dump", "--pid", "42", "--json", "--native"]),
    (dict(as_json=False, native=False), ["py-spy", "dump", "--pid", "42"]),
    (dict(as_json=True, native=True, nonblocking=True), ["py-spy", "dump", "--pid", "42", "--json", "--nonblocking"]),
    (dict(as_json=True, native=False, sudo=True), ["sudo", "-n", "py-spy", "dump", "--pid", "42", "--json"]),
])
def test_py_spy_command_construction(kw, argv):
    """--native is never combined with --nonblocking; sudo -n only when configured; never --locals."""
    assert pyspy.dump_command("py-spy", 42, **kw) == argv


def test_py_spy_platform_rules():
    """--native on Linux only; root needed on macOS unless already root."""
    assert pyspy.native_supported("linux") and not pyspy.native_supported("darwin")
    assert pyspy.needs_root("darwin", euid=501) and not pyspy.needs_root("darwin", euid=0)
    assert not pyspy.needs_root("linux", euid=501)


LOG = """\
2026-07-05 08:00:00,000 - INFO - Starting httpd at 127.0.0.1 on port 8082...
Exception in thread Thread-1 (_generate):
Traceback (most recent call last):
  File "generate.py", line 1369, in _step
RuntimeError: old crash from the previous process
2026-07-05 08:19:00,000 - INFO - Starting httpd at 127.0.0.1 on port 8082...
127.0.0.1 - - [05/Jul/2026 08:19:30] "POST /v1/chat/completions HTTP/1.1" 200 -
2026-07-05 08:19:39,913 - INFO - Prompt processing progress: 23032/25660
Exception in thread Thread-1 (_generate):
Traceback (most recent call last):
  File "/x/mlx_lm/generate.py", line 1369, in _step
127.0.0.1 - - [05/Jul/2026 08:19:41] "GET /v1/models HTTP/1.1" 200 -
    mx.async_eval(self._next_tokens, self._next_logprobs, token_context)
RuntimeError: [metal::malloc] Resource limit (499000) exceeded.
ValueError: Missing 627 parameters: self_attn.indexer.weight
"""


def test_log_markers_from_the_current_process_only():
    """Markers after the last server start; interleaved access lines do not cut a traceback."""
    markers = scan(since_last_start(LOG))
    assert markers.prompt_progress == (23032, 25660)
    assert markers.admission_count == 1 and markers.last_completion is None  # admitted, not answered
    assert markers.thread_exceptions == ["Exception in thread Thread-1 (_generate):"]
    assert markers.generation_thread_exception
    assert markers.last_traceback[-1] == "RuntimeError: [metal::malloc] Resource limit (499000) exceeded."
    assert markers.metal_malloc and markers.missing_parameters
    assert "old crash" not in json.dumps(markers.to_dict())


def test_bundle_is_invisible_until_finished_and_never_overwritten(tmp_path):
    """Files go into a hidden partial dir; finish renames it; two bundles never share a name."""
    writer = BundleWriter(tmp_path, "gemma")
    writer.write("a.txt", "evidence")
    assert list_bundles(tmp_path) == [] and writer.partial.exists()
    with pytest.raises(FileExistsError):
        writer.write("a.txt", "again")  # never overwrite, even inside a bundle
    first = writer.finish({"classification": {}}, "# s\n")
    second = BundleWriter(tmp_path, "gemma").finish({"classification": {}}, "# s\n")
    assert first != second and list_bundles(tmp_path) == [first, second]
    manifest = json.loads((first / "manifest.json").read_text())
    assert set(manifest["files"]) == {"a.txt", "summary.md"}


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def as_if_written_by(writer: BundleWriter, pid: int, create_time: float) -> None:
    (writer.partial / WRITER).unlink()
    (writer.partial / WRITER).write_text(json.dumps({"pid": pid, "create_time": create_time}))


def test_partial_bundle_of_a_killed_capture_is_kept(tmp_path):
    """A partial dir whose writer is gone is renamed '-incomplete' (not deleted), however young;
    one whose writer is alive (this process: a capture in progress) is left alone."""
    killed = BundleWriter(tmp_path, "gemma")
    killed.write("stacks/pyspy-1.txt", "stack")
    as_if_written_by(killed, dead_pid(), time.time() - 10)
    running = BundleWriter(tmp_path, "other")
    running.write("stacks/pyspy-1.txt", "stack")
    one_second_ago = time.time() - 1
    for partial in (killed.partial, running.partial):
        os.utime(partial, (one_second_ago, one_second_ago))
    adopted = adopt_partials(tmp_path)
    assert [p.name for p in adopted] == [killed.name + "-incomplete"]
    assert (adopted[0] / "stacks/pyspy-1.txt").read_text() == "stack"
    assert running.partial.is_dir()
    old = time.time() - 3600  # its writer still alive: old age does not make it abandoned
    os.utime(running.partial, (old, old))
    assert adopt_partials(tmp_path) == [] and running.partial.is_dir()


def test_partial_of_a_reused_pid_is_adopted(tmp_path):
    """A live PID with another create time is not the writer (the PID was reused)."""
    writer = BundleWriter(tmp_path, "gemma")
    as_if_written_by(writer, os.getpid(), time.time() - 10**6)
    assert [p.name for p in adopt_partials(tmp_path)] == [writer.name + "-incomplete"]


def test_partial_without_writer_file_falls_back_to_age(tmp_path):
    """No .writer file (killed before writing it, or an older mlxwatch): adopted once old enough."""
    writer = BundleWriter(tmp_path, "gemma")
    (writer.partial / WRITER).unlink()
    assert adopt_partials(tmp_path) == []
    old = time.time() - 3600
    os.utime(writer.partial, (old, old))
    assert [p.name for p in adopt_partials(tmp_path)] == [writer.name + "-incomplete"]


def test_finished_bundle_has_no_writer_file(tmp_path):
    """The writer record exists only while the bundle is partial and is never in the manifest."""
    writer = BundleWriter(tmp_path, "gemma")
    assert json.loads((writer.partial / WRITER).read_text())["pid"] == os.getpid()
    path = writer.finish({"classification": {}}, "# s\n")
    assert not (path / WRITER).exists() and WRITER not in json.loads((path / "manifest.json").read_text())["files"]


def test_retention_keeps_newest_and_the_protected_one(tmp_path):
    """prune keeps the newest `keep` bundles and never the one just written."""
    made = []
    for i in range(4):
        made.append(BundleWriter(tmp_path, f"b{i}").finish({"classification": {}}, "x"))
        os.utime(made[-1], (time.time() - 100 + i, time.time() - 100 + i))
    removed = prune(tmp_path, keep=2, max_bytes=10**9, protect=made[0])
    assert set(removed) == {made[1], made[2]}
    assert set(list_bundles(tmp_path)) == {made[0], made[3]}


def test_redact_log_keeps_known_shapes_only():
    """Known server lines survive (home paths folded); anything else is replaced by its length."""
    text = ("2026-07-05 08:19:39,913 - INFO - Prompt processing progress: 10/20\n"
            "2026-07-05 08:19:39,913 - DEBUG - Incoming Request Body: {\"messages\": \"my diary\"}\n"
            '  File "/Users/tadeusz/venv/mlx_lm/server.py", line 853, in _generate\n'
            "RuntimeError: [metal::malloc] Resource limit (499000) exceeded.")
    out = redact_file("log-tail.txt", text.encode()).decode().splitlines()
    assert out[0].endswith("Prompt processing progress: 10/20")
    assert out[1].startswith("[redacted ") and "diary" not in out[1]
    assert out[2] == '  File "~/venv/mlx_lm/server.py", line 853, in _generate'
    assert out[3].startswith("RuntimeError: [metal::malloc]")


def test_environment_secrets_removed():
    """The raw bundle's environment: secret-looking names and token-looking values are removed,
    URL passwords cut; the rest kept."""
    env = {"HF_TOKEN": "hf_abc", "OPENAI_API_KEY": "x", "DB_PASSWORD": "p", "MY_SECRET": "s",
           "HF_HUB_CACHE": "/cache", "SOMETHING": "hf_looks_like_a_token", "PATH": "/usr/bin",
           "DATABASE_URL": "postgres://app:pw@db/x", "GPG_PASSPHRASE": "words", "TOKENIZERS_PARALLELISM": "false"}
    out = redact_environment(env, PRIVATE)
    assert out == {"HF_TOKEN": "[removed]", "OPENAI_API_KEY": "[removed]", "DB_PASSWORD": "[removed]",
                   "MY_SECRET": "[removed]", "HF_HUB_CACHE": "/cache", "SOMETHING": "[removed]", "PATH": "/usr/bin",
                   "DATABASE_URL": "postgres://app:[redacted]@db/x", "GPG_PASSPHRASE": "[removed]",
                   "TOKENIZERS_PARALLELISM": "false"}


def test_export_refuses_to_overwrite(tmp_path):
    """A second export to the same file is refused."""
    bundle = BundleWriter(tmp_path, "b").finish({"classification": {}, "target": {}}, "x")
    first = export_bundle(bundle)
    with tarfile.open(first) as tar:
        assert f"{bundle.name}/summary.md" in tar.getnames()
    with pytest.raises(FileExistsError):
        export_bundle(bundle)


async def test_command_runner_ends_a_hanging_tool():
    """A tool that hangs is ended at its timeout and recorded as such."""
    t0 = time.monotonic()
    result = await run_command(["sleep", "30"], timeout=0.5)
    assert not result.ok and "timed out after 0.5s" in result.error
    assert time.monotonic() - t0 < 5


async def test_command_runner_missing_tool():
    """A missing tool is an error naming it, not an exception."""
    result = await run_command(["mlxwatch-no-such-tool"], timeout=1)
    assert result.error == "mlxwatch-no-such-tool: not found"


DISCONNECT_LOG = """\
2026-07-05 08:19:00,000 - INFO - Starting httpd at 127.0.0.1 on port 8082...
Exception in thread Thread-1 (_generate):
Traceback (most recent call last):
  File "/x/mlx_lm/generate.py", line 1369, in _step
RuntimeError: [metal::malloc] Resource limit (499000) exceeded.
----------------------------------------
Exception occurred during processing of request from ('127.0.0.1', 51234)
Traceback (most recent call last):
  File "/usr/lib/python3.11/socketserver.py", line 691, in process_request_thread
    self.finish_request(request, client_address)
  File "/x/mlx_lm/server.py", line 1566, in keepalive_callback
    self.wfile.write(msg)
BrokenPipeError: [Errno 32] Broken pipe
----------------------------------------
Exception in thread Thread-7 (process_request_thread):
Traceback (most recent call last):
  File "/x/mlx_lm/server.py", line 1580, in handle_completion
127.0.0.1 - - [05/Jul/2026 08:19:41] "GET /v1/models HTTP/1.1" 200 -
    self.wfile.flush()
ConnectionResetError: [Errno 104] Connection reset by peer
"""


def test_client_disconnect_tracebacks_are_not_evidence():
    """A BrokenPipe / ConnectionReset traceback (a probe that gave up) never replaces the real
    traceback before it and is not counted as a thread exception."""
    markers = scan(since_last_start(DISCONNECT_LOG))
    assert markers.last_traceback[-1] == "RuntimeError: [metal::malloc] Resource limit (499000) exceeded."
    assert markers.thread_exceptions == ["Exception in thread Thread-1 (_generate):"]
    assert markers.client_disconnects == 2
    only_disconnects = scan(DISCONNECT_LOG.split("----------------------------------------\n", 1)[1])
    assert only_disconnects.last_traceback == [] and only_disconnects.thread_exceptions == []
    assert not only_disconnects.generation_thread_exception


def test_admissions_are_not_progress():
    """mlx-lm logs 'POST ... 200' when it admits a request: a livelocked server admitting a
    retrying client is still a livelock; the admissions are an informational line."""
    result = classify(Evidence(**PROBE_FAILED, snapshots=MOVING, process_cpu=98.0, log_admissions=5))
    assert result.kind == "livelock", result
    assert any("5 other request(s) admitted" in line and "not progress" in line for line in result.evidence)


# Recorded shapes (a real spin bundle of the lab server on mlx-lm 0.32.2): the generation thread
# waits in mx.eval inside the spinning step while MLX's own threads compute, so py-spy sees the
# same Python stack in every snapshot; and the lab's block fault parked in threading's Event.wait.
SPIN_FRAMES = (("_spin_step", "fault_server.py", 65),
               ("install.<locals>.FaultyBatchGenerator.next", "fault_server.py", 85),
               ("ResponseGenerator._generate", "/x/mlx_lm/server.py", 943),
               ("ResponseGenerator._run_generate", "/x/mlx_lm/server.py", 544), ("Thread.run", "threading.py", 982))
BLOCK_FRAMES = (("Condition.wait", "threading.py", 320), ("Event.wait", "threading.py", 622),
                ("_block_forever", "fault_server.py", 47),
                ("install.<locals>.FaultyBatchGenerator.next", "fault_server.py", 81),
                ("ResponseGenerator._generate", "/x/mlx_lm/server.py", 943))


def recorded(frames, n=3):
    gen = stacks.ThreadStack("Thread-1 (_run_generate)", 101, False, False, [stacks.Frame(*f) for f in frames])
    return [[MAIN, gen] for _ in range(n)]


SPIN_SAME = recorded(SPIN_FRAMES)
SPIN_MOVING = [[MAIN, stacks.ThreadStack("Thread-1 (_run_generate)", 101, True, False,
                                        [stacks.Frame(*f) for f in ((fn, "fault_server.py", line), *SPIN_FRAMES[1:])])]
               for fn, line in (("_spin_step", 65), ("_spin_step", 62), ("read_fault", 37))]


@pytest.mark.parametrize("snapshots", [SPIN_SAME, SPIN_MOVING], ids=["same-stack", "moving-stack"])
def test_a_livelock_on_a_loaded_machine_is_still_a_livelock(snapshots):
    """Measured: under load a spinning server got 19% of a core and was classified unknown ("CPU
    19% is between idle (5%) and busy (20%)"). Load only lowers a spinning server's CPU share; a
    process well above idle computes: livelock, with the confidence lowered, never unknown."""
    result = classify(Evidence(**PROBE_FAILED, snapshots=snapshots, process_cpu=19.0, generation_cpu=1.6))
    assert result.kind == "livelock", result
    assert result.confidence == "medium", result
    assert any("19%" in line and "below busy" in line for line in result.evidence), result


def test_blocked_in_a_wait_stays_blocked_at_a_moderate_cpu():
    """Identical stacks inside threading's wait: blocked, whatever other threads of the process
    burn; a CPU above idle lowers the confidence, it does not make the verdict unknown."""
    quiet = classify(Evidence(**PROBE_FAILED, snapshots=recorded(BLOCK_FRAMES), process_cpu=0.4))
    assert (quiet.kind, quiet.confidence) == ("blocked", "high"), quiet
    loaded = classify(Evidence(**PROBE_FAILED, snapshots=recorded(BLOCK_FRAMES), process_cpu=12.0))
    assert (loaded.kind, loaded.confidence) == ("blocked", "medium"), loaded


@pytest.mark.parametrize("snapshots, cpu", [(SPIN_SAME, 89.0), (SAME, 98.0)], ids=["recorded-spin", "same"])
def test_identical_stacks_are_counted_once(snapshots, cpu):
    """Measured: a quiet run called most livelocks 'medium' because 'stack identical' was listed
    as evidence and again as competing evidence. It is one clue, stated once, and at a busy CPU
    it does not lower the confidence by itself."""
    result = classify(Evidence(**PROBE_FAILED, snapshots=snapshots, process_cpu=cpu, generation_cpu=1.6))
    assert (result.kind, result.confidence) == ("livelock", "high"), result
    said = [line for line in result.evidence + result.competing if "same" in line or "identical" in line]
    assert len(said) == 1, said


ADMITTED_ONLY = """\
2026-12-03 08:48:59,520 - INFO - Starting httpd at 127.0.0.1 on port 8082...
127.0.0.1 - - [03/Dec/2026 08:49:05] "POST /v1/chat/completions HTTP/1.1" 200 -
2026-12-03 08:49:05,520 - INFO - Prompt processing progress: 29/29
127.0.0.1 - - [03/Dec/2026 08:49:09] "POST /v1/chat/completions HTTP/1.1" 200 -
"""


def test_an_admission_line_is_never_named_a_completion():
    """Measured: a bundle's 'last completion' named a 'POST ... 200' line, which mlx-lm logs when
    it admits a request. Admissions are called admissions; a completion is named only from a line
    mlx-lm writes after answering (DEBUG 'Outgoing Response:', without the body), else none is known."""
    markers = scan(since_last_start(ADMITTED_ONLY))
    assert markers.last_completion is None
    assert markers.last_admission and "POST /v1/chat/completions" in markers.last_admission
    assert markers.admission_count == 2
    manifest = {"classification": classify(Evidence(**PROBE_FAILED, snapshots=SAME, process_cpu=0.0)).to_dict(),
                "target": {"pid": 1}, "created_at": "t", "host": "h", "steps": []}
    summary = render_summary(manifest, [], markers.to_dict())
    completion = [line for line in summary.splitlines() if "last completion" in line]
    assert completion and all("POST" not in line for line in completion), completion
    assert "none known" in completion[0]
    answered = scan(ADMITTED_ONLY + '2026-12-03 08:49:10,000 - DEBUG - Outgoing Response: {"id": "secret text"}\n')
    assert answered.last_completion == "2026-12-03 08:49:10,000 - DEBUG - Outgoing Response:"


def test_log_window_counts_other_prompts_progress_only():
    """Progress = another prompt's X growing; the probes' own prompt (its Y from their
    keepalives), a repeated last chunk and admission lines are not progress."""
    probe_only = ('127.0.0.1 - - [05/Jul/2026 08:19:41] "POST /v1/chat/completions HTTP/1.1" 200 -\n'
                  "2026-07-05 08:19:41,000 - INFO - Prompt processing progress: 29/29\n") * 3
    window = collector.log_window({29: 29}, probe_only, probe_totals={29})
    assert window.advances == [] and window.admissions == 3
    repeated = collector.log_window({25660: 25660}, "Prompt processing progress: 25660/25660\n", probe_totals=set())
    assert repeated.advances == []
    prefill = collector.log_window({25660: 2048}, "Prompt processing progress: 4096/25660\n"
                                                  "Prompt processing progress: 6144/25660\n", probe_totals={29})
    assert prefill.advances == [(4096, 25660), (6144, 25660)]
    restarted = collector.log_window({100: 100}, "x Starting httpd at 127.0.0.1 on port 8082...\n"
                                                 "Prompt processing progress: 100/100\n", probe_totals=set())
    assert restarted.advances == [(100, 100)]


def test_log_window_reads_progress_by_the_watchers_rule():
    """Capture's window and the watcher read progress by one rule (serverlog.markers.prompt_advances): a prompt
    that advanced before the server restarted within the window advanced all the same, and the
    new process's prompts start over."""
    gained = ("Prompt processing progress: 4096/25660\n"
              "x Starting httpd at 127.0.0.1 on port 8082...\n"
              "Prompt processing progress: 100/100\n")
    window = collector.log_window({25660: 2048}, gained, probe_totals=set())
    assert window.advances == [(4096, 25660), (100, 100)]
    assert window.advances == prompt_advances(gained.splitlines(), {25660: 2048}, set())[0]


VERDICT = "2 failed probes: no token delivered within the first-token timeout: 45s passed (headers received)"


@pytest.mark.parametrize("fields, kind", [
    ({**PROBE_FAILED, "snapshots": SAME, "process_cpu": 98.0, "log_progress_advanced": True}, "busy"),
    ({"probe_ran": True, "probe_ok": True, "probe_tokens": 4, "snapshots": SAME}, "healthy"),
])
def test_evidence_contradicting_the_verdict_says_so(fields, kind):
    """A verdict was filed (and acted on) but the capture saw 'not hung': the classification
    says so explicitly, lowers its confidence, and summary.md says it in its first lines."""
    result = classify(Evidence(**fields, verdict=VERDICT))
    assert result.kind == kind
    assert result.to_dict()["contradicts_verdict"] is True
    assert result.competing[0].startswith(f"the watchdog judged this server hung ({VERDICT}); the capture saw {kind}: ")
    assert result.confidence == {"busy": "low", "healthy": "medium"}[kind]
    manifest = {"classification": result.to_dict(), "verdict": VERDICT, "target": {"pid": 1}, "created_at": "t",
                "host": "h", "steps": []}
    first = render_summary(manifest, [], None).splitlines()[:4]
    assert any(f"The watchdog judged this server hung ({VERDICT}); the capture saw {kind}" in line for line in first)


def test_agreeing_evidence_or_no_verdict_is_no_contradiction():
    """A livelock after a verdict agrees with it; a manual capture has no verdict to contradict."""
    agreeing = classify(Evidence(**PROBE_FAILED, snapshots=MOVING, process_cpu=98.0, verdict=VERDICT))
    assert agreeing.kind == "livelock" and agreeing.to_dict()["contradicts_verdict"] is False
    manual = classify(Evidence(probe_ran=True, probe_ok=True, probe_tokens=4, snapshots=SAME))
    assert manual.to_dict()["contradicts_verdict"] is False and manual.confidence == "high"


def test_redacted_export_cuts_the_verdict_details(tmp_path):
    """The verdict can quote a server body: the redacted export keeps its failure phrase only."""
    verdict = '2 failed probes: HTTP error: HTTP 500: {"error": "my diary says hello"}'
    manifest = {"classification": {"competing": [f"the watchdog judged this server hung ({verdict})"]},
                "target": {}, "verdict": verdict}
    bundle = BundleWriter(tmp_path, "b").finish(manifest, f"# x\n\n**The watchdog judged this server hung ({verdict})**\n")
    with tarfile.open(export_bundle(bundle, redact=True)) as tar:
        data = b"".join(tar.extractfile(m).read() for m in tar.getmembers())
    assert b"diary" not in data and b"2 failed probes: HTTP error [details redacted]" in data


@pytest.mark.parametrize(("free", "floor", "says"), [
    (int(1.53 * 1024**2), 2_000_000, "1.53 MiB free, below capture.min_free_bytes (1.91 MiB)"),
    (1_999_999, 2_000_000, "1,999,999 bytes free, below capture.min_free_bytes (2,000,000 bytes)"),
    (300 * 1024**2, 400 * 1024**2, "300 MiB free, below capture.min_free_bytes (400 MiB)"),
])
def test_low_disk_message_shows_the_difference(tmp_path, free, floor, says):
    """Measured: 1.53 MiB free under a 2 MB floor printed '2 MiB free, below … (2 MiB)'. The
    figures now differ whenever the amounts do."""
    with pytest.raises(LowDiskSpace) as refused:
        BundleWriter(tmp_path / "b", "a", floor, free_space=lambda path: free)
    assert says in str(refused.value)


def test_redacted_export_cuts_quoted_marker_lines(tmp_path):
    """The summary and the classification quote marker lines: the redacted export cuts those
    quotes by the log files' line rule, with or without log-markers.json in the bundle (without
    it every ``log: …`` quote is cut whole); a kept shape (a traceback's exception line) stays."""
    oom = "[METAL] Insufficient Memory while serving alice prompt: my diary says hello"
    kept = "RuntimeError: generation thread died"
    markers = {"insufficient_memory": [oom], "last_traceback": ["Traceback (most recent call last):", kept,
                                                                 "note: my diary again"]}
    summary = render_summary({"classification": {"kind": "crashed", "confidence": "high", "evidence": [f"log: {oom}"]},
                              "target": {"pid": 1}, "created_at": "t", "host": "h", "steps": []}, [], markers)
    assert "my diary says hello" in summary and "my diary again" in summary
    for name, with_markers in (("a", True), ("b", False)):
        writer = BundleWriter(tmp_path, name)
        if with_markers:
            writer.write_json("log-markers.json", markers)
        bundle = writer.finish({"classification": {"evidence": [f"log: {oom} (Metal aborts)"]}, "target": {}}, summary)
        with tarfile.open(export_bundle(bundle, redact=True)) as tar:
            files = {m.name.split("/", 1)[1]: tar.extractfile(m).read().decode() for m in tar.getmembers()}
        assert [n for n, text in files.items() if "diary" in text] == []
        assert f"- insufficient memory: `[redacted {len(oom)} chars]`" in files["summary.md"]
        assert kept in files["summary.md"]


# --- capture_bundle offline: a real (sleeping) process, fake py-spy output, a fake probe


def _spy_json(pid_thread: int = 4242) -> bytes:
    return json.dumps([
        {"thread_name": "MainThread", "os_thread_id": 1, "active": False, "owns_gil": False,
         "frames": [{"name": "serve_forever", "filename": "socketserver.py", "line": 233}]},
        {"thread_name": "Thread-1 (_generate)", "os_thread_id": pid_thread, "active": True, "owns_gil": False,
         "frames": [{"name": "next", "filename": "/x/mlx_lm/generate.py", "line": 1415},
                    {"name": "_generate", "filename": "/x/mlx_lm/server.py", "line": 853}]},
    ]).encode()


async def _fake_runner(argv, timeout):
    out = _spy_json() if "--json" in argv else b"Thread 4242 (active): \"Thread-1 (_generate)\"\n"
    return CommandResult(list(argv), 0, out, b"", 0.01)


class _FakeProbe:
    """Stands in for run_check (with the ``linger`` parameter another change adds): appends what
    a retrying client and the probe itself make mlx-lm log, and leaves a lingering drain."""

    def __init__(self, log: Path, healthy: bool) -> None:
        self.log, self.healthy = log, healthy
        self.calls: list[dict] = []
        self.client = None
        self.release = asyncio.Event()

    async def __call__(self, client, url, *, first_token_timeout, timeout, endpoint_timeout, linger=0.0):
        from mlxwatch.probes import CheckReport, EndpointResult, GenerationProbeResult
        from mlxwatch.probes.generation import Keepalive

        self.calls.append({"first_token_timeout": first_token_timeout, "linger": linger})
        self.client = client
        post = '127.0.0.1 - - [05/Jul/2026 08:19:41] "POST /v1/chat/completions HTTP/1.1" 200 -\n'
        with open(self.log, "a") as fh:  # the probe's own admission, 5 retries of another client,
            fh.write(post * 6 + "Prompt processing progress: 29/29\n")  # the probe's own prompt
            fh.write(DISCONNECT_LOG.split("----------------------------------------\n")[2])  # a client gave up
        gen = GenerationProbeResult(url, time.time(), ok=self.healthy, status=200,
                                    tokens=4 if self.healthy else 0, keepalives=[Keepalive(0.1, 29, 29)])
        if not self.healthy:
            gen.failure, gen.detail = "no_first_token", f"{first_token_timeout:g}s passed (headers received)"
        class Report(CheckReport):
            lingering = None  # a plain attribute here, whatever CheckReport makes of it

        report = Report(url, gen, EndpointResult("/health", 200, "ok"), EndpointResult("/v1/models", 200, "{}"))
        report.lingering = None if self.healthy else asyncio.ensure_future(self.release.wait())
        return report


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


@pytest.fixture
def offline(tmp_path, monkeypatch, sleeper):
    """A capture request against a sleeping process, with fake py-spy and a fake probe; every
    blocking function the capture uses records whether it ran on the event loop's thread."""
    import mlxwatch.probes

    log = tmp_path / "server.log"
    log.write_text("2026-07-05 08:19:00,000 - INFO - Starting httpd at 127.0.0.1 on port 8082...\n"
                   "Traceback (most recent call last):\n"
                   '  File "/x/mlx_lm/server.py", line 1266, in handle_completion\nValueError: an older real error\n')
    on_loop: list[str] = []
    loop_thread = threading.get_ident()

    def watch(owner, name):
        original = getattr(owner, name, None)
        if original is None:
            return

        def wrapper(*args, **kwargs):
            if threading.get_ident() == loop_thread:
                on_loop.append(name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in [(collector, "describe_process"), (collector, "read_recent"), (collector, "scan"),
                        (collector, "server_versions"), (collector, "prune"), (collector, "_read_range"),
                        (procstats, "_sample"), (BundleWriter, "write"), (BundleWriter, "finish"),
                        (BundleWriter, "__init__")]:
        watch(owner, name)
    monkeypatch.setattr(pyspy, "find_py_spy", lambda: "py-spy")
    kernel = KernelShows(streams=1)  # someone else's stream on the server's port: quiet unless told
    monkeypatch.setattr(delivery, "KernelCounters", lambda: KernelCounters(kernel, max_age=0.0))

    def make(healthy=False, delivering=False, **kw):
        kernel.flowing = delivering
        probe = _FakeProbe(log, healthy)
        monkeypatch.setattr(mlxwatch.probes, "run_check", probe)
        req = CaptureRequest(pid=sleeper, out_dir=tmp_path / "bundles", url="http://127.0.0.1:9", log=log,
                             label="offline", snapshots=3, spacing=0.2, probe_first_token_timeout=30.0, **kw)
        return req, probe

    return make, on_loop


async def test_capture_does_not_block_the_event_loop(offline):
    """psutil reads, log reads and scans, bundle writes, versions and pruning all run in worker
    threads: the capture shares the daemon's loop with other instances' probes."""
    make, on_loop = offline
    req, probe = make()
    bundle = await capture_bundle(req, runner=_fake_runner)
    _end_drain(bundle)
    assert on_loop == []
    steps = {s["name"]: s["outcome"] for s in bundle.manifest["steps"]}
    assert steps["process"] == steps["cpu"] == steps["stacks"] == steps["log"] == steps["versions"] == "ok", steps


async def test_a_capture_adopts_the_partial_a_killed_capture_left(offline):
    """Found by a new user: after `kill -9` of `mlxwatch capture`, its hidden `.…partial` stayed,
    `bundle list` said "no bundles", and later captures left it there (only a daemon's start
    adopted it). Now each capture adopts such partials as `<name>-incomplete`."""
    make, _ = offline
    req, _ = make()
    killed = BundleWriter(req.out_dir, "killed")
    killed.write("stacks/pyspy-1.txt", "stack")
    as_if_written_by(killed, dead_pid(), time.time() - 10)
    bundle = await capture_bundle(req, runner=_fake_runner)
    _end_drain(bundle)
    assert not killed.partial.exists()
    assert (req.out_dir / f"{killed.name}-incomplete" / "stacks/pyspy-1.txt").read_text() == "stack"


def _end_drain(bundle) -> None:
    if getattr(bundle, "lingering", None) is not None:
        bundle.lingering.cancel()


async def test_capture_probe_gives_up_with_the_window_and_hands_back_its_drain(offline):
    """The capture's probe waits for a first token about as long as the stack/CPU window, not
    its full limit; its lingering drain is not waited for but handed back, and cancelling it
    closes the probe's client."""
    make, _ = offline
    req, probe = make()
    bundle = await capture_bundle(req, runner=_fake_runner)
    assert probe.calls[0]["first_token_timeout"] <= collector.PROBE_FLOOR < req.probe_first_token_timeout
    assert probe.calls[0]["linger"] == req.probe_linger > 0
    assert bundle.lingering is not None and not bundle.lingering.done()
    assert not probe.client.is_closed
    bundle.lingering.cancel()
    await asyncio.gather(bundle.lingering, return_exceptions=True)
    assert probe.client.is_closed
    assert bundle.manifest["settings"]["probe_first_token_timeout"] == probe.calls[0]["first_token_timeout"]


async def test_capture_admissions_and_disconnects_are_not_evidence(offline):
    """During the window another client was admitted 5 times and a client disconnected: the
    bundle is not 'busy', says 5 admissions, and keeps the older real traceback."""
    make, _ = offline
    req, _ = make()
    bundle = await capture_bundle(req, runner=_fake_runner)
    _end_drain(bundle)
    c = bundle.classification
    assert c.kind == "blocked", c  # 0% CPU (a sleeping process), the same stack each time
    assert any("5 other request(s) admitted" in line for line in c.evidence), c
    assert bundle.manifest["log_window"] == {"prompt_progress_advances": 0, "last_advance": None, "admissions": 6}
    markers = json.loads((bundle.path / "log-markers.json").read_text())
    assert markers["last_traceback"][-1] == "ValueError: an older real error"
    assert markers["client_disconnects"] == 1


async def test_step_runner_keeps_the_others_when_one_raises_or_overruns():
    """One step raising and one still running at the ceiling cost the others nothing: each step
    is recorded (in the order they started) with its outcome, and the ones that did not finish
    hand back their unfinished result."""
    steps = StepRunner(deadline=time.monotonic() + 1.0, ceiling=3.0)

    async def answers():
        return VersionsResult(versions={"mlx-lm": "0.32.0"})

    async def raises():
        raise RuntimeError("the tool broke")

    async def overruns():
        await asyncio.Event().wait()

    slow, broken, fine = await asyncio.gather(steps.run("slow", overruns, VersionsResult),
                                              steps.run("broken", raises, VersionsResult),
                                              steps.run("fine", answers, VersionsResult))
    assert fine.versions == {"mlx-lm": "0.32.0"}
    assert slow == broken == VersionsResult()
    records = [(r.name, r.outcome, r.error) for r in steps.records()]
    assert records == [("slow", "stopped at ceiling", "the 3s capture ceiling was reached"),
                       ("broken", "failed", "RuntimeError: the tool broke"), ("fine", "ok", None)]


async def test_a_failed_step_leaves_the_others_results_in_the_bundle(offline, monkeypatch):
    """The versions step raises: it is recorded failed with its error; the other steps' files and
    results are in the bundle, and the classification reads them."""
    make, _ = offline
    req, _ = make()

    def broken(*args, **kwargs):
        raise RuntimeError("importlib.metadata went away")

    monkeypatch.setattr(collector, "server_versions", broken)
    bundle = await capture_bundle(req, runner=_fake_runner)
    _end_drain(bundle)
    steps = {s["name"]: s for s in bundle.manifest["steps"]}
    assert (steps["versions"]["outcome"], steps["versions"]["error"]) == ("failed", "RuntimeError: importlib.metadata went away")
    assert {n: s["outcome"] for n, s in steps.items() if n != "versions"} == {
        "process": "ok", "stacks": "ok", "cpu": "ok", "probe": "ok", "heartbeat": "skipped", "kernel": "ok",
        "sample": "skipped", "spindump": "skipped", "crash_reports": "skipped", "requests": "skipped", "log": "ok"}
    for name in ("process.json", "procstats.json", "stacks/pyspy-3.json", "probe.json", "log-tail.txt"):
        assert (bundle.path / name).is_file(), name
    assert not (bundle.path / "versions.json").exists() and bundle.manifest["versions"] == {}
    assert bundle.classification.kind == "blocked", bundle.classification


async def test_a_step_past_the_ceiling_is_cut_and_the_bundle_holds_the_rest(offline, monkeypatch):
    """The capture's probe never answers: at the ceiling it is stopped and recorded so; the steps
    that finished keep their files and results, and the bundle is written within the ceiling."""
    make, _ = offline
    req, _ = make(ceiling=5.0)

    async def never(*args, **kwargs):
        await asyncio.Event().wait()

    monkeypatch.setattr(mlxwatch.probes, "run_check", never)
    bundle = await capture_bundle(req, runner=_fake_runner)
    steps = {s["name"]: s for s in bundle.manifest["steps"]}
    assert (steps["probe"]["outcome"], steps["probe"]["error"]) == ("stopped at ceiling", "the 5s capture ceiling was reached")
    assert steps["stacks"]["outcome"] == steps["cpu"]["outcome"] == steps["log"]["outcome"] == "ok", steps
    assert steps["versions"]["outcome"] == "ok", steps
    assert not (bundle.path / "probe.json").exists()
    assert (bundle.path / "stacks/pyspy-3.json").is_file() and (bundle.path / "log-tail.txt").is_file()
    assert bundle.manifest["duration"] < req.ceiling
    assert bundle.lingering is None


async def test_capture_healthy_after_a_verdict_states_the_contradiction(offline):
    """The watchdog filed a verdict, the capture's probe got tokens: manifest and summary say so."""
    make, _ = offline
    req, _ = make(healthy=True, verdict=VERDICT)
    bundle = await capture_bundle(req, runner=_fake_runner)
    assert bundle.lingering is None
    assert bundle.classification.kind == "healthy"
    assert bundle.manifest["verdict"] == VERDICT
    assert bundle.manifest["classification"]["contradicts_verdict"] is True
    head = (bundle.path / "summary.md").read_text().splitlines()[:4]
    assert any(f"The watchdog judged this server hung ({VERDICT}); the capture saw healthy" in line for line in head)


async def test_a_capture_while_tokens_reach_other_clients_is_busy_never_blocked(offline):
    """Issue 27, measured: a slow server (1 s a batch step) streaming to its clients was
    restarted with a bundle saying `blocked, high confidence`: the same frame in every
    snapshot at 0 % CPU, as here. The capture reads what the kernel saw the server send over
    its window, as the daemon does: tokens reached another client, so the server works
    (`busy`, contradicting the verdict); the manifest and kernel.json say what was seen. With
    `kernel: off` the same capture reads stacks and CPU alone (blocked), and says nothing of
    the kernel."""
    make, _ = offline
    req, _ = make(delivering=True, verdict=VERDICT)
    bundle = await capture_bundle(req, runner=_fake_runner)
    _end_drain(bundle)
    c = bundle.classification
    assert (c.kind, c.confidence, c.contradicts_verdict) == ("busy", "medium", True), c
    assert any(line.startswith("kernel: ") and "bytes of tokens sent to clients" in line for line in c.evidence), c
    assert bundle.manifest["kernel"]["delivered"] and bundle.manifest["kernel"]["connections"] == 1
    assert json.loads((bundle.path / "kernel.json").read_text())["delivered"]

    req, _ = make(delivering=True, verdict=VERDICT, kernel=False)
    bundle = await capture_bundle(req, runner=_fake_runner)
    _end_drain(bundle)
    assert bundle.classification.kind == "blocked" and bundle.manifest["kernel"] is None
    assert {s["name"]: s["outcome"] for s in bundle.manifest["steps"]}["kernel"] == "skipped"
