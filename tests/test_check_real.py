"""`mlxwatch check` against the real mlx_lm.server, healthy and under each fault shape.

Runs once per mlx-lm version in MLXWATCH_SERVER_PYTHONS (0.31.3 and the newest 0.32.x in CI).
The CLI runs as a subprocess, as a cron job or CI step would run it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest

FIRST, TOTAL = 3.0, 6.0
SLACK = 1.0  # the bound: a check ends within its timeout plus one second


def check(url: str, *extra: str) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mlxwatch", "check", url, "--timeout", str(TOTAL),
         "--first-token-timeout", str(FIRST), "--json", *extra],
        capture_output=True, text=True, timeout=60,
    )
    elapsed = time.monotonic() - t0
    assert proc.stderr == "", proc.stderr
    return proc.returncode, json.loads(proc.stdout), elapsed


def models_status(url: str) -> int:
    return httpx.get(f"{url}/v1/models", timeout=5, trust_env=False).status_code


def test_slow_but_working_server_is_healthy(lab):
    """Each batch step delayed but output correct: still healthy (slowness is not a hang)."""
    lab.set_fault("slow", 0.3)
    code, report, _ = check(lab.url)
    assert code == 0, report["reason"]
    assert report["generation"]["ttft"] >= 0.3


@pytest.mark.parametrize("fault", ["block", "spin"])
def test_wedged_generation_exits_1_no_first_token(lab, fault):
    """Blocked or livelocked batch loop: exit 1 'no first token' in time, /v1/models still 200."""
    lab.set_fault(fault)
    code, report, elapsed = check(lab.url)
    assert code == 1
    assert report["failure"] == "no_first_token", report["reason"]
    assert report["models"]["status"] == 200
    assert models_status(lab.url) == 200
    assert elapsed < TOTAL + SLACK


def test_dead_generation_thread(lab):
    """Thread killed by the field's OOM: exit 1. 0.31.3 can only show silence; 0.32 names the death."""
    lab.set_fault("die")
    first_code, first, first_elapsed = check(lab.url)  # this probe's step raises: the thread dies
    code, report, elapsed = check(lab.url)  # a later probe, as a cron job would send
    assert first_code == 1 and code == 1
    assert models_status(lab.url) == 200
    version = lab_version(lab)
    if version >= (0, 32):
        assert report["failure"] == "thread_died", report["reason"]
        assert report["health"]["status"] == 503
    else:
        assert report["failure"] == "no_first_token", report["reason"]
        assert report["health"]["status"] == 200  # 0.31.3's /health always says ok
    assert max(first_elapsed, elapsed) < TOTAL + SLACK


def test_healthy_server_exits_0_and_probes_keep_one_prompt_cache_entry(lab):
    """A working server: exit 0, tokens delivered, TTFT and total recorded. Probes reuse one
    fixed prompt: repeated probes add no cache entries and evict nothing. (One series of
    checks: both were checked on the same healthy server.)"""
    code, report, elapsed = check(lab.url)
    assert code == 0, report["reason"]
    gen = report["generation"]
    assert gen["ok"] and gen["tokens"] >= 1 and gen["ttft"] is not None
    assert report["health"]["status"] == 200 and report["models"]["status"] == 200
    assert elapsed < TOTAL + SLACK
    for _ in range(2):
        assert check(lab.url)[0] == 0
    before = cache_counts(lab)[-1]
    httpx.post(f"{lab.url}/v1/chat/completions", trust_env=False, timeout=30,
               json={"messages": [{"role": "user", "content": "a user's own prompt about foxes"}], "max_tokens": 3})
    for _ in range(3):
        assert check(lab.url)[0] == 0
    counts = cache_counts(lab)
    assert counts[-1] == before + 1  # the user's entry is kept; the probes added nothing
    assert counts[-3:] == [before + 1] * 3


def cache_counts(lab) -> list[int]:
    """The server logs 'Prompt Cache: N sequences' before serving each request."""
    return [int(n) for n in re.findall(r"Prompt Cache: (\d+) sequences", lab.log_path.read_text())]


def lab_version(lab) -> tuple[int, ...]:
    from lab.server import server_version

    return tuple(int(p) for p in server_version(lab.python).split(".")[:2])
