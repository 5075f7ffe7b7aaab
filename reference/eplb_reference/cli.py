"""The reference runtime's commands of `eplb-graph`: demo, run (and run --scale-plan / --chaos), serve,
join, bench. They reach `eplb-graph` as entry points of its ``eplb_graph.commands`` group
(``eplb_graph/tools/cli.py``), each handed the whole command line.

Each subcommand's flags and its handler sit side by side, so `--help` and the code agree;
each handler only builds a config and calls its runtime module (``rank``, ``bench``). The
flags the runtime commands share are ``cli_flags``'s, the elastic ones ``elastic/cli.py``'s."""

from __future__ import annotations

import argparse
import json
import sys

from eplb_graph.tools.cli import output_dir
from eplb_reference.runtime.cli_flags import add_runtime_arguments, run_config


def _demo(args: argparse.Namespace) -> int:
    from eplb_reference.runtime.demo import report_dict, run_demo

    report = run_demo(
        num_logical=args.experts,
        num_redundant_experts=args.redundant,
        ranks=args.ranks,
        steps=args.steps,
        backend=args.backend,
    )
    if args.json:
        print(json.dumps(report_dict(report), indent=2))
    else:
        print(
            f"router compiled ({args.backend}, fullgraph) in {report.compile_s:.1f} s: "
            f"{report.num_logical_experts} logical -> {report.num_physical_experts} physical experts "
            f"over {report.ranks} ranks\n"
            f"balancedness (mean/max rank load) before rebalance: {report.balancedness_before:.3f}\n"
            f"balancedness after upstream DefaultEplbPolicy + in-place refresh: {report.balancedness_after:.3f}\n"
            f"recompiles after refresh: {report.recompiles}; lookup data_ptr stable: "
            f"{report.lookup_data_ptr_stable}; every token routed to a slot hosting its expert: "
            f"{report.routed_only_to_hosting_slots}"
        )
    ok = report.recompiles == 0 and report.lookup_data_ptr_stable and report.routed_only_to_hosting_slots
    return 0 if ok else 1


def _check_cpp_wrapper_modes(config, modes: tuple[str, ...]) -> None:
    if config.cpp_wrapper and set(modes) == {"eager"}:
        raise ValueError("--cpp-wrapper applies to what Inductor compiles; --mode eager compiles nothing")


def _or_na(value, missing: str = "n/a") -> str:
    return missing if value is None else str(value)


def _run(args: argparse.Namespace) -> int:
    import os

    from eplb_reference.runtime.groups import shutdown_expert_parallel
    from eplb_reference.runtime.launch import run_ranks
    from eplb_reference.runtime.report import failed_invariants, summarize, write_plots
    from eplb_reference.runtime.rank import run_rank, run_rank_and_shut_down

    if args.scale_plan is not None or args.chaos is not None:
        from eplb_reference.elastic.cli import run_elastic_command

        if args.placement_file is not None:
            raise ValueError("--placement-file keeps a fixed EP size's placement; it does not apply to --scale-plan "
                             "or --chaos, which resize the group")

        return run_elastic_command(args)
    config = run_config(args, progress=not args.json, tolerance=args.tolerance, placement_file=args.placement_file)
    _check_cpp_wrapper_modes(config, (config.mode,))
    out = output_dir(args.out)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: this process is one rank
        import torch.distributed as dist

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != config.ranks:
            raise ValueError(f"--ranks {config.ranks} but torchrun started {world} processes")
        mine = run_rank(rank, world, "env://", config)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        shutdown_expert_parallel()
        if rank != 0:
            return 0
        results = gathered
    else:
        results = run_ranks(run_rank_and_shut_down, config.ranks, config, timeout_s=args.timeout)
    report = summarize(config, results)
    problems = failed_invariants(report)
    report["failed_invariants"] = problems
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plots = write_plots(out, config, results)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{report['steps']} steps, {report['ranks']} ranks, mode {report['mode']}: balancedness without EPLB "
            f"{_or_na(report['balancedness_without_eplb'])}, before first rebalance {_or_na(report['balancedness_before'])}, "
            f"after {_or_na(report['balancedness_after'], 'n/a (no rearrangement finished)')}; "
            f"{report['rearrangements']} rearrangements, {report['layers_committed']} "
            f"layer commits; output mismatches {report['output_mismatches']} (max |diff| {report['max_abs_diff']:.2e}, "
            f"check {report['output_check']}); "
            f"recompiles {report['recompiles']}, recaptures {'n/a (no capture on this device)' if report['recaptures'] is None else report['recaptures']}; step p50 {report['step_p50_ms']} ms"
        )
        for path in [out / "report.json", *plots]:
            print(f"wrote {path}")
        for problem in problems:
            print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _log(line: str) -> None:
    """Progress on stderr: stdout holds only the table or the JSON."""
    print(line, file=sys.stderr, flush=True)


def _bench(args: argparse.Namespace) -> int:
    from eplb_reference.bench.capture_vs_eager import bench_modes, run_bench
    from eplb_reference.bench.stats import check_bench_steps
    from eplb_reference.bench.table import format_table, write_chart
    from eplb_reference.bench.data_plane import check_data_plane_config, run_data_plane_bench

    modes = bench_modes(args.mode, args.device)
    default_ranks = 1 if args.data_plane else 2
    config = run_config(args, mode=modes[0], ranks=default_ranks if args.ranks is None else args.ranks)
    _check_cpp_wrapper_modes(config, modes)
    if args.data_plane:
        check_data_plane_config(config)  # before --out is made
        out = output_dir(args.out)
        report = run_data_plane_bench(config, modes, log=_log)
    else:
        check_bench_steps(config.steps)
        out = output_dir(args.out)
        report = run_bench(config, modes, timeout_s=args.timeout, log=_log)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    chart = write_chart(out, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_table(report))
        print(f"wrote {out / 'bench.json'}\nwrote {chart}")
    for problem in report.get("failed_checks", []):
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if report.get("failed_checks") else 0


def build_parser() -> argparse.ArgumentParser:
    from eplb_reference.elastic import cli as elastic

    parser = argparse.ArgumentParser(prog="eplb-graph", description="Graph-mode EPLB for MoE inference")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="one compiled router layer rebalanced live, no recompiles")
    demo.add_argument("--experts", type=int, default=64)
    demo.add_argument("--redundant", type=int, default=16)
    demo.add_argument("--ranks", type=int, default=4)
    demo.add_argument("--steps", type=int, default=20)
    demo.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=_demo)

    run = commands.add_parser("run", help="the main job: multi-rank MoE runtime with live EPLB")
    add_runtime_arguments(run, steps=300)
    run.add_argument("--tolerance", type=float, default=None,
                     help="rtol = atol of the per-step output check, 0 = exact (default: exact in eager mode on "
                          "the host; compiled, the format's: 1e-5 unquantized, 1e-3 quantized)")
    run.add_argument("--placement-file", default=None, metavar="PATH",
                     help="start from the placement kept in PATH where it exists, and rewrite PATH as rearrangements "
                          "commit (docs/placement_file.md); a file that does not fit this run is refused")
    elastic.add_scale_plan_arguments(run)
    run.set_defaults(func=_run)

    served = commands.add_parser("serve", help="elastic EP server: greedy generation over HTTP, resizable at run time")
    add_runtime_arguments(served, steps=1, mode="eager")
    elastic.add_serve_arguments(served)
    served.set_defaults(func=lambda args: elastic.serve_command(args))

    join = commands.add_parser("join", help="a member of an elastic run started outside its coordinator: joins as a spare")
    elastic.add_join_arguments(join)
    join.set_defaults(func=lambda args: elastic.join_command(args))

    bench = commands.add_parser("bench", help="step latency: eager vs compiled, EPLB off / on-idle / rearranging")
    add_runtime_arguments(bench, steps=120, mode="all", interval=10, ranks=None)
    bench.add_argument("--data-plane", action="store_true",
                       help="EPLB's data plane alone, no vLLM needed: one process, EP size 1, EPLB off vs the routing "
                            "op at identity placement (no control plane, no rearrangement); checks that the op's "
                            "outputs equal off's and that it recorded every token")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from eplb_reference.runtime.launch import RankFailure

    try:
        return args.func(args)
    except ValueError as error:
        print(f"eplb-graph: error: {error}", file=sys.stderr)
        return 2
    except RankFailure as error:
        print(f"eplb-graph: {error}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # run_ranks has stopped every rank by now
        print("eplb-graph: interrupted; every rank process stopped, nothing written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
