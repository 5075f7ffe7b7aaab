"""The `eplb-graph` command line: the product's commands, and those a second distribution adds.

The product's own commands (``doctor``, ``inspect``) are defined here and import nothing outside
``eplb_graph``. The reference runtime's commands (``run``, ``serve``, ``join``, ``bench``, ``demo``)
are entry points of the ``eplb_graph.commands`` group (``reference/pyproject.toml``): each gets the
whole command line and is loaded only when it is the command asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

COMMANDS_GROUP = "eplb_graph.commands"
# Named so that asking for one without the reference runtime installed says what to install.
REFERENCE_COMMANDS = ("run", "serve", "join", "bench", "demo")


def output_dir(path: str) -> Path:
    """--out, created now: a path that cannot hold the results fails before any work starts,
    not after it."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"--out {path}: cannot create the output directory ({error.strerror})") from None
    if not os.access(out, os.W_OK):
        raise ValueError(f"--out {path}: the output directory is not writable")
    return out


def _inspect(args: argparse.Namespace) -> int:
    from eplb_graph.tools.inspect import build_report, format_text, inspect_model, write_outputs

    out = output_dir(args.out) if args.out else None
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


def _doctor(args: argparse.Namespace) -> int:
    from eplb_graph.tools.doctor import doctor_command

    return doctor_command(args)


def added_commands() -> dict[str, EntryPoint]:
    """Commands other installed distributions add to `eplb-graph`, by name (not loaded)."""
    return {point.name: point for point in entry_points(group=COMMANDS_GROUP)}


def build_parser(added: dict[str, EntryPoint] | None = None) -> argparse.ArgumentParser:
    from eplb_graph.tools.inspect import BACKENDS, model_names

    parser = argparse.ArgumentParser(prog="eplb-graph", description="Graph-mode EPLB for MoE inference")
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="compile a MoE model with the EPLB pass and show the graph")
    inspect.add_argument("--model", choices=model_names(), default="qwen3_moe")
    inspect.add_argument("--backend", choices=BACKENDS, default="aot_eager")
    inspect.add_argument("--redundant", type=int, default=2, help="redundant experts per layer")
    inspect.add_argument("--out", help="directory for the full before/after graphs (text, HTML) and report.json")
    inspect.add_argument("--json", action="store_true", help="print the machine-readable report")
    inspect.set_defaults(func=_inspect)

    doctor = commands.add_parser("doctor", help="before serving: whether eplb-graph's upstream adaptations hold on "
                                                "this stack, which kernels exist, what EPLB can serve here")
    output = doctor.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="the machine-readable report")
    output.add_argument("--markdown", action="store_true",
                        help="the adaptations as the table in docs/architecture.md, nothing checked")
    doctor.set_defaults(func=_doctor)

    for name, point in sorted((added or {}).items()):  # listed for --help; dispatched before parsing
        commands.add_parser(name, help=f"from {point.dist.name if point.dist else point.value}: "
                                       f"eplb-graph {name} --help", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    added = added_commands()
    if argv and argv[0] in added:
        return added[argv[0]].load()(argv)
    if argv and argv[0] in REFERENCE_COMMANDS:
        print(f"eplb-graph: error: '{argv[0]}' is a command of the reference runtime, which is not installed "
              f"(from a checkout: pip install -e reference)", file=sys.stderr)
        return 2
    args = build_parser(added).parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:
        print(f"eplb-graph: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
