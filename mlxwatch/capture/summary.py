"""``summary.md``: what a maintainer reads in one minute.

The verdict and its evidence first (and, when the watchdog judged the server hung but the
evidence says otherwise, that contradiction in the first lines), then the generation thread's
stack across snapshots, CPU over the window, the last log markers, and what could not be
captured and why. "Last completion" names only a line mlx-lm writes after answering; its
``POST ... 200`` access line is an admission and is called one.
"""

from __future__ import annotations

from typing import Any

from mlxwatch.capture.requests import summary_lines
from mlxwatch.stacks import ThreadStack, generation_thread

NO_COMPLETION = ("none known (mlx-lm logs no line when it finishes a request, except 'Outgoing Response' "
                 "at --log-level DEBUG for a non-streamed one; the launch shim's heartbeat counts tokens)")


def render_summary(manifest: dict[str, Any], snapshots: list[tuple[float, list[ThreadStack]]], markers: dict | None) -> str:
    c = manifest["classification"]
    culprit = c.get("culprit_rank")
    blame = f": rank {culprit} is not in the collective the others wait in" if culprit is not None else ""
    out = [f"# mlxwatch bundle: {c['kind']} ({c['confidence']} confidence){blame}", ""]
    verdict = manifest.get("verdict")
    if verdict and c.get("contradicts_verdict"):
        seen = (c.get("evidence") or ["?"])[0]
        out += [f"**The watchdog judged this server hung ({verdict}); the capture saw {c['kind']}: {seen}.** "
                "The evidence contradicts the verdict the restart was based on: weigh both.", ""]
    elif verdict:
        out.append(f"- watchdog verdict: hung ({verdict})")
    out += [
        f"- target: PID {manifest['target']['pid']} {manifest['target'].get('label') or ''}".rstrip(),
        f"- created: {manifest['created_at']} on {manifest['host']}",
    ]
    if manifest["target"].get("url"):
        out.append(f"- url: {manifest['target']['url']}")
    versions = manifest.get("versions") or {}
    pkgs = versions.get("packages") or {}
    if pkgs:
        out.append("- server: " + ", ".join(f"{k} {v}" for k, v in sorted(pkgs.items()) if k.startswith("mlx"))
                   + f", Python {versions.get('python') or '?'}")
    group = manifest.get("group")
    if group:
        launcher = group.get("launcher") or {}
        out.append(f"- group: mlx.launch ({group['backend']}) PID {launcher.get('pid') or '?'}, "
                   f"{len(group['ranks'])} ranks" + (f"; {group['orphaned']}" if group.get("orphaned") else ""))
        out += [f"  - rank {r['rank']} on {r['host']}: PID {r['pid'] or '-'}, {r['state']}, innermost: "
                f"{r.get('innermost') or 'no stacks'}" for r in group["ranks"]]
    out += ["", "## Why", ""] + [f"- {line}" for line in c["evidence"]]
    if c.get("competing"):
        out += ["", "Competing evidence:", ""] + [f"- {line}" for line in c["competing"]]

    out += summary_lines(manifest.get("requests"))
    out += ["", "## Generation thread across snapshots", ""]
    if not snapshots:
        out.append("No stack snapshots (see 'Not captured').")
    for i, (t, threads) in enumerate(snapshots, 1):
        gen = generation_thread(threads)
        out.append(f"Snapshot {i} at +{t:.1f}s: " + (f"`{gen.name}`" if gen else "**no generation thread**"))
        if gen:
            out.append("```")
            out += [f"    {f.where}" for f in gen.frames[:12]]
            out.append("```")
    cpu = manifest.get("cpu") or {}
    out += ["", "## CPU over the window", ""]
    out.append(f"- process: {_pct(cpu.get('process'))}; generation thread: {_pct(cpu.get('generation_thread'))}; "
               f"status: {', '.join(cpu.get('statuses') or ['?'])}")
    shim = manifest.get("shim") or {}
    if shim.get("found"):  # the launch shim's heartbeat (mlxwatch launch): counted inside the server
        out += ["", "## Launch shim heartbeat", ""]
        for when in ("start", "end"):
            hb = shim.get(when)
            if hb:
                out.append(f"- {when}: seam {hb['seam']}, thread {hb['thread']}, {hb['in_flight']} in flight, "
                           f"{hb['tokens']} tokens, {hb['steps']} steps, no token for {hb['since_last_token']}s, "
                           f"stalled {hb['stalled_for']}s, heartbeat {hb['age']}s old")
        change = shim.get("change")
        if change:
            out.append(f"- over {change['seconds']:.1f}s: {change['steps']} steps, {change['tokens']} tokens, "
                       f"{change['prompt_tokens']} prompt tokens")
    if markers:
        out += ["", "## Log markers", ""]
        if markers.get("last_prompt_progress"):
            out.append(f"- last prompt progress: `{markers['last_prompt_progress'].strip()}`")
        if markers.get("last_admission"):  # logged when the batch loop takes a request, before any token
            out.append(f"- last admission (not a completion): `{markers['last_admission'].strip()}`")
        out.append(f"- last completion: `{markers['last_completion'].strip()}`" if markers.get("last_completion")
                   else f"- last completion: {NO_COMPLETION}")
        for key in ("thread_exceptions", "metal_malloc", "insufficient_memory", "missing_parameters", "generation_thread_died"):
            for line in markers.get(key) or []:
                out.append(f"- {key.replace('_', ' ')}: `{line}`")
        if markers.get("last_traceback"):
            out += ["", "Last traceback:", "```"] + markers["last_traceback"][-15:] + ["```"]
    failed = [s for s in manifest["steps"] if s["outcome"] != "ok"]
    out += ["", "## Not captured", ""]
    out += ([f"- {s['name']}: {s['outcome']}: {s.get('error') or ''}".rstrip(": ") for s in failed]
            or ["- nothing: every step succeeded"])
    return "\n".join(out) + "\n"


def _pct(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.0f}%"
