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

from eplb_reference.bench.result_tables import RENDERERS, TITLES, table, vllm_eplb_headline

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
    "vllm_eplb": "bench_vllm_eplb.json",
    "kept_placement": "bench_kept_placement.json",
    "vllm_elastic": "bench_vllm_elastic.json",
    "vllm_elastic_2_4_2": "bench_vllm_elastic_2_4_2.json",
    "local_pairs": "bench_local_pairs.json",
    "gpu": "gpu_bench.json",
}
assert set(FILES) == set(RENDERERS) == set(TITLES), "each benchmark file has a renderer and a title"


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
        rows.append([f"layer commit, {largest['num_logical']} + {largest['num_redundant_experts']} experts: upstream / ours ms",
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
    rows += vllm_eplb_headline(record.get("vllm_eplb"))
    vllm_elastic = record.get("vllm_elastic")
    if vllm_elastic:
        arms = "; ".join(
            f"{arm}: " + ", ".join(f"{x['from']}->{x['to']} {x['request_to_serving_s']} ({x['pause_s']}; "
                                   f"{x['recompiles']})" for x in vllm_elastic["resizes"] if x["arm"] == arm)
            for arm in ("kept", "reset") if any(x["arm"] == arm for x in vllm_elastic["resizes"]))
        rows.append(["vLLM elastic EP, graphs kept / upstream's reset at the switch: request to serving, s (longest "
                     "pause; recompiles); kept / reset median pause (A/A)",
                     f"{arms}; {vllm_elastic.get('kept_over_reset_pause')} ({vllm_elastic.get('aa_ratio')})",
                     "kept / reset pause <= 0.5, 0 recompiles", "`bench_vllm_elastic.py`"])
    kept = record.get("kept_placement")
    if kept:
        rows.append([f"vLLM {kept['layout']} restart, skewed router: balancedness of the first window, cold -> from "
                     "the kept placement (the cold run converged)",
                     f"{kept['first_window_cold']} -> {kept['first_window_restored']} ({kept['converged_cold']})",
                     "restored ~ converged", "`bench_kept_placement.py`"])
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
