"""benchmarks/RESULTS.md and the README's results table, written from the benchmarks' JSON.

    python benchmarks/results.py record out/bench    # after `make bench`: keep its JSON, dated
    python benchmarks/results.py render              # RESULTS.md + README table from every record
    python benchmarks/results.py render --check      # exit 1 if either differs from the records

A record is a folder ``benchmarks/results/<date>/`` holding the JSON files ``make bench`` wrote
and ``meta.json`` (date, machine, versions, commit). Nothing in RESULTS.md or the README table
is typed by hand, so a figure there is always one a benchmark wrote (``tests/benchmarks/
test_results.py`` holds both to the records).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from eplb_graph.bench.breakdown import breakdown_cells

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "benchmarks" / "results"
RESULTS_MD = ROOT / "benchmarks" / "RESULTS.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- results:begin (benchmarks/results.py render) -->", "<!-- results:end -->"
# what `make bench` writes, relative to its output folder, in the order RESULTS.md shows them
FILES = {
    "run": "run/report.json",
    "bench": "bench/bench.json",
    "data_plane": "bench_data_plane/bench.json",
    "data_plane_cpp_wrapper": "bench_data_plane_cpp_wrapper/bench.json",
    "routing_ops": "bench_routing_ops.json",
    "op_in_step": "bench_op_in_step.json",
    "commit": "bench_commit.json",
    "transfer_planning": "bench_transfer_planning.json",
    "policy_stall": "bench_policy_stall.json",
    "movement": "bench_movement.json",
    "injected_work": "bench_injected_work.json",
    "elastic": "elastic/report.json",
    "elastic_fault": "elastic_fault/report.json",
    "elastic_fault_rank0": "elastic_fault_rank0/report.json",
    "elastic_control": "bench_elastic_control.json",
    "chaos_1": "chaos_1/chaos.json",
    "chaos_2": "chaos_2/chaos.json",
    "chaos_3": "chaos_3/chaos.json",
    "gpu": "gpu_bench.json",
}


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
                 [[f"{x['num_logical']} + {x['num_redundant']}", x["commit_upstream_p50_ms"], x["commit_adapter_p50_ms"],
                   x["commit_upstream_over_adapter"], f"{x['inversion_upstream_p50_ms']} / {x['inversion_adapter_p50_ms']}"]
                  for x in r["results"]])


def render_transfer_planning(r: dict) -> str:
    return table(["experts x ranks", "move_to_buffer as shipped p50 ms", "under the adapter p50 ms", "ratio",
                  "sends + receives posted"],
                 [[f"{x['num_logical']} + {x['num_redundant']} x {x['ranks']}", x["plan_upstream_p50_ms"],
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
             "chaos_3": render_chaos, "gpu": render_gpu}
TITLES = {
    "run": "`make run` (`eplb-graph run`: 2 ranks, compiled, live EPLB, outputs checked every step)",
    "bench": "`eplb-graph bench` (capture vs eager, EPLB off / on_idle / on_rearranging)",
    "data_plane": "`eplb-graph bench --data-plane` (the routing op alone, one process, no vLLM)",
    "data_plane_cpp_wrapper": "`eplb-graph bench --data-plane --mode compiled --cpp-wrapper`",
    "routing_ops": "`bench_routing_ops.py` (the registered op against the same math inline)",
    "op_in_step": "`bench_op_in_step.py` (one routing-op call right after a compiled step)",
    "commit": "`bench_commit.py` (a layer commit as upstream ships it, and under the capability adapter)",
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
    "gpu": "`gpu_bench.py` on a lent GPU",
}


# --- records -------------------------------------------------------------------------------


def load_record(folder: Path) -> dict:
    record = {"meta": json.loads((folder / "meta.json").read_text()), "notes": {}}
    for name, relative in FILES.items():
        path = folder / relative
        if path.exists():
            record[name] = json.loads(path.read_text())
        note = folder / "notes" / f"{name}.md"  # a reading of that run, written beside its JSON
        if note.exists():
            record["notes"][name] = note.read_text().strip()
    return record


def records() -> list[tuple[str, dict]]:
    """Every record, newest first."""
    folders = sorted((p for p in RECORDS.iterdir() if (p / "meta.json").exists()), reverse=True) if RECORDS.exists() else []
    return [(folder.name, load_record(folder)) for folder in folders]


def added_by_rearranging(ratios: dict) -> dict | None:
    """Per phase, the rearranging steps' mean less the steady steps' (ms), from a mode's breakdown."""
    breakdown = ratios.get("step_breakdown") or {}
    rearranging, steady = breakdown.get("rearranging"), breakdown.get("steady")
    if not rearranging or not steady:
        return None
    return {phase: round(rearranging[phase]["mean"] - steady[phase]["mean"], 2) for phase in rearranging if phase != "steps"}


def headline(record: dict) -> str:
    """The README's one results table: the figures the project's targets name, from one record."""
    rows = []
    run, bench, plane, ops, commit = (record.get(k) for k in ("run", "bench", "data_plane", "routing_ops", "commit"))
    if run:
        rows.append(["balancedness (mean / max rank load), without EPLB -> after the first rebalance",
                     f"{run['balancedness_without_eplb']} -> {run['balancedness_after']}", ">= 0.95", "`make run`"])
        rows.append(["rearrangements / recompiles / output mismatches",
                     f"{run['rearrangements']} / {run['recompiles']} / {run['output_mismatches']}", "- / 0 / 0", "`make run`"])
    if bench:
        compiled = bench["ratios"].get("compiled", {})
        rows.append(["compiled decode step, EPLB on (idle) / off (A/A)",
                     f"{compiled.get('on_idle_over_off')} ({compiled.get('off_twin_over_off')})", "<= 1.05", "`eplb-graph bench`"])
        rows.append(["rearranging p99 / steady p50 (the steady steps' own p99 / p50)",
                     f"{compiled.get('rearranging_p99_over_steady_p50')} ({compiled.get('steady_p99_over_steady_p50')})",
                     "<= 1.15", "`eplb-graph bench`"])
        rows.append(["graph (compiled) speedup over eager, decode", f"{bench['ratios'].get('graph_speedup_over_eager_decode')}x",
                     "> 1", "`eplb-graph bench`"])
        added = added_by_rearranging(compiled)
        if added:
            rows.append(["compiled: what a rearranging step adds over a steady one, mean ms: EPLB ours / upstream "
                         "(of it its ready all-reduce + rearrange()) / wait for the slower rank / forward; the worker's CPU",
                         f"{added['eplb_ours_ms']} / {added['eplb_upstream_ms']} "
                         f"({added['upstream_ready_sync_ms'] + added['upstream_rearrange_ms']:.2f}) / "
                         f"{added['collective_wait_ms']} / {added['forward_rest_ms']}; {added['worker_cpu_ms']}",
                         "-", "`eplb-graph bench`"])
    if plane:
        compiled = plane["ratios"].get("compiled", {})
        rows.append(["routing op alone: compiled EPLB on / off, one process (A/A)",
                     f"{compiled.get('on_idle_over_off')} ({compiled.get('off_twin_over_off')})", "<= 1.05",
                     "`eplb-graph bench --data-plane`"])
    if ops:
        t16 = next((x for x in ops["results"] if x["num_tokens"] == 16), None)
        if t16:
            rows.append(["registered op / inline math, T=16", t16["ratio"], "<= 1.5", "`bench_routing_ops.py`"])
    if commit:
        largest = commit["results"][-1]
        rows.append([f"layer commit, {largest['num_logical']} + {largest['num_redundant']} experts: upstream / ours ms",
                     f"{largest['commit_upstream_p50_ms']} / {largest['commit_adapter_p50_ms']}", "-", "`bench_commit.py`"])
    elastic = record.get("elastic")
    if elastic:
        worst = max(elastic["resizes"], key=lambda x: x["reconfiguration_seconds"] or 0.0)
        rows.append(["elastic resize 2 -> 4 -> 2: request to serving at the new size, s (longest pause)",
                     f"{worst['reconfiguration_seconds']} ({max(x['serving_pause_seconds'] for x in elastic['resizes'])})",
                     "<= 5 (<= 0.5)", "`eplb-graph run --scale-plan 2,4,2`"])
        rows.append(["elastic: recompiles / lost / duplicated / mismatches (EPLB rearrangements between resizes)",
                     f"{elastic['recompiles']} / {elastic['requests_lost']} / {elastic['requests_duplicated']} / "
                     f"{elastic['output_mismatches']} ({elastic.get('eplb_rearrangements_finished', 'not run')})",
                     "0 / 0 / 0 / 0", "`eplb-graph run --scale-plan 2,4,2`"])
    for key, who, kill in (("elastic_fault", "a member", "3@150"), ("elastic_fault_rank0", "rank 0", "0@150")):
        fault = record.get(key)
        recovery = next((x for x in fault["resizes"] if x["kind"] == "recovery"), None) if fault else None
        if recovery:
            rows.append([f"{who} killed (1 of 4): death to serving again, s / lost / mismatches",
                         f"{recovery['reconfiguration_seconds']} / {fault['requests_lost']} / {fault['output_mismatches']}",
                         "<= 5 / 0 / 0", f"`eplb-graph run --scale-plan 2,4,4 --kill {kill}`"])
    chaos = [record[key] for key in ("chaos_1", "chaos_2", "chaos_3") if key in record]
    if chaos:
        seeds = ", ".join(str(r["seed"]) for r in chaos)
        rows.append([f"chaos (seeds {seeds}): faults / requests unanswered or answered twice / mismatches / recompiles",
                     f"{' + '.join(str(r['faults']) for r in chaos)} / "
                     f"{sum(r['requests_unanswered'] + r['requests_duplicated'] for r in chaos)}"
                     f" / {sum(r['output_mismatches'] for r in chaos)} / {sum(r['recompiles'] for r in chaos)}",
                     ">= 20 each / 0 / 0 / 0", "`eplb-graph run --chaos SEED`"])
        rows.append(["chaos: a fault to its detection, max s (bound); detection to serving again, max s (bound)",
                     f"{max(r['detection_s_max'] or 0 for r in chaos)} ({chaos[0]['detect_bound_s']}); "
                     f"{max(r['detection_to_serving_s_max'] or 0 for r in chaos)} ({chaos[0]['serve_bound_s']})",
                     "within bounds", "`eplb-graph run --chaos SEED`"])
    control = record.get("elastic_control")
    if control:
        fixed, serving = control["fixed_vs_elastic"], control["serving"]
        rows.append(["elastic step / fixed step, same workload (fixed A/A); serving control, last / first fifth of "
                     f"{serving['requests']} requests",
                     f"{fixed['elastic_over_fixed']} ({fixed['fixed_a_over_a']}); {serving['last_over_first']}",
                     "- ; ~1 (O(1))", "`bench_elastic_control.py`"])
    gpu = record.get("gpu")
    rows.append(["GPU (CUDA graphs, Triton kernel)", "not measured yet: no GPU has been lent" if gpu is None
                 else f"{sum(e['status'] == 'ok' for e in gpu['stages'].values())} of {len(gpu['stages'])} stages ok",
                 "-", "`gpu_bench.py`"])
    return table(["measure", "figure", "target", "benchmark"], rows)


def render_results_md() -> str:
    parts = ["# Measured results\n\nWritten by `python benchmarks/results.py render` from the JSON records in "
             "`benchmarks/results/` (newest first); `make bench` measures, `results.py record` keeps a run. "
             "Ratios are taken side by side in one run; on these shared 2-core machines read each beside its "
             "A/A row.\n"]
    for date, record in records():
        meta = record["meta"]
        parts.append(f"## {date}: {meta['machine']}, torch {meta['torch']}, vLLM {meta['vllm']}, commit {meta['commit']}\n")
        for name in FILES:
            if name in record:
                commit = meta.get("commits", {}).get(name)
                at = f" (recorded later, at commit {commit})" if commit else ""
                note = f"\n\n{record['notes'][name]}" if name in record["notes"] else ""
                parts.append(f"### {TITLES[name]}{at}\n\n{RENDERERS[name](record[name])}{note}\n")
    return "\n".join(parts)


def newest_of_each(found: list[tuple[str, dict]]) -> tuple[dict, list[str]]:
    """Each benchmark's newest record (a later record of some benchmarks leaves the others' figures),
    and the dates they come from."""
    merged, dates = {}, {}
    for date, record in reversed(found):  # oldest first: a newer one replaces it
        for name in FILES:
            if name in record:
                merged[name], dates[name] = record[name], date
    return merged, sorted(set(dates.values()))


def render_readme(readme: str) -> str:
    found = records()
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"results: README.md has no {BEGIN} ... {END} section")
    merged, dates = newest_of_each(found)
    body = (f"Measured {' and '.join(dates)} ({found[0][1]['meta']['machine']}), each figure from the newest record "
            f"that has it; every figure and its run in [benchmarks/RESULTS.md](benchmarks/RESULTS.md).\n\n"
            f"{headline(merged)}") if found else "No record yet."
    head, rest = readme.split(BEGIN, 1)
    return f"{head}{BEGIN}\n{body}\n{END}{rest.split(END, 1)[1]}"


def record_run(out: Path) -> Path:
    """Copies what ``make bench`` wrote under ``out`` into a dated record with its meta.json."""
    present = {name: out / rel for name, rel in FILES.items() if (out / rel).exists()}
    if not present:
        raise SystemExit(f"results: no benchmark JSON under {out} (run make bench first)")
    date = time.strftime("%Y-%m-%d")
    folder = RECORDS / date
    for name, path in present.items():
        target = folder / FILES[name]
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    import torch

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = "absent"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    meta = {"date": date, "machine": f"{os.cpu_count()} cores, {platform.machine()}, {platform.processor() or 'cpu'}",
            "torch": torch.__version__, "vllm": vllm_version, "commit": commit or "unknown"}
    meta_path = folder / "meta.json"
    if meta_path.exists():
        # a later run into a day's record: what it did not replace keeps its commit, what it did says its own
        kept = json.loads(meta_path.read_text())
        others = [name for name, rel in FILES.items() if name not in present and (folder / rel).exists()]
        if others and kept.get("commit") != meta["commit"]:
            kept.setdefault("commits", {}).update({name: meta["commit"] for name in present})
            meta = kept
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return folder


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    record = commands.add_parser("record", help="keep what make bench wrote as today's record")
    record.add_argument("out", type=Path)
    render = commands.add_parser("render", help="write RESULTS.md and the README's table from the records")
    render.add_argument("--check", action="store_true", help="only compare; exit 1 where a file is stale")
    args = parser.parse_args(argv)
    if args.command == "record":
        print(f"recorded {record_run(args.out)}")
        return 0
    wanted = {RESULTS_MD: render_results_md(), README: render_readme(README.read_text())}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"results: {shown(path)} is not what the records say; run python benchmarks/results.py render",
                  file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
