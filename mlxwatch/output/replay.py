"""``mlxwatch replay``: what was sent where, each ``--shrink`` trial as it ends, and the result."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console

from mlxwatch.replay.run import Plan, ReplayReport, describe
from mlxwatch.replay.shrink import Shrunk, Trial


def _say(console: Console, text: str) -> None:
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def render_start(err: Console, plan: Plan, to: str | None, *, shrinking: bool) -> None:
    where = to if to else "a server started from the recorded command line"
    what = "shrinking" if shrinking else "replaying"
    _say(err, f"replay: {what} {len(plan.requests)} recorded request(s) of {plan.bundle.name} on {where}")


def render_trial(err: Console, trial: Trial, kept: int) -> None:
    seqs = " ".join(f"#{s}" for s in trial.kept[:12]) + (" ..." if len(trial.kept) > 12 else "")
    result = "hung" + (f" after #{trial.after_seq}" if trial.after_seq is not None else "") if trial.hung \
        else "no hang"
    _say(err, f"replay: trial {trial.number} ({trial.note}): {kept} request(s) [{seqs}]: {result} ({trial.seconds:g}s)")


def render_outcome(out: Console, report: ReplayReport, total: int) -> None:
    o = report.outcome
    if not o.hung:
        _say(out, f"not reproduced: {o.sent} request(s) sent in {o.rounds} round(s) to {report.url}; "
                  "delivery never stopped (the daemon's rules)")
        return
    after = f"after request #{o.after_seq}" if o.after_seq is not None else "before the first request was answered"
    _say(out, f"hang reproduced {after} ({o.sent} of {total * o.rounds} sent, round {o.rounds}), "
              f"{o.verdict_after_s:g}s after the round's first request; nothing delivered for {o.quiet_s:g}s")
    if o.in_flight:
        _say(out, "  in flight: " + " ".join(f"#{s}" for s in o.in_flight))
    _say(out, f"  verdict: {o.reason}")
    if report.bundle is not None:
        _say(out, f"  shape: {report.kind} ({report.confidence} confidence); bundle: {report.bundle}")
    elif report.capture_error:
        _say(out, f"  no bundle: the capture failed: {report.capture_error}")


def render_shrunk(out: Console, found: Shrunk, final: ReplayReport | None, *, as_json: bool) -> None:
    if as_json:
        _say(out, json.dumps(_shrunk_json(found, final), indent=2, default=str))
        return
    if not found.reproduced:
        _say(out, "not reproduced: the whole sequence did not hang a fresh server; nothing to shrink")
        return
    cut = f" (stopped early: {found.exhausted})" if found.exhausted else ""
    _say(out, f"smallest sequence: {len(found.requests)} request(s), {len(found.trials)} trial(s) in "
              f"{found.seconds:g}s{cut}:")
    for req in found.requests:
        d = describe(req)
        prompt = f"prompt {d['prompt_chars']} chars" if "prompt_chars" in d else f"{d.get('body_bytes')} bytes"
        _say(out, f"  #{d['seq']} at +{d['t']:.2f}s {d['method']} {d['target']}: {prompt}, "
                  f"stream {str(d.get('stream')).lower()}, max_tokens {d.get('max_tokens')}")
    if final is None:
        return
    if final.outcome.hung and final.bundle is not None:
        _say(out, f"written: {final.bundle} (hung again: {final.kind}); `mlxwatch replay {final.bundle} --launch`")
    elif final.outcome.hung:
        _say(out, f"hung again, but no bundle: {final.capture_error}")
    else:
        _say(out, "the smallest sequence did not hang the final run: the trigger is not deterministic")


def _shrunk_json(found: Shrunk, final: ReplayReport | None) -> dict[str, Any]:
    return {"reproduced": found.reproduced and (final is None or final.outcome.hung),
            "requests": [describe(r) for r in found.requests],
            "trials": [vars(t) for t in found.trials], "seconds": found.seconds, "exhausted": found.exhausted,
            "bundle": str(final.bundle) if final is not None and final.bundle else None,
            "kind": final.kind if final is not None else None}
