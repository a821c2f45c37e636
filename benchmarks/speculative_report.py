"""benchmarks/speculative.py's summaries, targets and .md page (the measurement is there)."""

from __future__ import annotations

import statistics
from collections import Counter

SPEEDUP_C1 = 1.5  # decode tokens/s per stream at concurrency 1, best speculative variant / off
ADAPTIVE_VS_BEST = 0.95  # adaptive / best fixed depth, per-stream decode tokens/s, at every concurrency
FIXED = ("d1", "d3", "d5")
ADAPTIVE = ("adaptive", "adaptive-cpu")  # SGLang's default tiers; benchmarks/adaptive_tiers_cpu.json
WHY = """Why a deeper target: speculation trades target forwards for draft forwards and one wider verify forward,
which pays when the draft is much cheaper than the target. On the GPU, DeepSeek-V4-Flash's target forward costs
several of its MTP draft's (benchmarks/results/spec_model_work_gpu.md measures the ratio at these shapes);
builtin:tiny's 2-layer target on this CPU costs about one draft forward, so its speedup came mostly from the
engine's and the router's per-token overhead. builtin:deep keeps builtin:tiny's tokenizer, width and acceptance
and has enough layers that its target / draft ratio on this CPU is in the GPU's range."""


def summarize(reqs: list[dict], depth_samples: list[float]) -> dict:
    """One variant at one concurrency: medians of the client's per-request numbers, the mean accept length
    (tokens after the first per verify step) and the share of depth-gauge samples at each depth."""
    out: dict = {"requests": len(reqs)}
    if reqs:
        out["tok_s_per_stream_median"] = statistics.median(r["tok_s_per_stream"] for r in reqs)
        out["tpot_ms_median"] = 1e3 * statistics.median(r["tpot_s"] for r in reqs)
        out["ttft_ms_median"] = 1e3 * statistics.median(r["ttft_s"] for r in reqs)
        verify = sum(r["spec_verify_ct"] for r in reqs)
        if verify:
            out["mean_accept_length"] = sum(r["tokens"] - 1 for r in reqs) / verify
    if depth_samples:
        counts = Counter(int(round(v)) for v in depth_samples)
        out["depth_share"] = {str(k): counts[k] / len(depth_samples) for k in sorted(counts)}
        out["depth_mean"] = sum(depth_samples) / len(depth_samples)
    return out


def _best_fixed(values: dict[str, float]) -> tuple[str | None, float | None]:
    fixed = {n: v for n, v in values.items() if n in FIXED}
    if not fixed:
        return None, None
    name = max(fixed, key=lambda n: fixed[n])
    return name, fixed[name]


def targets(report: dict) -> dict:
    """The three targets of the benchmark's goal: value, goal, met (None where a variant needed was not run)."""
    per_conc = {e["concurrency"]: {n: v["tok_s_per_stream_median"] for n, v in e["variants"].items()}
                for e in report["results"]}
    skipped = report["settings"]["skipped"].get("adaptive")
    out = {}
    c1 = per_conc.get(1)
    if c1 and len(c1) > 1:
        by = {n: v / c1["off"] for n, v in c1.items() if n != "off"}
        best = max(by, key=lambda n: by[n])
        out["speedup_c1"] = {"value": by[best], "variant": best, "by_variant": by, "goal": f">= {SPEEDUP_C1}x off",
                             "met": by[best] >= SPEEDUP_C1}
    else:
        out["speedup_c1"] = {"value": None, "goal": f">= {SPEEDUP_C1}x off", "met": None,
                             "note": "concurrency 1 with a speculative variant was not run"}
    mix = {n: v["tok_s"] for n, v in report.get("mixed", {}).items()}
    for variant in ADAPTIVE:
        out.update(_adaptive_targets(variant, per_conc, mix, skipped))
    return out


def _adaptive_targets(variant: str, per_conc: dict, mix: dict, skipped: str | None) -> dict:
    """``<variant>_vs_best_fixed`` (worst concurrency) and ``<variant>_mixed_vs_fixed`` for one adaptive variant
    (the plain ``adaptive`` keeps the names ``adaptive_vs_best_fixed`` / ``adaptive_mixed_vs_fixed``)."""
    out = {}
    ratios = {}
    for conc, vals in per_conc.items():
        name, best = _best_fixed(vals)
        if variant in vals and best:
            ratios[str(conc)] = {"value": vals[variant] / best, "best_fixed": name}
    goal = f">= {ADAPTIVE_VS_BEST}x at every concurrency"
    if ratios:
        worst = min(r["value"] for r in ratios.values())
        out[f"{variant}_vs_best_fixed"] = {"value": worst, "per_concurrency": ratios, "goal": goal,
                                           "met": worst >= ADAPTIVE_VS_BEST}
    else:
        out[f"{variant}_vs_best_fixed"] = {"value": None, "goal": goal, "met": None,
                                           "note": skipped or f"{variant} or the fixed depths were not run"}
    name, best = _best_fixed(mix)
    goal = "> 1.0x the best fixed depth's total tokens/s (mixed concurrency 1 and 16)"
    if variant in mix and best:
        value = mix[variant] / best
        out[f"{variant}_mixed_vs_fixed"] = {"value": value, "best_fixed": name, "goal": goal, "met": value > 1.0}
    else:
        out[f"{variant}_mixed_vs_fixed"] = {"value": None, "goal": goal, "met": None,
                                            "note": skipped or f"no mixed phase, or {variant} or fixed depths not run"}
    return out


def _num(x, fmt: str = ".2f", unit: str = "") -> str:
    return "-" if x is None else format(x, fmt) + unit


def _met(t: dict) -> str:
    return {True: "met", False: "missed", None: "not measured"}[t["met"]]


def markdown(report: dict) -> str:
    """The results page: where, when, at which commit, the command, the targets and the tables."""
    m, s, t = report["machine"], report["settings"], report["targets"]
    lines = [f"# Speculative decoding: off, fixed depths and adaptive ({s['model']}, through the router)", "",
             f"- Device: {m['cpu_model']}, {m['cpu_cores']} cores, {m['mem_gib']} GiB, no GPU",
             f"- Date: {report['started_utc']} ({report['wall_s']:.0f} s)",
             f"- Measured at commit {report['commit']}",
             f"- Command: `{report['command']}`",
             f"- max({s['num_prompts']}, concurrency) prompts per round, {s['max_new_tokens']} tokens each, "
             f"{s['rounds']} round(s) per concurrency, variants interleaved (order rotated per round), torch on one "
             "thread per engine", ""]
    for why in s["skipped"].values():
        lines += [f"- adaptive: {why}", ""]
    sp = t["speedup_c1"]
    lines += ["## Targets", "",
              f"- speedup at concurrency 1 (goal {sp['goal']}): **{_num(sp['value'], unit='x')}** "
              f"({sp.get('variant', '-')}): {_met(sp)}"]
    for variant in ADAPTIVE:
        av, am = t[f"{variant}_vs_best_fixed"], t[f"{variant}_mixed_vs_fixed"]
        lines += [f"- {variant} vs the best fixed depth, worst concurrency (goal {av['goal']}): "
                  f"**{_num(av['value'], unit='x')}**: {_met(av)}",
                  f"- {variant} vs the best fixed depth, mixed concurrency (goal {am['goal']}): "
                  f"**{_num(am['value'], unit='x')}**: {_met(am)}"]
    lines += ["",
              "## Sweep", "",
              "| concurrency | variant | tok/s per stream (median) | vs off | TPOT ms | TTFT ms | accept length | "
              "depth (gauge samples) |", "|---|---|---|---|---|---|---|---|"]
    for e in report["results"]:
        off = e["variants"]["off"]["tok_s_per_stream_median"]
        for n, v in e["variants"].items():
            depth = ", ".join(f"{k}: {share:.0%}" for k, share in v.get("depth_share", {}).items()) or "-"
            lines.append(f"| {e['concurrency']} | {n} | {v['tok_s_per_stream_median']:.1f} | "
                         f"{v['tok_s_per_stream_median'] / off:.2f}x | {v['tpot_ms_median']:.2f} | "
                         f"{v['ttft_ms_median']:.1f} | {_num(v.get('mean_accept_length'))} | {depth} |")
    if report.get("mixed"):
        mx = s["mixed"]
        lines += ["", f"## Mixed concurrency ({mx['cycles']} cycle(s) of {mx['low']} request(s) one at a time, "
                      f"then {mx['high']} at once)", "",
                  "| variant | total tok/s | tokens | wall s | concurrency-1 part s | burst part s | depth |",
                  "|---|---|---|---|---|---|---|"]
        for n, v in report["mixed"].items():
            depth = ", ".join(f"{k}: {share:.0%}" for k, share in v.get("depth_share", {}).items()) or "-"
            lines.append(f"| {n} | {v['tok_s']:.1f} | {v['tokens']} | {v['wall_s']:.1f} | {v['low_phase_s']:.1f} | "
                         f"{v['high_phase_s']:.1f} | {depth} |")
    eq = report["outputs_equal_off"]
    lines += ["", "Greedy outputs equal off's token for token (sweep): "
              + (", ".join(f"{n}: {ok}" for n, ok in eq.items()) or "-") + ".", "", WHY, ""]
    return "\n".join(lines)
