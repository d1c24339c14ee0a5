"""Render the results as ``RESULTS.md``: tables with min/median/max, the machine, the versions."""

from __future__ import annotations

from typing import Any

from bench import analysis, detection, tax
from bench.common import fmt_mmm, summary

FAULT_NAMES = {"spin": "livelock (spin)", "block": "blocked", "die": "dead thread", "kill": "killed (SIGKILL)"}


def _m(s: dict | None, digits: int = 1) -> str:
    return fmt_mmm(s or {}, digits)


def _q(s: dict | None, digits: int = 0) -> str:
    """A computed distribution: median (min–max)."""
    if not s:
        return "–"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{1000 * v:.0f} ms"


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def render(r: dict[str, Any]) -> str:
    L: list[str] = []
    add = L.append
    m = r["machine"]
    add("# mlxwatch benchmark results")
    add("")
    add(f"Produced by `{r['command']}` (`bench/run.py`) on {r['started_at']}, in "
        f"{r.get('total_seconds', 0) / 60:.1f} minutes. Raw data: `bench/RESULTS.json` (the same run). "
        "Every number below was measured on this machine in this run, or computed from such "
        "measurements where the text says so.")
    add("")
    add(f"- **Machine**: {m['system']} {m['release']} {m['machine']}, {m['cpu']}, {m['cpus']} cores, "
        f"{m['memory_gb']} GB RAM, Python {m['python']}; MLX on the CPU (no GPU). Shared: other test suites ran on "
        "it at times (load average per phase below).")
    vs = r.get("versions", {})
    tv, ov = vs.get("test venv", {}), vs.get("0.31.3 venv", {})
    add(f"- **Versions**: mlxwatch {tv.get('mlxwatch', '?')} (commit {r.get('mlxwatch_commit')}), "
        f"mlx-lm {tv.get('mlx-lm', '?')} with mlx {tv.get('mlx', '?')}, and mlx-lm {ov.get('mlx-lm', '?')} with mlx "
        f"{ov.get('mlx', '?')}; py-spy {tv.get('py-spy', '?')}, httpx {tv.get('httpx', '?')}, psutil {tv.get('psutil', '?')}.")
    add("- **Servers**: the real `mlx_lm.server` console script with a tiny random-weight llama "
        "(2 layers, hidden 64; `tests/lab` on `mlxwatch/_lab`), faults switched on at run time. The scale runs use the "
        "token-streaming stand-in (`tests/lab/standin.py`, recorded by `bench/standin.py`).")
    la = r.get("load_average") or {}
    phases = r.get("phases") or {}
    add(f"- **Schedule**: phase A ran side by side for {phases.get('A', {}).get('seconds', 0) / 60:.1f} min (the soak; "
        "detection on both versions, then the captures on hung servers; the 10 @ 30 s scale run); phase B ran one "
        f"part at a time ({phases.get('B', {}).get('seconds', 0) / 60:.1f} min: the other scale runs, the py-spy pause, "
        "the probe tax). "
        "1-minute load average, median (min–max): " +
        "; ".join(f"phase {k} {v['median']:.1f} ({v['min']:.1f}–{v['max']:.1f})" for k, v in sorted(la.items())) + ".")
    for note in r.get("notes") or []:
        add(f"- **Note**: {note}")
    for rr in r.get("reruns") or []:
        add(f"- **Rerun**: {', '.join(rr['parts'])} measured again on {rr['at']} ({rr['minutes']:g} min, commit "
            f"{rr['commit']}; load average " + "; ".join(f"phase {k} {v['median']:.1f} ({v['min']:.1f}–{v['max']:.1f})"
                                                       for k, v in sorted(rr['load_average'].items())) +
            "); the tables for those parts are from the rerun.")
    if r.get("errors"):
        add(f"- **Errors in this run**: {', '.join(r['errors'])} (details in the JSON).")
    add("")

    # --- targets
    add("## Targets")
    add("")
    add("| target | measured | |")
    add("|---|---|---|")
    for t in r.get("targets", []):
        add(f"| {t['target']} | {t['measured']} | {'met' if t['met'] else '**missed**'} |")
    add("")

    _detection(r, add)
    _soak(r, add)
    _scale(r, add)
    _tax(r, add)
    _capture(r, add)
    return "\n".join(L) + "\n"


def _detection(r: dict[str, Any], add) -> None:
    tables = r.get("detection_tables") or {}
    det = r.get("detection") or {}
    if not tables:
        return
    fast = detection.FAST
    add("## Detection and recovery")
    add("")
    add("Fault onset → verdict → bundle written → restart done → first healthy probe, per fault shape, on "
        "both mlx-lm versions. Seconds, median (min–max).")
    add("")
    add(f"**Measured, in real time, at the FAST config** (`bench/detection.py`): interval {fast['interval']:g} s, "
        f"suspect_interval {fast['suspect_interval']:g} s, first_token_timeout {fast['first_token_timeout']:g} s, "
        f"timeout {fast['timeout']:g} s, failures {fast['failures']}; capture at its defaults (3 stack snapshots "
        "2 s apart; the capture's own probe waits at most min(first_token_timeout, 10 s), so 2 s here); restart by "
        "the lab's relaunch hook (`command:` `python tests/lab/cli.py relaunch DIR`: SIGTERM the server, start it "
        f"again, return once it generates). {det.get('trials_per_fault', '?')} trials per fault and version; each "
        "onset at a random moment of the probe schedule; `mlxwatch run` as its own process, times from its journal.")
    add("")
    add("| mlx-lm | fault | n | onset → verdict | verdict → bundle | bundle → restart done | restart → healthy probe | onset → healthy | classified as |")  # noqa: E501  one Markdown table row
    add("|---|---|---|---|---|---|---|---|---|")
    for row in tables.values():
        mf = row["measured_fast"]
        kinds = ", ".join(f"{k} {n}/{row['n']}" for k, n in row["kinds"].items())
        add(f"| {row['version']} | {FAULT_NAMES.get(row['fault'], row['fault'])} | {row['n']} | {_m(mf['verdict_s'])} | "
            f"{_m(mf['bundle_s'])} | {_m(mf['restart_s'])} | {_m(mf['recovery_s'], 2)} | {_m(mf['total_s'])} | {kinds} |")
    add("")
    d = analysis.DEFAULTS
    add(f"**The defaults, computed** (interval {d.interval:g} s, suspect_interval {d.suspect_interval:g} s, "
        f"first_token_timeout {d.first_token_timeout:g} s, failures {d.failures}): ten trials of a 30 s schedule "
        "with a 45 s first-token limit take about 20 minutes per fault and version, more than the whole budget, so "
        "their distribution is computed exactly from the policy (`bench/model.py`): the fault meets the next probe "
        "after the residual of a jittered interval (interval × U(0.9, 1.1)), that probe fails after the "
        "first-token limit if the server hangs (or after its measured time if it fails fast: the failure modes "
        "are the ones the real probes met in the trials above), the confirming probe follows after "
        "suspect_interval × U(0.9, 1.1) and fails the same way; then the measured costs: the bundle (the capture "
        "benchmark below, at the default settings; for a killed server, the trials above), the restart and the "
        "first healthy probe (the trials above). Convolved exactly on a 10 ms grid; min and max are the ends of "
        "the support.")
    add("")
    add(f"**The cron workaround, computed** (what people deploy): every {analysis.CRON_PERIOD:g} s a non-streaming "
        f"4-token request with a {analysis.CRON_TIMEOUT:g} s timeout, restart on the first failure, no capture. "
        f"The fault meets the next request after U(0, {analysis.CRON_PERIOD:g} s); the request then fails after "
        f"{analysis.CRON_TIMEOUT:g} s if it hangs, or after its measured time: at every onset above the same "
        "request was really sent to the faulted server, side by side with mlxwatch, and how it ended is used "
        "(below). Restored = verdict + the same measured restart; the cron never checks that the restart worked.")
    add("")
    add("| mlx-lm | fault | mlxwatch defaults: onset → verdict | bundle | restart | healthy probe | onset → healthy | cron: onset → verdict | cron: onset → restarted | ratio verdict (median) | ratio restored (median) | ratio restored (worst case) |")  # noqa: E501  one Markdown table row
    add("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in tables.values():
        de, cr, ra = row["defaults"], row["cron"], row["ratio_median"]
        add(f"| {row['version']} | {FAULT_NAMES.get(row['fault'], row['fault'])} | {_q(de['verdict_s'])} | "
            f"{_m(de['bundle_s'])} | {_m(de['restart_s'])} | {_m(de['recovery_s'], 2)} | {_q(de['total_s'])} | "
            f"{_q(cr['verdict_s'])} | {_q(cr['total_s'])} | {ra['verdict']:.2f} | {ra['restored']:.2f} | "
            f"{ra['restored_worst']:.2f} |")
    add("")
    add("Ratios are mlxwatch (defaults) / cron, both computed from this run's measurements. mlxwatch also "
        "writes a bundle before restarting; the cron restarts blind.")
    add("")
    add("**How the cron's request ended** at each onset (the request sent side by side with mlxwatch's probes):")
    add("")
    add("| mlx-lm | fault | outcomes |")
    add("|---|---|---|")
    for row in tables.values():
        add(f"| {row['version']} | {FAULT_NAMES.get(row['fault'], row['fault'])} | "
            + ", ".join(f"{k}: {n}" for k, n in row["cron_outcomes"].items()) + " |")
    add("")
    add("**Model check**: the same model, at the FAST config, against the FAST trials measured above "
        "(onset → verdict, seconds). A small Kolmogorov–Smirnov distance with 10 samples (below ~0.4) means the "
        "measurements are consistent with the model that computes the defaults.")
    add("")
    add("| mlx-lm | fault | model: median (min–max) | measured: median (min–max) | KS distance |")
    add("|---|---|---|---|---|")
    for row in tables.values():
        mc = row["model_check_fast"]
        add(f"| {row['version']} | {FAULT_NAMES.get(row['fault'], row['fault'])} | {_q(mc['model'], 2)} | "
            f"{_m(mc['measured'], 2)} | {mc['ks_distance']:.2f} |")
    add("")
    errs = {k: v.get("error") for k, v in det.get("versions", {}).items() if v.get("error")}
    if errs:
        add(f"Errors: {errs}")
        add("")


def _soak(r: dict[str, Any], add) -> None:
    s = r.get("soak")
    if not s:
        return
    f, d, c = s["mlxwatch"]["fast"], s["mlxwatch"]["defaults"], s["cron"]
    add("## False positives: the soak")
    add("")
    add(f"{s['duration_s'] / 60:.1f} minutes against one real server (mlx-lm {s['mlx_lm']}) that is slow but "
        f"working: started with `--prefill-step-size {s['server']['prefill_step_size']}` and the `slow` fault "
        f"({s['server']['slow_step_s']:g} s added to every batch step), under {s['load']['clients']} real concurrent "
        f"clients, each sending a prompt of {s['load']['prompt_words'][0]}–{s['load']['prompt_words'][1]} words "
        f"(prompt sizes seen: {_m(s['clients']['prompt_tokens'], 0)} tokens), streaming a "
        f"{s['load']['answer_tokens']}-token answer, then pausing {s['load']['think_s'][0]:g}–"
        f"{s['load']['think_s'][1]:g} s. More clients than mlx-lm's prefill batch (8) means a new request, probes "
        "included, sometimes waits for a slot while long prompts are processed in small steps. Side by side "
        "against the same server: `mlxwatch run` at the FAST config (log followed), `mlxwatch run` at the "
        f"defaults, and the cron workaround scaled like the FAST config (a non-streaming 4-token request every "
        f"{c['period_s']:g} s with a {c['timeout_s']:g} s timeout, the FAST config's total probe timeout). "
        "Nothing was restarted (`restart: none`; the cron's restarts are counted, not run): every verdict and "
        "every failed cron request is a false positive, since the server worked throughout.")
    add("")
    add("| watcher | checks that failed | verdicts / restarts ordered (false) | grace held the verdict |")
    add("|---|---|---|---|")
    add(f"| mlxwatch, FAST config | {f['probes_failed']} probes | **{f['verdicts']}** | {f['grace_held']} times |")
    add(f"| mlxwatch, defaults | {d['probes_failed']} probes | **{d['verdicts']}** | {d['grace_held']} times |")
    add(f"| cron workaround | {c['failed']} of {c['requests']} requests | **{c['failed']}** | – (no busy-awareness) |")
    add("")
    cl = s["clients"]
    add(f"Clients: {cl['ok']} of {cl['requests']} requests completed with 200; each took {_m(cl['seconds'])} s "
        f"(queueing and prompt processing). The server logged {cl['progress_lines']} prompt-progress lines and "
        f"{cl['broken_pipes']} BrokenPipeError (clients that closed a stream early: timed-out cron requests, and "
        "mlxwatch's lingering probes closed when the next one was due). The grace was exercised: "
        f"{'yes' if s['grace_exercised'] else '**no**'} (the daemon logged \"progress holds the verdict\" "
        f"{f['grace_held']} times), e.g. `{(f['held_examples'] or ['–'])[0].split(': ', 1)[-1]}`.")
    add("")


def _scale(r: dict[str, Any], add) -> None:
    rows = r.get("scale") or []
    if not rows:
        return
    add("## Scale")
    add("")
    add("`mlxwatch run` as its own process, watching N stand-in servers (one process, one port each, 4 streamed "
        "tokens; `restart: none`, no log, the default probe settings except `interval`). Every instance is let "
        "reach healthy first (its one identity lookup), then a window of whole intervals is measured. Probe times "
        "are recorded where the probes arrive (the stand-in), not by the daemon. CPU is the daemon process's user + "
        "system time (all its threads) over the window, in % of one core; RSS is the max of 1 s samples. Gaps are "
        "between consecutive probes of one instance, pooled over all instances. The daemon sleeps interval × "
        "U(0.9, 1.1) after each probe by design, so a gap up to +10 % is the jitter; the target is a p99 gap no "
        "more than a further +10 % of the interval. A gap over 1.8 × interval, or an instance without a probe in "
        "the window, is a skipped probe. 10 @ 30 s ran in phase A (beside the soak and detection); the others "
        "alone. Where a gap's excess comes from: a check is the generation request and the two endpoint requests "
        "sent with it; its *server span* runs from the first arrival to the last answer finished, its *turnaround* "
        "from that answer to the next check's arrival (the daemon's jittered sleep, at most 1.1 × interval, plus "
        "what the daemon itself took).")
    add("")
    add("| instances @ interval | window | daemon CPU | RSS | probes / instance / min: done (planned) | p50 gap | p99 gap (% of interval) | beyond jitter | max gap | skipped | server span p99 | turnaround p99 (× interval) | warm-up (CPU) |")  # noqa: E501  one Markdown table row
    add("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in rows:
        g = s["gaps"]
        pm = s["probes_per_instance_per_min"]
        sp = s.get("split") or {}
        add(f"| {s['instances']} @ {s['interval_s']:g} s | {s['window_s']:.0f} s | {s['daemon_cpu_pct']:.2f} % | "
            f"{s['rss_mb_max']:.1f} MB | {pm['mean']:.2f} ({pm['planned']:g}); min {pm['min']:.1f} | "
            f"{g['p50_s']:.3f} s | {g['p99_s']:.3f} s ({100 * g['p99_over_interval']:.1f} %) | "
            f"{g['p99_beyond_jitter_pct']:+.1f} % | {g['max_s']:.3f} s | "
            f"{s['skipped_gaps'] + s['instances_without_probe']} | {_ms(sp.get('server_span_s', {}).get('p99'))} | "
            f"{_x(sp.get('turnaround_over_interval', {}).get('p99'))} | {s['warmup_s']:.0f} s ({s['warmup_cpu_s']:.1f} s) |")
    add("")
    add("Probes per minute are counted in the window (a 60 s window at 30 s holds 2 probes per instance, so "
        "2.0 per minute is every probe). \"planned\" is 60 / interval; each gap also holds the probe's own few "
        "milliseconds. Warm-up is from the daemon's start until every instance was healthy plus one interval "
        "(at most 5 s) and one second, with the CPU it used; it is not in the window.")
    add("")


def _tax(r: dict[str, Any], add) -> None:
    t = r.get("tax")
    if not t:
        return
    add("## Probe tax")
    add("")
    add(f"One long streamed generation ({t['tokens']} tokens, mlx-lm {t['mlx_lm']}, tiny model, about "
        "1.5–2 ms per token on this CPU) per trial; tokens/s and inter-token gaps as the client sees them. "
        f"Conditions interleaved in a shuffled order ({' '.join(t['order'])}), {t['reps']} trials each: no "
        "watchdog, or `mlxwatch run` probing every 1 s or every 30 s (started before the trial, its first probe "
        "done, the generation started at a random point of its interval). Probes inside = generation requests "
        "the server admitted during the trial, less the trial's own.")
    add("")
    add("| probes | tokens/s | p99 inter-token gap | max gap | probes inside |")
    add("|---|---|---|---|---|")
    for cond in tax.CONDITIONS:
        row = t["table"][cond]
        add(f"| {'none' if cond == 'none' else 'every ' + cond} | {_m(row['tokens_per_s'], 0)} | "
            f"{_m(row['gap_p99_ms'], 2)} ms | {_m(row['gap_max_ms'], 1)} ms | {_m(row['probes_inside'], 0)} |")
    add("")


def _capture(r: dict[str, Any], add) -> None:
    c = r.get("capture")
    tables = r.get("capture_tables") or {}
    if not c:
        return
    add("## Capture cost")
    add("")
    add("`capture_bundle` as the daemon calls it at the default settings (3 py-spy snapshots 2 s apart, "
        "ceiling 60 s, the capture's probe cut at the window's end + 1 s, at least 5 s) on a hung real server: "
        f"a fresh server, the fault switched on and bitten by one streaming request left in flight. "
        f"{c['reps']} captures per fault and version, in phase A after the detection trials (beside the soak). "
        "Seconds, median (min–max); steps run side by side, so they "
        "do not add up. Each `py-spy dump` is timed around its subprocess (a JSON dump for the classifier, then a "
        "`--native` text dump for people, per snapshot).")
    add("")
    add("| mlx-lm / fault | capture wall time | stacks | CPU window | probe | log | bundle size | py-spy dump: JSON | py-spy dump: --native | classified as |")  # noqa: E501  one Markdown table row
    add("|---|---|---|---|---|---|---|---|---|---|")
    for key, v in tables.items():
        st = v["steps"]
        add(f"| {key.replace('mlx-lm-', '')} | {_m(v['wall'], 2)} | {_m(st.get('stacks'), 2)} | {_m(st.get('cpu'), 2)} | "
            f"{_m(st.get('probe'), 2)} | {_m(st.get('log'), 3)} | {_m(v['bundle_kb'], 0)} KB | "
            f"{_m(v['dump_json'], 3)} | {_m(v['dump_native'], 3)} | {', '.join(v['kinds'])} |")
    add("")
    add("**How long py-spy paused the target.** A dump's wall time (above) is an upper bound: it includes "
        "py-spy's own start and reading the target's symbols before it stops the process. The pause itself was "
        "measured on a healthy server streaming a long generation: the longest inter-token gap that overlaps a "
        "dump, less the usual gap, is how long the dump held the server (phase B).")
    add("")
    add("| mlx-lm | usual gap | JSON dump: pause (wall) | --native dump: pause (wall) |")
    add("|---|---|---|---|")
    for v in c["versions"].values():
        p = v.get("pause") or {}
        dumps = p.get("dumps") or []
        js = [d for d in dumps if d["kind"] == "json"]
        nat = [d for d in dumps if d["kind"] == "native"]

        def cell(ds):
            if not ds:
                return "–"
            pause = fmt_mmm(summary(1000 * d["pause_s"] for d in ds if d["pause_s"] is not None), 0)
            wall = fmt_mmm(summary(1000 * d["wall_s"] for d in ds), 0)
            return f"{pause} ms (wall {wall} ms), n={len(ds)}"
        add(f"| {v['mlx_lm']} | {p.get('usual_gap_ms') or 0:.1f} ms | {cell(js)} | {cell(nat)} |")
    add("")
