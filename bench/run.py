"""Run every benchmark of issue 7 and write ``bench/RESULTS.md`` and the raw JSON.

    .venvs/test/bin/python -m bench.run            # the full run: under 20 minutes on 2 cores
    .venvs/test/bin/python -m bench.run --quick    # every part at tiny sizes (~4 minutes), results/ only

Needs the venvs that ``scripts/test.sh`` makes (``bash bench/run.sh`` makes them if missing).
Two phases, to fit the budget without disturbing the measurements that a busy machine would
distort:

- **A, side by side** (as long as the soak): the 10-minute false-positive soak; detection and
  recovery on mlx-lm 0.31.3 and 0.32.x (one server and one daemon per version), then the
  captures on hung servers (their wall time is fixed waits); the 10 @ 30 s scale run (its CPU
  time is the daemon process's own). The timing-sensitive parts are not run here.
- **B, one at a time**: the other scale runs (1 s, 5 s, and 300 @ 30 s, whose peak RSS a busy
  machine inflates), the py-spy pause on a generating server, the probe tax.

The raw results go to ``bench/results/bench-<time>.json`` (not committed); a full run also
writes ``bench/RESULTS.json`` (the same data, committed with RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

# Only the standard library and bench.common (no mlxwatch) before the snapshot is in place.
from bench.common import (
    OLD_PYTHON,
    ROOT,
    TEST_PYTHON,
    git_commit,
    keep_other_sections,
    load_average,
    log,
    machine,
    versions,
    write_json,
)

PARTS = ("soak", "detection", "scale", "capture", "tax")
HERE = ROOT / "bench"  # results are written to the repository, whatever the code was imported from


def snapshot_and_reexec(argv: list[str]) -> None:
    """Run from a snapshot: mlxwatch/ and the test lab (tests/lab) as committed at HEAD, bench/ as it is now. Other people
    edit the working tree while a 20-minute run goes on; what is measured must not change."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    snap = Path(tempfile.mkdtemp(prefix="mlxwatch-bench-src-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", "mlxwatch", "tests/lab"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(snap)], input=archive.stdout, check=True)
    shutil.copytree(ROOT / "bench", snap / "bench", ignore=shutil.ignore_patterns("results", "__pycache__", "*.md", "*.json"))
    env = {**os.environ, "MLXWATCH_BENCH_SRC": str(snap), "MLXWATCH_BENCH_REPO": str(ROOT),
           "MLXWATCH_BENCH_COMMIT": f"{head} (HEAD, run from a snapshot of mlxwatch/)", "MLXWATCH_BENCH_SNAPSHOT": "1",
           "PYTHONPATH": str(snap)}
    os.chdir(snap)
    os.execve(sys.executable, [sys.executable, "-m", "bench.run", *argv], env)


class Lane(threading.Thread):
    """One part of a phase, in a thread; its result or its error is kept, never lost."""

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        super().__init__(name=name, daemon=True)
        self.fn, self.result, self.error, self.seconds = fn, None, None, 0.0

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            self.result = self.fn()
        except Exception as exc:  # reported in the results, never hidden
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            log(f"{self.name}: FAILED: {exc}")
        self.seconds = time.monotonic() - t0


class LoadWatch(threading.Thread):
    """The 1-minute load average every 5 s, tagged with the phase running."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.phase = "setup"
        self.samples: list[tuple[float, str, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(5.0):
            self.samples.append((time.time(), self.phase, load_average()[0]))

    def by_phase(self) -> dict[str, dict[str, float]]:
        out: dict[str, list[float]] = {}
        for _, phase, value in self.samples:
            out.setdefault(phase, []).append(value)
        return {k: {"min": min(v), "median": sorted(v)[len(v) // 2], "max": max(v)} for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check that every part runs")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (servers' logs, bundles)")
    parser.add_argument("--soak", type=float, help="soak seconds (default 600; --quick 60)")
    parser.add_argument("--only", help=f"comma-separated parts to run ({','.join(PARTS)}); a full run's "
                        "RESULTS.json is then updated with them (the report says which parts were rerun, when)")
    parser.add_argument("--note", action="append", default=[],
                        help="a line for the report's header (what else ran on the machine, say)")
    parser.add_argument("--render-only", action="store_true",
                        help="measure nothing: render RESULTS.md again from RESULTS.json (with any --note added)")
    parser.add_argument("--worktree", action="store_true",
                        help="measure mlxwatch/ as it is in the working tree (default: as committed at HEAD)")
    args = parser.parse_args(argv)
    if args.render_only:
        from bench import report
        data = json.loads((HERE / "RESULTS.json").read_text())
        data["notes"] = [*data.get("notes", []), *args.note]
        write_json(HERE / "RESULTS.json", data)
        md_path = HERE / "RESULTS.md"
        md_path.write_text(keep_other_sections(md_path.read_text() if md_path.exists() else "", report.render(data)))
        log(f"bench: {HERE / 'RESULTS.md'} rendered again from RESULTS.json")
        return 0
    if not args.worktree and not os.environ.get("MLXWATCH_BENCH_SRC"):
        snapshot_and_reexec(sys.argv[1:] if argv is None else argv)
    from bench import analysis, capture_cost, detection, report, scale, soak, tax
    for py in (TEST_PYTHON, OLD_PYTHON):
        if not py.exists():
            print(f"missing {py}: run `bash scripts/test.sh` (or `bash bench/run.sh`) first", file=sys.stderr)
            return 2
    quick = args.quick
    parts = set(args.only.split(",")) if args.only else set(PARTS)
    if parts - set(PARTS):
        print(f"--only: unknown part(s) {', '.join(sorted(parts - set(PARTS)))} (parts: {', '.join(PARTS)})", file=sys.stderr)
        return 2
    soak_s = args.soak or (60.0 if quick else 600.0)
    det_trials = 1 if quick else 10
    cap_reps = 1 if quick else 2
    tax_reps = 1 if quick else 3
    pythons = {"mlx-lm-0.31": str(OLD_PYTHON), "mlx-lm-0.32": str(TEST_PYTHON)}
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="mlxwatch-bench-"))
    log(f"bench: work directory {work}; {'quick' if quick else 'full'} run of {', '.join(p for p in PARTS if p in parts)}")
    results: dict[str, Any] = {
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "quick": quick,
        "machine": machine(), "versions": versions(), "mlxwatch_commit": git_commit(),
        "command": "python -m bench.run" + (" --quick" if quick else ""), "errors": {}, "phases": {},
        "mlxwatch_imported_from": str(Path(__import__("mlxwatch").__file__).parent), "notes": list(args.note),
    }
    watch = LoadWatch()
    watch.start()
    runs = scale.QUICK_RUNS if quick else scale.RUNS
    # Phase A takes the runs whose numbers a busy machine does not move: CPU time at 30 s.
    slow_scale = [r for r in runs if r.get("phase") == "A"] if "scale" in parts else []
    fast_scale = [r for r in runs if r.get("phase") != "A"] if "scale" in parts else []
    try:
        # --- phase A: side by side
        watch.phase = "A"
        t0 = time.monotonic()
        lanes = {}
        if "soak" in parts:
            lanes["soak"] = Lane("soak", lambda: soak.run(str(TEST_PYTHON), work / "soak", soak_s))
        if "detection" in parts or "capture" in parts:
            # Detection, then the captures on hung servers (their wall time is fixed waits: the
            # stack window and the probe's limit); the py-spy pause is measured in phase B.
            def detect_then_capture() -> dict[str, Any]:
                out: dict[str, Any] = {}
                if "detection" in parts:
                    try:
                        out["detection"] = detection.run(work, det_trials, pythons)
                    except Exception as exc:
                        out["detection_error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                if "capture" in parts:
                    out["captures"] = capture_cost.run(work / "capture", pythons, cap_reps, pause=False)
                return out
            lanes["detection"] = Lane("detection+captures", detect_then_capture)
        if slow_scale:
            lanes["scale-30s"] = Lane("scale-30s", lambda: [
                scale.run_one(r["instances"], r["interval"], r["window"],
                              work / f"scale-{r['instances']}x{r['interval']:g}s", r.get("target")) for r in slow_scale])
        for lane in lanes.values():
            lane.start()
        for lane in lanes.values():
            lane.join()
            if lane.error:
                results["errors"][lane.name] = lane.error
        results["phases"]["A"] = {"seconds": round(time.monotonic() - t0, 1),
                                  "lanes": {n: round(l.seconds, 1) for n, l in lanes.items()}}
        if "soak" in lanes:
            results["soak"] = lanes["soak"].result
        dc = (lanes["detection"].result or {}) if "detection" in lanes else {}
        if "detection" in parts:
            results["detection"] = dc.get("detection")
            if dc.get("detection_error"):
                results["errors"]["detection"] = dc["detection_error"]
        scale_results = list(lanes["scale-30s"].result or []) if "scale-30s" in lanes else []

        # --- phase B: one at a time
        watch.phase = "B"
        t0 = time.monotonic()
        for r in fast_scale:
            lane = Lane(f"scale {r['instances']}@{r['interval']:g}", lambda r=r: scale.run_one(
                r["instances"], r["interval"], r["window"], work / f"scale-{r['instances']}x{r['interval']:g}s",
                r.get("target")))
            lane.run()
            if lane.error:
                results["errors"][lane.name] = lane.error
            else:
                scale_results.append(lane.result)
                res = lane.result
                log(f"scale {res['instances']} @ {res['interval_s']:g}s: cpu {res['daemon_cpu_pct']:.2f}%, "
                    f"rss {res['rss_mb_max']} MB, p99 gap {res['gaps']['p99_s']:.3f}s")
        if "scale" in parts:
            order = {(r["instances"], r["interval"]): i for i, r in enumerate(runs)}
            results["scale"] = sorted(scale_results, key=lambda r: order.get((r["instances"], r["interval_s"]), 99))
        if "capture" in parts:
            lane = Lane("capture-pause", lambda: capture_cost.run(work / "pause", pythons, cap_reps, captures=False))
            lane.run()
            results["capture"] = capture_cost.merge(dc.get("captures"), lane.result)
            if lane.error:
                results["errors"]["capture"] = lane.error
        if "tax" in parts:
            lane = Lane("tax", lambda: tax.run(str(TEST_PYTHON), work / "tax", tax_reps))
            lane.run()
            results["tax"] = lane.result
            if lane.error:
                results["errors"]["tax"] = lane.error
        results["phases"]["B"] = {"seconds": round(time.monotonic() - t0, 1)}
    finally:
        watch.stop.set()
        results["load_average"] = watch.by_phase()
        results["total_seconds"] = round(time.time() - started, 1)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if os.environ.get("MLXWATCH_BENCH_SNAPSHOT"):
                shutil.rmtree(os.environ["MLXWATCH_BENCH_SRC"], ignore_errors=True)

    if args.only and not quick:
        # A rerun of some parts: merged into the committed run, and said so in the report.
        try:
            base = json.loads((HERE / "RESULTS.json").read_text())
        except (OSError, ValueError):
            base = None
        if base is not None:
            for part in parts:
                if part in results:
                    base[part] = results[part]
            base.setdefault("reruns", []).append({
                "parts": sorted(parts), "at": results["started_at"], "commit": results["mlxwatch_commit"],
                "minutes": round(results["total_seconds"] / 60, 1), "load_average": results["load_average"],
                "errors": sorted(results["errors"])})
            base["errors"] = {k: v for k, v in base.get("errors", {}).items()
                              if not any(k.startswith(p) for p in parts)} | results["errors"]
            results = base

    # --- analysis and report
    try:
        if results.get("capture"):
            results["capture_tables"] = capture_cost.tables(results["capture"])
        if results.get("detection"):
            results["detection_tables"] = analysis.detection_tables(results["detection"], results.get("capture"))
        results["targets"] = analysis.targets(results)
    except Exception as exc:
        results["errors"]["analysis"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    raw = write_json(HERE / "results" / f"bench-{stamp}{'-quick' if quick else ''}.json", results)
    md = report.render(results)
    if quick:
        md_path = HERE / "results" / f"RESULTS-{stamp}-quick.md"
    else:
        md_path = HERE / "RESULTS.md"
        write_json(HERE / "RESULTS.json", results)
        md = keep_other_sections(md_path.read_text() if md_path.exists() else "", md)
    md_path.write_text(md)
    log(f"bench: done in {results['total_seconds'] / 60:.1f} min; raw {raw}; report {md_path}")
    for t in results.get("targets", []):
        log(f"  {'MET ' if t['met'] else 'MISS'} {t['target']}: {t['measured']}")
    if results["errors"]:
        log(f"bench: errors in {', '.join(results['errors'])} (see the JSON)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
