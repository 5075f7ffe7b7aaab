"""The `eplb-graph` command line: demo, inspect, run (and run --scale-plan), serve, bench.

Each subcommand's flags and its handler sit side by side, so `--help` and the code agree;
each handler only builds a config and calls its runtime module (``rank``, ``bench``; the
elastic flags and handlers are ``elastic_cli``'s). Longer than one reading because run's and
bench's output lines and the shared runtime flags live here with their subcommands."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    from eplb_graph.runtime.demo import report_dict, run_demo

    report = run_demo(
        num_logical=args.experts,
        num_redundant=args.redundant,
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


def _inspect(args: argparse.Namespace) -> int:
    from eplb_graph.inspect import build_report, format_text, inspect_model, write_outputs

    out = _output_dir(args.out) if args.out else None
    handle, record = inspect_model(args.model, args.backend, args.redundant)
    report = build_report(args.model, args.backend, handle, record)
    written = write_outputs(out, report, record) if out is not None else []
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_text(report, record))
        for path in written:
            print(f"wrote {path}")
    return 0 if report["verifier_ok"] and not report["unattributed"] else 1


def _output_dir(path: str):
    """--out, created now: a path that cannot hold the results fails before any process starts,
    not after the run."""
    import os
    from pathlib import Path

    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {path}: cannot create the output directory ({error.strerror})") from None
    if not os.access(out, os.W_OK):
        raise ValueError(f"--out {path}: the output directory is not writable")
    return out


def _run_config(args: argparse.Namespace, **overrides):
    from eplb_graph.runtime.config import RunConfig

    fields = dict(
        mode=args.mode, device=args.device, ranks=args.ranks, steps=args.steps, weight_format=args.format,
        num_experts=args.experts, num_redundant=args.redundant, top_k=args.top_k, num_layers=args.layers,
        seed=args.seed, step_interval=args.interval, window_size=args.interval, hidden=args.hidden,
        expert_intermediate=args.intermediate, shared_expert_intermediate=args.intermediate,
        decode_tokens=args.decode_tokens, prefill_tokens=args.prefill_tokens, capture_sizes=args.capture_sizes,
        policy_process=args.policy_process, expert_kernel=args.expert_kernel, cpp_wrapper=args.cpp_wrapper,
        threads=args.threads, stall_steps=args.stall_steps, stall_seconds=args.stall_seconds,
        backend="aot_eager" if args.device == "npu" else "inductor",  # Inductor has no NPU code generation
    )
    fields.update(overrides)
    config = RunConfig(**fields)
    config.validate()  # every bad input fails here, before a process starts
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
    return config


def _check_cpp_wrapper_modes(config, modes: tuple[str, ...]) -> None:
    if config.cpp_wrapper and set(modes) == {"eager"}:
        raise ValueError("--cpp-wrapper applies to what Inductor compiles; --mode eager compiles nothing")


def _or_na(value, missing: str = "n/a") -> str:
    return missing if value is None else str(value)


def _run(args: argparse.Namespace) -> int:
    import os

    from eplb_graph.runtime.groups import shutdown_expert_parallel
    from eplb_graph.runtime.launch import run_ranks
    from eplb_graph.runtime.report import failed_invariants, summarize, write_plots
    from eplb_graph.runtime.rank import run_rank, run_rank_and_shut_down

    if args.scale_plan is not None:
        return _run_elastic(args)
    config = _run_config(args, progress=not args.json, tolerance=args.tolerance)
    _check_cpp_wrapper_modes(config, (config.mode,))
    out = _output_dir(args.out)
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


def _run_elastic(args: argparse.Namespace) -> int:
    from eplb_graph.runtime.elastic_cli import run_scale_plan
    from eplb_graph.runtime.elastic_run import parse_scale_plan

    plan = parse_scale_plan(args.scale_plan)
    config = _run_config(args, ranks=plan[0], tolerance=args.tolerance)
    return run_scale_plan(args, plan, config, lambda: _output_dir(args.out))


def _serve(args: argparse.Namespace) -> int:
    from eplb_graph.runtime.elastic_cli import serve_command

    return serve_command(args, _run_config(args, steps=1))


def _log(line: str) -> None:
    """Progress on stderr: stdout holds only the table or the JSON."""
    print(line, file=sys.stderr, flush=True)


def _bench(args: argparse.Namespace) -> int:
    from eplb_graph.bench.capture_vs_eager import bench_modes, run_bench
    from eplb_graph.bench.stats import check_bench_steps
    from eplb_graph.bench.table import format_table, write_chart
    from eplb_graph.bench.data_plane import check_data_plane_config, run_data_plane_bench

    modes = bench_modes(args.mode, args.device)
    default_ranks = 1 if args.data_plane else 2
    config = _run_config(args, mode=modes[0], ranks=default_ranks if args.ranks is None else args.ranks)
    _check_cpp_wrapper_modes(config, modes)
    if args.data_plane:
        check_data_plane_config(config)  # before --out is made
        out = _output_dir(args.out)
        report = run_data_plane_bench(config, modes, log=_log)
    else:
        check_bench_steps(config.steps)
        out = _output_dir(args.out)
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


def _capture_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 16,64, got {text!r}") from None
    return sizes


def _add_runtime_arguments(parser: argparse.ArgumentParser, *, steps: int, mode: str = "compiled",
                           interval: int = 20, ranks: int | None = 2) -> None:
    from eplb_graph.runtime.config import DEVICES, MODES

    choices = ", ".join(MODES) + (", all (every mode the device has)" if mode == "all" else "")
    parser.add_argument("--mode", default=mode, help=f"one of {choices}")
    parser.add_argument("--device", default="cpu", help=f"one of {', '.join(DEVICES)}")
    parser.add_argument("--ranks", type=int, default=ranks, help="EP ranks, one process each (default 2; bench --data-plane: 1)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--format", default="unquantized", help="unquantized | w8a8_dynamic | w4a8")
    parser.add_argument("--expert-kernel", default="pairs",
                        help="pairs: each (token, k) pair through its expert's gathered weights, work grows with the "
                             "pairs as in a fused MoE kernel; dense: every local expert over every token as GEMMs, "
                             "much faster at width, but redundant slots add work (use it for wide models, not for "
                             "EPLB-on / EPLB-off ratios)")
    parser.add_argument("--experts", type=int, default=16, help="logical experts per layer")
    parser.add_argument("--redundant", type=int, default=4, help="redundant experts per layer")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64, help="model width")
    parser.add_argument("--intermediate", type=int, default=64, help="routed and shared expert width")
    parser.add_argument("--decode-tokens", type=int, default=16, help="tokens per rank in a decode batch")
    parser.add_argument("--prefill-tokens", type=int, default=48,
                        help="tokens per rank in a prefill batch (a mixed batch: prefill + decode, capped by the largest "
                             "capture size)")
    parser.add_argument("--capture-sizes", type=_capture_sizes, default=(16, 64), metavar="N[,N...]",
                        help="batch sizes (tokens per rank) that batches are padded to, one graph each: 16,64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interval", type=int, default=interval,
                        help="EPLB step interval (= load window), in steps; bench: of its on_rearranging run")
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds a rank may go without finishing a step (its compile included) before it is "
                             "declared stuck, and may take to start (spawn, imports); a run may take any time as long "
                             "as its ranks keep stepping")
    parser.add_argument("--cpp-wrapper", action="store_true",
                        help="compiled mode on the host: Inductor generates the forward's wrapper in C++, so no Python "
                             "runs between its kernels or around the routing op (longer compile; --ranks 1 with "
                             "torch 2.13, whose collectives it cannot call)")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch intra-op threads per rank (default: on the host, the machine's cores shared among "
                             "its ranks; on a GPU, 1, as vLLM's GPU worker serves); the reports record the count used")
    parser.add_argument("--stall-steps", type=int, default=1000, metavar="N",
                        help="a rearrangement in flight this many steps with no layer committed is a stall (reported, "
                             "and the run fails; the last committed placement keeps serving)")
    parser.add_argument("--stall-seconds", type=float, default=300.0, metavar="S",
                        help="the same bound in seconds (whichever comes first)")
    parser.add_argument("--policy-process", action="store_true",
                        help="run upstream's rebalancing policy in a helper process per rank, off the serving GIL")
    parser.add_argument("--out", default="out")
    parser.add_argument("--json", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    from eplb_graph.runtime.elastic_cli import add_scale_plan_arguments, add_serve_arguments

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

    from eplb_graph.inspect import BACKENDS, MODELS

    inspect = commands.add_parser("inspect", help="compile a MoE model with the EPLB pass and show the graph")
    inspect.add_argument("--model", choices=MODELS, default="reference")
    inspect.add_argument("--backend", choices=BACKENDS, default="aot_eager")
    inspect.add_argument("--redundant", type=int, default=2, help="redundant experts per layer")
    inspect.add_argument("--out", help="directory for the full before/after graphs (text, HTML) and report.json")
    inspect.add_argument("--json", action="store_true", help="print the machine-readable report")
    inspect.set_defaults(func=_inspect)

    run = commands.add_parser("run", help="the main job: multi-rank MoE runtime with live EPLB")
    _add_runtime_arguments(run, steps=300)
    run.add_argument("--tolerance", type=float, default=None,
                     help="rtol = atol of the per-step output check, 0 = exact (default: exact in eager mode on "
                          "the host; compiled, the format's: 1e-5 unquantized, 1e-3 quantized)")
    add_scale_plan_arguments(run)
    run.set_defaults(func=_run)

    served = commands.add_parser("serve", help="elastic EP server: greedy generation over HTTP, resizable at run time")
    _add_runtime_arguments(served, steps=1, mode="eager")
    add_serve_arguments(served)
    served.set_defaults(func=_serve)

    bench = commands.add_parser("bench", help="step latency: eager vs compiled, EPLB off / on-idle / rearranging")
    _add_runtime_arguments(bench, steps=120, mode="all", interval=10, ranks=None)
    bench.add_argument("--data-plane", action="store_true",
                       help="EPLB's data plane alone, no vLLM needed: one process, EP size 1, EPLB off vs the routing "
                            "op at identity placement (no control plane, no rearrangement); checks that the op's "
                            "outputs equal off's and that it recorded every token")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from eplb_graph.runtime.launch import RankFailure

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
