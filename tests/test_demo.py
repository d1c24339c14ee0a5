"""The README's main command, `mlxwatch demo`, end to end: it must detect, capture, restart and
recover, and leave no server running."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest


@pytest.mark.real_server
def test_demo_runs_the_whole_job_and_cleans_up(tmp_path):
    """Exit 0; the livelock is classified from its bundle; the server it started is gone. Its
    directory (made in $TMPDIR) is the test's, so the run leaves no /tmp/mlxwatch-demo-*."""
    pytest.importorskip("mlx_lm")
    proc = subprocess.run([sys.executable, "-m", "mlxwatch", "demo"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "classification: livelock" in out
    assert re.search(r"Recovered [\d.]+s after the livelock was switched on", out)
    bundle = Path(re.search(r"bundle:\s+(\S+)", out).group(1))
    assert (bundle / "manifest.json").exists() and (bundle / "summary.md").exists()
    workdir = bundle.parents[2]
    assert workdir.parent == tmp_path and workdir.name.startswith("mlxwatch-demo-")
    assert not (workdir / "server").exists()  # model and server dir removed
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(workdir) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == []
