"""Capture's pure parts: classification rules, tool command lines, log markers, bundle storage
and redaction. macOS-only tools are tested here through their command construction and on
crash reports shaped like real ones (tests/data); they cannot run on Linux CI."""

from __future__ import annotations

import json
import os
import tarfile
import time
from pathlib import Path

import pytest

from mlxwatch.capture import macos, pyspy
from mlxwatch.capture.bundle import BundleWriter, adopt_partials, list_bundles, prune
from mlxwatch.capture.classify import Evidence, classify
from mlxwatch.capture.commands import run_command
from mlxwatch.capture.export import export_bundle, redact_log
from mlxwatch.capture.procstats import redact_environment
from mlxwatch.serverlog import scan, since_last_start

DATA = Path(__file__).parent / "data"


def thread(name="Thread-1 (_generate)", frames=(("_step", 1369), ("next", 1415), ("_generate", 853))):
    return pyspy.ThreadStack(name, 101, True, False,
                             [pyspy.Frame(fn, "/x/mlx_lm/server.py", line) for fn, line in frames])


MAIN = pyspy.ThreadStack("MainThread", 100, False, False, [pyspy.Frame("serve_forever", "socketserver.py", 233)])
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
    (Evidence(**PROBE_FAILED, snapshots=MOVING, process_cpu=0.5), "blocked", "medium"),
    (Evidence(**PROBE_FAILED, snapshots=MOVING, process_cpu=98.0), "livelock", "high"),
    (Evidence(**PROBE_FAILED, snapshots=SAME, process_cpu=98.0), "livelock", "medium"),
    (Evidence(**PROBE_FAILED, snapshots=SAME, process_cpu=98.0, log_progress_advanced=True), "busy", "medium"),
    (Evidence(**PROBE_FAILED, snapshots=SAME, process_cpu=12.0), "unknown", "low"),
    (Evidence(**PROBE_FAILED, snapshots=[], stacks_error="py-spy not found", process_cpu=0.0), "blocked", "low"),
    (Evidence(snapshots=[], stacks_error="needs root", process_cpu=0.0), "unknown", "low"),
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


def test_macos_command_construction(tmp_path):
    """sample and spindump argv as documented (spindump: pid, duration, interval in ms)."""
    out = tmp_path / "s.txt"
    assert macos.sample_command(7, out) == ["sample", "7", "5", "-f", str(out)]
    assert macos.spindump_command(7, out, sudo=True) == ["sudo", "-n", "spindump", "7", "5", "10", "-o", str(out)]


@pytest.mark.parametrize("name", ["python-2026-07-05-081941.ips", "python_2026-07-05-081941_host.crash"])
def test_crash_reports_match_by_pid(name):
    """.ips (JSON header + body) and legacy .crash reports match our PID and no other."""
    text = (DATA / name).read_text()
    assert macos.crash_report_matches(text, 48213)
    assert not macos.crash_report_matches(text, 48214)


def test_recent_crash_reports_filters_by_time_and_pid(tmp_path):
    """Only reports newer than the process start and naming its PID are collected."""
    for name in ("python-2026-07-05-081941.ips", "python_2026-07-05-081941_host.crash"):
        (tmp_path / name).write_text((DATA / name).read_text())
    old = tmp_path / "python_2026-07-05-081941_host.crash"
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    found = macos.recent_crash_reports(48213, since=time.time() - 3600, dirs=(str(tmp_path),))
    assert [p.name for p in found] == ["python-2026-07-05-081941.ips"]


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
    assert markers.completion_count == 1
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


def test_partial_bundle_of_a_killed_capture_is_kept(tmp_path):
    """A partial dir left by a killed capture is renamed '-incomplete', not deleted."""
    writer = BundleWriter(tmp_path, "gemma")
    writer.write("stacks/pyspy-1.txt", "stack")
    old = time.time() - 3600
    os.utime(writer.partial, (old, old))
    adopted = adopt_partials(tmp_path)
    assert [p.name for p in adopted] == [writer.name + "-incomplete"]
    assert (adopted[0] / "stacks/pyspy-1.txt").read_text() == "stack"


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
    out = redact_log(text).splitlines()
    assert out[0].endswith("Prompt processing progress: 10/20")
    assert out[1].startswith("[redacted ") and "diary" not in out[1]
    assert out[2] == '  File "~/venv/mlx_lm/server.py", line 853, in _generate'
    assert out[3].startswith("RuntimeError: [metal::malloc]")


def test_environment_secrets_removed():
    """Secret-looking names and token-looking values are removed; the rest kept."""
    env = {"HF_TOKEN": "hf_abc", "OPENAI_API_KEY": "x", "DB_PASSWORD": "p", "MY_SECRET": "s",
           "HF_HUB_CACHE": "/cache", "SOMETHING": "hf_looks_like_a_token", "PATH": "/usr/bin"}
    out = redact_environment(env)
    assert out == {"HF_TOKEN": "[removed]", "OPENAI_API_KEY": "[removed]", "DB_PASSWORD": "[removed]",
                   "MY_SECRET": "[removed]", "HF_HUB_CACHE": "/cache", "SOMETHING": "[removed]", "PATH": "/usr/bin"}


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
