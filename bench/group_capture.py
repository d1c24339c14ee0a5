"""Group capture: what an evidence bundle of a hung 2-rank ``mlx.launch`` group costs, against
one of a single hung server, at the default capture settings, side by side in one run.

For each mlx-lm version and trial: a single lab server with its generation thread blocked
(``capture_cost.one_capture``: the fault bitten by one streaming request left in flight), and a
real 2-rank group (ring backend, loopback) with rank 1's generation thread blocked and bitten
the same way through rank 0; then ``capture_bundle`` exactly as the daemon calls it at the
default config (3 snapshots 2 s apart, ceiling 60 s), with the group found from rank 0 for the
group. Measured: the capture's wall time and its stacks step (every rank's py-spy dumps run side
by side), the bundle's size, and what it was classified as. Each group is launched fresh (the
capture leaves it hung); only one group or server runs at a time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from bench.capture_cost import _bite, _bundle_bytes, one_capture, timed_capture
from bench.common import OLD_PYTHON, TEST_PYTHON, add_record_options, fmt_mmm, log, record, run_header, summary
from lab.group import LabGroup
from lab.server import LabServer, server_version
from mlxwatch.config import CaptureConfig

SECTION = "## Capture of a group (2 ranks) against a single server"


async def group_capture(group: LabGroup, out_dir: Path) -> dict[str, Any]:
    """Rank 1 blocked, bitten through rank 0, captured as the daemon captures a group."""
    group.relaunch()
    found = group.group()
    assert found is not None, "the lab group was not found from rank 0"
    group.set_fault("block", rank=1)
    biter = await _bite(group.url)
    bundle, wall = await timed_capture(found.rank(0).pid, out_dir, "bench-group", group.url, group.log_path, biter,
                                       group=found)
    group.set_fault("", rank=1)
    steps = {s["name"]: s["duration"] for s in bundle.manifest.get("steps", [])}
    c = bundle.classification
    return {"wall_s": wall, "stacks_s": steps.get("stacks"), "bundle_bytes": _bundle_bytes(bundle.path),
            "kind": c.kind, "culprit_rank": c.culprit_rank, "confidence": c.confidence}


async def run_version(python: str, workdir: Path, trials: int) -> dict[str, Any]:
    out: dict[str, Any] = {"mlx_lm": server_version(python), "single": [], "group": []}
    server = LabServer.start(python, workdir / "server")
    try:
        for trial in range(trials):
            r = await one_capture(server, "block", workdir / "bundles-single")
            out["single"].append({"wall_s": r["wall_s"], "stacks_s": r["steps"].get("stacks", {}).get("duration"),
                                  "bundle_bytes": r["bundle_bytes"], "kind": r["kind"], "culprit_rank": None,
                                  "confidence": r["confidence"]})
            log(f"group capture {out['mlx_lm']} single trial {trial}: {r['wall_s']:.2f}s, {r['kind']}")
    finally:
        server.stop()
    group = LabGroup.start(python, workdir / "group")
    try:
        for trial in range(trials):
            r = await group_capture(group, workdir / "bundles-group")
            out["group"].append(r)
            log(f"group capture {out['mlx_lm']} group trial {trial}: {r['wall_s']:.2f}s, {r['kind']} "
                f"rank {r['culprit_rank']}")
    finally:
        group.stop()
    for kind in ("single", "group"):
        out[f"{kind}_wall"] = summary(r["wall_s"] for r in out[kind])
        out[f"{kind}_stacks"] = summary(r["stacks_s"] for r in out[kind])
        out[f"{kind}_kb"] = summary(r["bundle_bytes"] / 1024 for r in out[kind])
    out["ratio"] = out["group_wall"]["median"] / out["single_wall"]["median"]
    out["right"] = (all(r["kind"] == "blocked" for r in out["single"])
                    and all((r["kind"], r["culprit_rank"]) == ("collective_wait", 1) for r in out["group"]))
    return out


def section(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [SECTION, "",
             f"`python -m bench.group_capture` (`bench/group_capture.py`), run on {data['started_at'][:10]} from "
             f"commit {data['commit']} on {m['cpus']} cores ({m['cpu']}), load average at the start "
             f"{data['load_average'][0]}. `capture_bundle` at the default settings (3 snapshots 2 s apart, ceiling "
             f"{CaptureConfig.ceiling:g} s) on a single server with its generation thread blocked, and on a real "
             "2-rank `mlx.launch` group (ring, loopback) with rank 1's generation thread blocked, one after the "
             "other; each fault bitten by one streaming request left in flight. Seconds, median (min–max).", "",
             "| mlx-lm | target | n | capture wall time | stacks step | bundle size | classified as |",
             "|---|---|---|---|---|---|---|"]
    for v in data["versions"]:
        for kind in ("single", "group"):
            said = sorted({f"{r['kind']}" + (f" (rank {r['culprit_rank']})" if r["culprit_rank"] is not None else "")
                           for r in v[kind]})
            lines.append(f"| {v['mlx_lm']} | {'single server' if kind == 'single' else '2-rank group'} | "
                         f"{len(v[kind])} | {fmt_mmm(v[f'{kind}_wall'], 2)} | {fmt_mmm(v[f'{kind}_stacks'], 2)} | "
                         f"{fmt_mmm(v[f'{kind}_kb'], 0)} KB | {', '.join(said)} |")
    lines += ["", "Group against single (median capture wall time): " + ", ".join(
        f"{v['mlx_lm']} {v['ratio']:.2f}x" for v in data["versions"]) + ". Every rank's dumps run side by side: "
        "the second rank adds " + ", ".join(
            f"{(v['group_stacks']['median'] - v['single_stacks']['median']):.2f} s" for v in data["versions"]) +
        " to the stacks step (medians) and nothing the wall time shows, which the capture's probe, cut at the "
        "window's end, sets. The group's bundle holds every rank's stacks. A remote rank (over ssh) was not in "
        "this run.",
        "", f"Goal: the group's capture within the ceiling ({CaptureConfig.ceiling:g} s) and classified "
        "`collective_wait` naming rank 1: " + ("met." if data["pass"] else "**missed**.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(prog="python -m bench.group_capture", description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="captures per target and version (default 3)")
    parser.add_argument("--pythons", default=f"{OLD_PYTHON},{TEST_PYTHON}",
                        help="comma-separated Pythons with mlx-lm installed (default: both lab versions)")
    add_record_options(parser)
    args = parser.parse_args(argv)

    def run() -> dict[str, Any]:
        data = run_header(trials=args.trials, versions=[])
        with tempfile.TemporaryDirectory(prefix="mlxwatch-bench-groupcapture-") as tmp:
            for i, python in enumerate(p for p in args.pythons.split(",") if p):
                data["versions"].append(asyncio.run(run_version(python, Path(tmp) / str(i), args.trials)))
        data["pass"] = all(v["right"] and v["group_wall"]["max"] <= CaptureConfig.ceiling for v in data["versions"])
        return data

    return record("group_capture", args, run, SECTION, section)


if __name__ == "__main__":
    import sys

    sys.exit(main())
