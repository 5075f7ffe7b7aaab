"""The `eplb-graph` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    from eplb_graph.demo import report_dict, run_demo

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
    from pathlib import Path

    from eplb_graph.inspect import build_report, format_text, inspect_model, write_outputs

    handle, record = inspect_model(args.model, args.backend, args.redundant)
    report = build_report(args.model, args.backend, handle, record)
    written = write_outputs(Path(args.out), report, record) if args.out else []
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_text(report, record))
        for path in written:
            print(f"wrote {path}")
    return 0 if report["verifier_ok"] and not report["unattributed"] else 1


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"eplb-graph: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
