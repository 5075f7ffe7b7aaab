"""The elastic EP part of the `eplb-graph` command line: `run --scale-plan` and `serve`.

``cli`` owns the parser and the flags every runtime command shares; this adds the elastic
flags, and handlers that only check what the elastic runtime cannot take and call
``elastic_run`` / ``elastic_http``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from eplb_graph.runtime.config import RunConfig


def add_scale_plan_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--scale-plan", default=None, metavar="N,M[,...]",
                     help="elastic EP: start at N ranks and resize to each next size at evenly spaced steps")
    run.add_argument("--max-ranks", type=int, default=None,
                     help="with --scale-plan: the largest EP size tables and graphs are sized for (default: the plan's)")
    run.add_argument("--resize-deadline", type=float, default=30.0, metavar="S",
                     help="with --scale-plan: a resize not switched this long after its request is given up")
    run.add_argument("--kill", action="append", default=[], metavar="MEMBER@STEP",
                     help="with --scale-plan: SIGKILL member MEMBER once the group served STEP (the survivors recover)")


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--max-ranks", type=int, default=None, help="the largest EP size (default: --ranks)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--resize-deadline", type=float, default=30.0, metavar="S",
                       help="a resize not switched this long after its request is given up")


def _check_host_only(config: RunConfig, what: str) -> None:
    if config.cpp_wrapper or config.policy_process or config.device != "cpu":
        raise ValueError(f"{what} runs on the host (device cpu) without --cpp-wrapper or --policy-process")


def run_scale_plan(args: argparse.Namespace, plan: tuple[int, ...], config: RunConfig,
                   output_dir: Callable[[], Path]) -> int:
    """``run --scale-plan``: the runtime resized at fixed steps (``elastic_run``); the exit code.
    ``output_dir`` creates --out, once the flags are known to be good."""
    from eplb_graph.runtime.elastic_report import write_elastic_report
    from eplb_graph.runtime.elastic_run import parse_kills, run_elastic

    _check_host_only(config, "--scale-plan")
    max_ranks = max(plan) if args.max_ranks is None else args.max_ranks
    kills = parse_kills(args.kill)
    out = output_dir()
    raw = run_elastic(config, plan, max_ranks, deadline_s=args.resize_deadline, timeout_s=args.timeout, kills=kills)
    return write_elastic_report(out, config, plan, max_ranks, raw, as_json=args.json)


def serve_command(args: argparse.Namespace, config: RunConfig) -> int:
    """``serve``: the reference decoder as an elastic greedy-generation server (``elastic_http``)."""
    from eplb_graph.runtime.elastic_http import serve
    from eplb_graph.runtime.elastic_server import ElasticServer

    _check_host_only(config, "serve")
    max_ranks = config.ranks if args.max_ranks is None else args.max_ranks
    server = ElasticServer(config, max_ranks, deadline_s=args.resize_deadline)
    print(f"eplb-graph serve: {config.ranks} EP ranks (up to {max_ranks}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    serve(server, args.host, args.port)
    return 0
