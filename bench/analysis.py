"""From the raw measurements to the numbers in RESULTS.md: the detection tables, the defaults'
and the cron's computed distributions, the ratios, and the targets."""

from __future__ import annotations

from typing import Any

from bench import model
from bench.common import summary
from bench.detection import FAST
from mlxwatch.config import ProbeConfig

DEFAULTS = ProbeConfig()
CRON_PERIOD = 300.0  # what people deploy: every 5 minutes ...
CRON_TIMEOUT = 45.0  # ... a 4-token request with a fixed timeout (the same 45 s mlxwatch gives a first token)
COLUMNS = ("verdict_s", "bundle_s", "restart_s", "recovery_s", "total_s")


def _probe_duration(reason: str, first_token_timeout: float, timeout: float, fast: float) -> float:
    """How long a failed probe took, from how it failed: a deadline, or a fast failure."""
    r = reason or ""
    if "first-token timeout" in r:
        return first_token_timeout
    if "stalled" in r or "timeout" in r:
        return timeout
    return fast


def cron_failure_time(trial: dict[str, Any]) -> tuple[float, str]:
    """How long the cron workaround's request takes to fail on this fault (``CRON_TIMEOUT`` if it
    hangs: no answer until the server was taken away by the restart, or none at all)."""
    c = trial["cron_request"]
    elapsed = c.get("elapsed")
    restarting = c.get("restarting_at_s")
    if c.get("ok"):
        return CRON_PERIOD + CRON_TIMEOUT, "answered (the next tick fails)"
    if elapsed is None or c.get("outcome") == "timeout":
        return CRON_TIMEOUT, "hung"
    if restarting is not None and elapsed >= restarting - 0.5:
        return CRON_TIMEOUT, "hung until the restart"
    return min(elapsed, CRON_TIMEOUT), f"failed after {elapsed:.2f}s ({c.get('outcome')} {c.get('status', '')})".strip()


def detection_tables(det: dict[str, Any], capture: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, v in det["versions"].items():
        for fault in det["faults"]:
            trials = [t for t in v.get("trials", []) if t["fault"] == fault]
            if not trials:
                continue
            row: dict[str, Any] = {"version": v["mlx_lm"], "fault": fault, "n": len(trials)}
            row["measured_fast"] = {c: summary(t[c] for t in trials) for c in COLUMNS}
            row["kinds"] = _counts(t["kind"] for t in trials)
            row["bundle_kb"] = summary((t["bundle_bytes"] or 0) / 1024 for t in trials)
            cron = [cron_failure_time(t) for t in trials]
            row["cron_outcomes"] = _counts(why.split(" after ")[0] for _, why in cron)
            cron_c = [c for c, _ in cron]
            # A fast failure's duration: the second failed probe ended ``suspect_interval`` x J after the
            # first one ended, plus its own duration (J taken as 1: within ±0.1 s at the FAST config).
            fast_fail = [max(0.0, t["verdict_s"] - t["first_failure_after_onset_s"] - FAST["suspect_interval"])
                         for t in trials]

            def pairs(ft: float, to: float) -> list[tuple[float, float]]:
                ps = []
                for t, ff in zip(trials, fast_fail, strict=True):  # noqa: B023  pairs() runs in this iteration
                    reasons = (t.get("failures") or [])[-2:]
                    while len(reasons) < 2:
                        reasons = [reasons[0] if reasons else ""] + reasons
                    ps.append(tuple(_probe_duration(r, ft, to, ff) for r in reasons))
                return ps

            fast_model = model.mlxwatch_detection(FAST["interval"], FAST["suspect_interval"],
                                                  pairs(FAST["first_token_timeout"], FAST["timeout"]))
            measured = [t["verdict_s"] for t in trials]
            row["model_check_fast"] = {"model": fast_model.summary(), "measured": summary(measured),
                                       "ks_distance": model.ks_distance(fast_model, measured)}
            d_det = model.mlxwatch_detection(DEFAULTS.interval, DEFAULTS.suspect_interval,
                                             pairs(DEFAULTS.first_token_timeout, DEFAULTS.timeout))
            bundle_src = "fast trials"
            bundles = [t["bundle_s"] for t in trials if t["bundle_s"] is not None]
            if capture is not None and fault != "kill":
                caps = [c["wall_s"] for c in (capture["versions"].get(key) or {}).get("captures", []) if c["fault"] == fault]
                if caps:
                    bundles, bundle_src = caps, "capture benchmark at the default settings"
            restarts = [t["restart_s"] for t in trials if t["restart_s"] is not None]
            recoveries = [t["recovery_s"] for t in trials if t["recovery_s"] is not None]
            d_bundle = model.Dist.empirical(bundles)
            d_restart = model.Dist.empirical(restarts)
            d_recovery = model.Dist.empirical(recoveries)
            d_total = d_det + d_bundle + d_restart + d_recovery
            c_det = model.cron_detection(CRON_PERIOD, cron_c)
            c_total = c_det + d_restart
            row["defaults"] = {"verdict_s": d_det.summary(), "bundle_s": summary(bundles), "bundle_source": bundle_src,
                               "restart_s": summary(restarts), "recovery_s": summary(recoveries),
                               "total_s": d_total.summary()}
            row["cron"] = {"verdict_s": c_det.summary(), "restart_s": summary(restarts), "total_s": c_total.summary(),
                           "failure_time_s": summary(cron_c)}
            row["ratio_median"] = {
                "verdict": d_det.quantile(0.5) / c_det.quantile(0.5),
                "restored": d_total.quantile(0.5) / c_total.quantile(0.5),
                "verdict_worst": d_det.support()[1] / c_det.support()[1],
                "restored_worst": d_total.support()[1] / c_total.support()[1],
            }
            out[f"{key}/{fault}"] = row
    return out


def _counts(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in items:
        out[str(i)] = out.get(str(i), 0) + 1
    return out


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of issue 7 with the measured value and whether it was met."""
    rows = []
    scale = results.get("scale") or []

    def find(n: int, interval: float) -> dict | None:
        return next((r for r in scale if r["instances"] == n and r["interval_s"] == interval), None)

    for n, interval in ((300, 30.0), (100, 5.0), (10, 1.0)):
        r = find(n, interval)
        if r is None:
            continue
        rows.append({
            "target": f"{n} instances @ {interval:g} s on schedule: p99 gap <= +10 % of the interval beyond the "
                      "±10 % jitter, none skipped",
            "measured": f"p99 gap {r['gaps']['p99_s']:.2f} s = {100 * r['gaps']['p99_over_interval']:.1f} % of the "
                        f"interval ({r['gaps']['p99_beyond_jitter_pct']:+.1f} % beyond jitter), max "
                        f"{r['gaps']['max_s']:.2f} s; {r['probes_per_instance_per_min']['mean']:.2f} of "
                        f"{r['probes_per_instance_per_min']['planned']:g} probes/min; skipped "
                        f"{r['skipped_gaps'] + r['instances_without_probe']}",
            "met": bool(r["on_schedule"])})
    r = find(10, 30.0)
    if r is not None:
        rows.append({"target": "daemon CPU at 10 instances @ 30 s <= 1 % of a core",
                     "measured": f"{r['daemon_cpu_pct']:.2f} % ({r['daemon_cpu_s']:.2f} s CPU in {r['window_s']:.0f} s)",
                     "met": r["daemon_cpu_pct"] <= 1.0})
    r = find(300, 30.0)
    if r is not None:
        rows.append({"target": "daemon RSS at 300 instances <= 60 MB",
                     "measured": f"{r['rss_mb_max']:.1f} MB (max of 1 s samples)", "met": r["rss_mb_max"] <= 60.0})
    cap = results.get("capture_tables") or {}
    walls = [v["wall"]["max"] for k, v in cap.items() if v["wall"]["n"]]
    if walls:
        rows.append({"target": "capture <= 8 s on a hung server at the default settings (issue 7, item 2)",
                     "measured": f"max {max(walls):.2f} s over {sum(v['wall']['n'] for v in cap.values())} captures",
                     "met": max(walls) <= 8.0})
    soak = results.get("soak")
    if soak:
        fast = soak["mlxwatch"]["fast"]
        rows.append({"target": "soak: no mlxwatch verdict against a slow but working server, the grace exercised",
                     "measured": f"{fast['verdicts']} verdicts (fast config), {soak['mlxwatch']['defaults']['verdicts']} "
                                 f"(defaults); grace held {fast['grace_held']}x; {fast['probes_failed']} probes failed",
                     "met": fast["verdicts"] == 0 and soak["mlxwatch"]["defaults"]["verdicts"] == 0 and soak["grace_exercised"]})
    return rows
