"""The section each benchmark's record gets in benchmarks/RESULTS.md: its title (the command
that measured it) and its figures as a markdown table (``benchmarks/results.py`` renders them)."""

from __future__ import annotations

from eplb_reference.bench.breakdown import breakdown_cells


def table(header: list[str], rows: list[list[object]]) -> str:
    cells = [header, ["---"] * len(header), *[["n/a" if c is None else str(c) for c in row] for row in rows]]
    return "\n".join("| " + " | ".join(row) + " |" for row in cells)


def ratio_cell(ratios: dict, key: str, interval: str | None = None) -> str:
    value = ratios.get(key)
    if value is None:
        return "n/a"
    bounds = ratios.get(interval) if interval else None
    return f"{value}" + (f" [{bounds[0]}, {bounds[1]}]" if bounds else "")


# --- one renderer per benchmark ----------------------------------------------------------


def render_run(r: dict) -> str:
    return table(
        ["steps x ranks", "mode", "rearrangements", "layer commits", "recompiles", "recaptures", "mismatches (max diff)",
         "balancedness: without EPLB / before / after", "step p50 ms"],
        [[f"{r['steps']} x {r['ranks']}", r["mode"], r["rearrangements"], r["layers_committed"], r["recompiles"],
          r["recaptures"], f"{r['output_mismatches']} ({r['max_abs_diff']:.1e}, {r['output_check']})",
          f"{r['balancedness_without_eplb']} / {r['balancedness_before']} / {r['balancedness_after']}",
          r["step_p50_ms"]]])


def render_bench(r: dict) -> str:
    steps = table(["mode", "eplb", "p50 ms", "p99 ms", "tokens/s", "compile s", "recompiles", "recaptures"],
                  [[x["mode"], x["eplb"], x["p50_ms"], x["p99_ms"], x["tokens_per_s"], x["compile_or_capture_s"],
                    x["recompiles"], x["recaptures"]] for x in r["results"]])
    modes = {mode: ratios for mode, ratios in r["ratios"].items() if isinstance(ratios, dict)}
    rows = [
        ["on_idle / off (p50) [95 %]", "on_idle_over_off", "on_idle_over_off_ci95"],
        ["off_twin / off (A/A) [95 %]", "off_twin_over_off", "off_twin_over_off_ci95"],
        ["rearranging p99 / steady p50", "rearranging_p99_over_steady_p50", None],
        ["steady p99 / steady p50 (the floor)", "steady_p99_over_steady_p50", None],
        ["rearranging p50 / steady p50", "rearranging_p50_over_steady_p50", None],
        ["EPLB host work in rearranging steps, p50 ms", "rearranging_eplb_host_p50_ms", None],
    ]
    ratio_rows = [[label, *(ratio_cell(modes[m], key, ci) for m in modes)] for label, key, ci in rows
                  if any(key in modes[m] for m in modes)]
    speedup = r["ratios"].get("graph_speedup_over_eager_decode")
    if speedup is not None:
        ratio_rows.append(["graph speedup over eager, decode (p50)", *[speedup] + [""] * (len(modes) - 1)])
    meta = (f"{r['ranks']} rank(s), {r['steps_per_run']} steps per run, decode {r['decode_tokens_per_rank']} tokens "
            f"per rank, CPU routing kernel {r.get('cpu_layer_kernel')}, intra-op threads {r.get('intra_op_threads')}"
            + (", Inductor's C++ wrapper" if r.get("cpp_wrapper") else ""))
    failed = "".join(f"\n\nFAILED: {problem}" for problem in r.get("failed_checks", []))
    header, breakdown = breakdown_cells(r["ratios"])
    breakdown_table = f"\n\n{table(header, breakdown)}\n\n{r.get('step_breakdown_note', '')}" if header else ""
    return f"{meta}\n\n{steps}\n\n{table(['ratio', *modes], ratio_rows)}{breakdown_table}{failed}"


def render_routing_ops(r: dict) -> str:
    return table(["T", "registered us", "inline us", "ratio", "target"],
                 [[x["num_tokens"], x["registered_us"], x["inline_us"], x["ratio"], x.get("target_ratio", "")]
                  for x in r["results"]])


def render_op_in_step(r: dict) -> str:
    intro = f"CPU kernel {r['cpu_layer_kernel']}, after a {r['forward_p50_us']} us compiled step, {r['rounds']} rounds"
    return intro + "\n\n" + table(["call", "right after a step us", "back to back us"],
                                  [[name, t["cold_us"], t["hot_us"]] for name, t in r["calls"].items()])


def render_commit(r: dict) -> str:
    return table(["experts", "commit as shipped p50 ms", "under the adapter p50 ms", "ratio", "inversion upstream / ours ms"],
                 [[f"{x['num_logical']} + {x['num_redundant_experts']}", x["commit_upstream_p50_ms"], x["commit_adapter_p50_ms"],
                   x["commit_upstream_over_adapter"], f"{x['inversion_upstream_p50_ms']} / {x['inversion_adapter_p50_ms']}"]
                  for x in r["results"]])


def render_transfer_planning(r: dict) -> str:
    return table(["experts x ranks", "move_to_buffer as shipped p50 ms", "under the adapter p50 ms", "ratio",
                  "sends + receives posted"],
                 [[f"{x['num_logical']} + {x['num_redundant_experts']} x {x['ranks']}", x["plan_upstream_p50_ms"],
                   x["plan_adapter_p50_ms"], x["upstream_over_adapter"], x["posted_per_layer_p50"]] for x in r["results"]])


def render_policy_stall(r: dict) -> str:
    rows = []
    for x in r["results"]:
        for mode, p50 in x["step_p50_ms"].items():
            rows.append([x["shape"], mode, p50, x["step_p99_ms"][mode], x["policy_call_p50_ms"].get(mode)])
    return table(["shape", "policy runs", "step p50 ms", "step p99 ms", "policy call p50 ms"], rows)


def render_movement(r: dict) -> str:
    keys = ["layer_move_ms_p50", "layer_move_mb", "staging_mb_per_s", "memcpy_mb_per_s", "commit_ms_per_layer_p50",
            "steady_p50_ms", "rearranging_p99_ms", "sync_rearrange_step_ms_p50", "rearranging_p99_over_steady_p50"]
    return table(["measure", *(f"rank {x['rank']}" for x in r["ranks"])], [[k, *(x[k] for x in r["ranks"])] for k in keys])


def render_injected_work(r: dict) -> str:
    return table(["ranks", "injected us per step", "plain p50 ms", "injected p50 ms", "step cost us", "cost / injected"],
                 [[r["ranks"], r["injected_us_per_step"], r["plain_p50_ms"], r["injected_p50_ms"], r["step_cost_us"],
                   r["step_cost_over_injected"]]])


def render_elastic(r: dict) -> str:
    rows = [[f"{x['kind']} {x['old_size']} -> {x['new_size']}", x["at_step"], x["outcome"], x["reconfiguration_seconds"],
             x["serving_pause_seconds"], x["steps_paused"], x["bytes_moved"]] for x in r["resizes"]]
    resizes = table(["resize", "at step", "outcome", "to serving at the new size s", "longest pause s", "steps paused",
                     "bytes moved"], rows)
    totals = table(["batches", "lost", "duplicated", "mismatches", "recompiles", "experts reloaded", "step p50 ms",
                    "EPLB rearrangements between resizes"],
                   [[r["requests_completed"], r["requests_lost"], r["requests_duplicated"], r["output_mismatches"],
                     r["recompiles"], r["experts_reloaded"], r["step_p50_ms"],
                     r.get("eplb_rearrangements_finished", "not run (before 530d607)")]])
    return f"{resizes}\n\n{totals}"


def render_elastic_control(r: dict) -> str:
    fixed = r["fixed_vs_elastic"]
    steps = table(["workload", "fixed step p50 ms (per round)", "elastic step p50 ms (per round)", "elastic / fixed",
                   "fixed A/A"],
                  [[f"{fixed['steps']} steps x {fixed['ranks']} ranks, {fixed['mode']}", fixed["fixed_step_p50_ms"],
                    fixed["elastic_step_p50_ms"], fixed["elastic_over_fixed"], fixed["fixed_a_over_a"]]])
    serving = r["serving"]
    control = table(["requests served", "steps", "control ms p50, first fifth / last fifth", "last / first",
                     "store keys after 50 requests / at the end", "mismatches"],
                    [[serving["requests"], serving["steps_served"],
                      f"{serving['control_ms_p50_first_fifth']} / {serving['control_ms_p50_last_fifth']}",
                      serving["last_over_first"],
                      f"{serving['store_keys_after_50_requests']} / {serving['store_keys_at_the_end']}",
                      serving["mismatches"]]])
    return f"{steps}\n\n{control}"


def render_vllm_eplb(r: dict) -> str:
    if "arms" not in r["runs"][0]:  # one configuration's report (before the worst and natural runs)
        return render_vllm_eplb_single(r)
    c, n = r["config"], r["natural"]
    meta = (f"worst: {c['experts']} experts + {c['redundant']} redundant, hidden {c['hidden']}, expert width "
            f"{c['intermediate']}, float32, hot {c['hot']} (+{c['bias']} logits); natural: {n['experts']} + {n['redundant']}, hidden "
            f"{n['hidden']}, expert width {n['intermediate']}, top-{n['top_k']}, {n['dtype']}, Zipf {c['zipf']} "
            f"(router mass); {c['layers']} MoE layers, {c['rounds']} rounds of two arms per run")
    runs = table(["layout", "config", "placement", "rebalanced / static (per round)", "static A/A",
                  "balancedness static -> rebalanced", "predicted gain", "share of it", "target met",
                  "load max / mean (fitted Zipf)", "hot share"],
                 [[x["layout"], x["config"], x["placement"],
                   f"{x['rebalanced_over_static']} ({', '.join(str(q) for q in x['per_round_ratios'])})", x["aa_ratio"],
                   f"{x['balancedness_static']} -> {x['balancedness_rebalanced']}", x["predicted_gain"],
                   predicted_share(x), x["target_met"],
                   f"{x['load_max_over_mean']} ({x['zipf_exponent']})" if x["load_max_over_mean"] else "-",
                   x["hot_share_of_pairs"] or "-"] for x in r["runs"]])
    return f"{meta}\n\n{runs}"


def predicted_share(run: dict) -> str:
    """The share of the predicted gain a run measured, or that none was predicted (the benchmark
    leaves the share out where the predicted gain is within noise)."""
    share = run["share_of_predicted_gain"]
    return f"{share} of {run['predicted_gain']}" if share is not None else f"none predicted ({run['predicted_gain']})"


def vllm_eplb_headline(report: dict | None) -> list[list[str]]:
    """The README's rows of bench_vllm_eplb: one per skew, its layouts and placements side by side
    (a report before the worst and natural runs is one worst-case run)."""
    runs = [] if not report else report["runs"] if "arms" in report["runs"][0] else [report]
    by_skew: dict[str, list[dict]] = {}
    for run in runs:  # a single run's "config" is its arguments
        by_skew.setdefault(run["config"] if "placement" in run else "worst", []).append(run)
    return [[f"vLLM + EP over two workers, {skew} skew ({', '.join(label(run) for run in runs)}): tokens/s "
             "rebalanced / static (A/A); balancedness static -> rebalanced; share of the gain the balancedness "
             "predicts",
             " / ".join(f"{run['rebalanced_over_static']} ({run['aa_ratio']}); {run['balancedness_static']} -> "
                        f"{run['balancedness_rebalanced']}; {predicted_share(run)}" for run in runs),
             ">= 1.15 where predicted >= 1.25; -; >= 0.8", "`bench_vllm_eplb.py`"] for skew, runs in by_skew.items()]


def label(run: dict) -> str:
    """``tp2 rank0``: a run's layout and where its hot experts start."""
    return f"{run['layout']} {run.get('placement', 'rank0')}"


def render_vllm_eplb_single(r: dict) -> str:
    c = r["config"]
    meta = (f"vLLM {r['layout']} + EP, {c['experts']} experts + {c['redundant']} redundant, hidden {c['hidden']}, expert "
            f"width {c['intermediate']}, {c['layers']} MoE layers; hot experts {r['hot_experts']} take "
            f"{r['hot_share_of_pairs']} of the routed pairs (recorded load); {c['requests']} timed requests of "
            f"{c['prompt_tokens']} + {c['max_tokens']} tokens per arm, after {c['warm_requests']}")
    arms = table(["arm", "tokens/s", "step p50 ms", "step p99 ms", "balancedness (upstream's)", "expert share",
                  "expert s per rank", "pairs per rank", "rearrangements"],
                 [[x["arm"], x["tokens_per_s"], x["step_p50_ms"], x["step_p99_ms"], x["balancedness"], x["expert_share"],
                   " / ".join(f"{rank['expert_seconds']:.3f}" for rank in x["ranks"]),
                   " / ".join(str(rank["pairs"]) for rank in x["ranks"]), x["upstream_rearrangements_logged"]]
                  for x in r["runs"]])
    ratios = table(["rebalanced / static tokens/s", "static A/A", "rebalanced A/A", "balancedness static -> rebalanced",
                    "predicted gain", "share of the predicted gain"],
                   [[r["rebalanced_over_static"], r["aa_ratio"], r["rebalanced_aa_ratio"],
                     f"{r['balancedness_static']} -> {r['balancedness_rebalanced']}", r["predicted_gain"],
                     r["share_of_predicted_gain"]]])
    return f"{meta}\n\n{arms}\n\n{ratios}"


def render_kept_placement(r: dict) -> str:
    config = r["config"]
    meta = (f"{r['layout']}, {config['experts']} experts + {config['redundant']} redundant, hot {config['hot']}, "
            f"interval {config['interval']} steps, {config['requests']} requests of {config['prompt_tokens']} tokens, "
            f"{len(r['runs']) // 2} rounds")
    runs = table(["round", "start", "window balancedness (each window of loaded steps)", "rearrangements kept"],
                 [[run["round"], run["arm"], ", ".join(str(w) for w in run["windows"]), run["kept_rearrangements"]]
                  for run in r["runs"]])
    summary = table(["first window: cold -> restored", "cold, converged", "restored first / converged",
                     "first-window spread (cold, restored)"],
                    [[f"{r['first_window_cold']} -> {r['first_window_restored']}", r["converged_cold"],
                      r["restored_first_over_converged"],
                      f"{r['first_window_spread']['cold']}, {r['first_window_spread']['restored']}"]])
    return f"{meta}\n\n{runs}\n\n{summary}"


def render_vllm_elastic(r: dict) -> str:
    resizes = table(["arm", "resize", "request to serving s", "pause s", "recompiles", "balancedness before -> after",
                     "tokens/s before -> after"],
                    [[x["arm"], f"{x['from']} -> {x['to']}", x["request_to_serving_s"], x["pause_s"], x["recompiles"],
                      f"{x['balancedness_before']} -> {x['balancedness_after']}",
                      f"{x['tokens_per_s_before']} -> {x['tokens_per_s_after']}"] for x in r["resizes"]])
    kept = r["kept_over_reset_pause"] if r["kept_over_reset_pause"] is not None else f"not measured: {r['kept_refused']}"
    return f"{resizes}\n\nkept / reset median pause: {kept}; reset A/A: {r['aa_ratio']}"


def render_local_pairs(r: dict) -> str:
    shape = r["shape"]
    host = f" on {r['cpu']}" if "cpu" in r else ""
    passes = f"; compaction and combine: {r['passes']}" if "passes" in r else ""
    meta = (f"one rank of EP={shape['ep']}: hidden {shape['hidden']}, moe_intermediate {shape['moe_intermediate']}, "
            f"{shape['experts']} experts, top-{shape['top_k']}; vLLM's {r['isa']} kernel in {r['dtype']}{host}{passes}")
    composite = "composite" in r.get("passes", "") or "composite_overhead_ratio" not in r["runs"][0]
    runs = table(["T", "local pairs", "op ms", "ideal ms", "op / ideal (per round)", f"<= {r['target']}"]
                 + ([] if composite else ["composite / ideal"]),
                 [[x["tokens"], x["local_pairs"], round(x["op_s"] * 1e3, 3), round(x["ideal_s"] * 1e3, 3),
                   f"{x['overhead_ratio']} ({', '.join(str(q) for q in x['per_round_ratios'])})",
                   x["overhead_ratio"] <= r["target"]] + ([] if composite else [x["composite_overhead_ratio"]])
                  for x in r["runs"]])
    return f"{meta}\n\n{runs}"


def render_chaos(r: dict) -> str:
    totals = table(["faults (by kind)", "seconds", "requests answered / unanswered", "answered twice", "mismatches",
                    "recompiles", "detection max s (bound)", "detection to serving max s (bound)", "failed"],
                   [[f"{r['faults']} ({', '.join(f'{k} {n}' for k, n in sorted(r['faults_by_kind'].items()))})",
                     r["seconds"], f"{r['requests_answered']} / {r['requests_unanswered']}", r["requests_duplicated"],
                     r["output_mismatches"], r["recompiles"],
                     f"{r['detection_s_max']} ({r['detect_bound_s']})",
                     f"{r['detection_to_serving_s_max']} ({r['serve_bound_s']})", len(r["failed"])]])
    return f"seed {r['seed']}\n\n{totals}"


def render_gpu(r: dict) -> str:
    intro = f"{r['device']}, torch {r['torch']}, CUDA kernel {r.get('cuda_kernel')}"
    return intro + "\n\n" + table(["stage", "status", "seconds"],
                                  [[name, e["status"], e.get("seconds")] for name, e in r["stages"].items()])


RENDERERS = {"run": render_run, "bench": render_bench, "data_plane": render_bench, "data_plane_cpp_wrapper": render_bench,
             "routing_ops": render_routing_ops, "op_in_step": render_op_in_step, "commit": render_commit,
             "transfer_planning": render_transfer_planning, "policy_stall": render_policy_stall,
             "movement": render_movement, "injected_work": render_injected_work, "elastic": render_elastic,
             "elastic_fault": render_elastic, "elastic_fault_rank0": render_elastic,
             "elastic_control": render_elastic_control, "chaos_1": render_chaos, "chaos_2": render_chaos,
             "chaos_3": render_chaos, "vllm_eplb": render_vllm_eplb, "kept_placement": render_kept_placement,
             "vllm_elastic": render_vllm_elastic, "vllm_elastic_2_4_2": render_vllm_elastic,
             "local_pairs": render_local_pairs, "gpu": render_gpu}
TITLES = {
    "run": "`make run` (`eplb-graph run`: 2 ranks, compiled, live EPLB, outputs checked every step)",
    "bench": "`eplb-graph bench` (capture vs eager, EPLB off / on_idle / on_rearranging)",
    "data_plane": "`eplb-graph bench --data-plane` (the routing op alone, one process, no vLLM)",
    "data_plane_cpp_wrapper": "`eplb-graph bench --data-plane --mode compiled --cpp-wrapper`",
    "routing_ops": "`bench_routing_ops.py` (the registered op against the same math inline)",
    "op_in_step": "`bench_op_in_step.py` (one routing-op call right after a compiled step)",
    "commit": "`bench_commit.py` (a layer commit as upstream ships it, and under the capability adaptations)",
    "transfer_planning": "`bench_transfer_planning.py` (the async worker's per-layer transfer planning)",
    "policy_stall": "`bench_policy_stall.py` (a main-thread step beside upstream's policy, in-thread or in a helper)",
    "movement": "`bench_movement.py` (Gloo-staged movement, commit cost, sync vs async rearrangement)",
    "injected_work": "`bench_injected_work.py` (what host work after each router costs a multi-rank step)",
    "elastic": "`eplb-graph run --scale-plan 2,4,2` (elastic EP: resized while serving, compiled)",
    "elastic_fault": "`eplb-graph run --scale-plan 2,4,4 --kill 3@150` (a member SIGKILLed, then replaced)",
    "elastic_fault_rank0": "`eplb-graph run --scale-plan 2,4,4 --kill 0@150` (rank 0 SIGKILLed: the next survivor takes its place)",
    "elastic_control": "`bench_elastic_control.py` (an elastic step against a fixed one; serving control against requests served)",
    "chaos_1": "`eplb-graph run --chaos 1` (resizes, kills, stops, hangs under traffic)",
    "chaos_2": "`eplb-graph run --chaos 2`",
    "chaos_3": "`eplb-graph run --chaos 3`",
    "vllm_eplb": "`bench_vllm_eplb.py` (vLLM EP over TP=2 or DP=2 workers on a skewed router: rebalanced against static placement)",
    "kept_placement": "`bench_kept_placement.py` (vLLM TP=2 + EP: the first windows from a cold start and from a kept placement)",
    "vllm_elastic": "`bench_vllm_elastic.py` (vLLM's own elastic EP through the plugin: each resize under a stream)",
    "vllm_elastic_2_4_2": "`bench_vllm_elastic.py --sizes 2 4 2` (the same, to the largest group and back)",
    "local_pairs": "`bench_local_pairs.py` (`local_expert_pairs` against the same kernel on the pre-compacted local rows)",
    "gpu": "`gpu_bench.py` on a lent GPU",
}
