"""The elastic EP part of the `eplb-graph` command line: `run --scale-plan`, `run --chaos`, `serve`, `join`.

``runtime/cli.py`` owns the parser; this adds the elastic flags, and handlers that check what
the elastic runtime cannot take, then call it. Every elastic event is logged on stderr under
``eplb_graph.elastic`` (one line each, with its generation and members).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from eplb_graph.tools.cli import output_dir
from eplb_reference.runtime.cli_flags import run_config
from eplb_reference.runtime.config import RunConfig


def add_elastic_arguments(parser: argparse.ArgumentParser) -> None:
    """What every elastic command shares."""
    parser.add_argument("--resize-deadline", type=float, default=30.0, metavar="S",
                        help="a resize not switched this long after it may switch is given up")
    parser.add_argument("--hang-timeout", type=float, default=10.0, metavar="S",
                        help="a member silent (no keep-alive) or with its main thread still this long is fenced "
                             "(killed) and recovered from as a death; a few seconds above the slowest step")


def add_scale_plan_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--scale-plan", default=None, metavar="N,M[,...]",
                     help="elastic EP: start at N ranks and resize to each next size at evenly spaced steps")
    run.add_argument("--max-ranks", type=int, default=None,
                     help="with --scale-plan or --chaos: the largest EP size tables and graphs are sized for")
    run.add_argument("--kill", action="append", default=[], metavar="MEMBER@STEP",
                     help="with --scale-plan: SIGKILL member MEMBER once the group served STEP (the survivors recover)")
    run.add_argument("--chaos", type=int, default=None, metavar="SEED",
                     help="elastic EP under chaos: a serving group under continuous traffic, resized, killed, stopped "
                          "and hung at random (seeded); passes only if nothing is lost, duplicated or wrong")
    run.add_argument("--faults", type=int, default=20, help="with --chaos: how many faults to inject")
    add_elastic_arguments(run)


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--max-ranks", type=int, default=None, help="the largest EP size (default: --ranks)")
    serve.add_argument("--host", default="127.0.0.1", help="the HTTP API's address")
    serve.add_argument("--store-host", default="127.0.0.1",
                       help="the address the coordinator's store listens on, for members (`join --store`) on "
                            "other machines: it steers the group, keep it on a network only they reach")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="a file (mode 600) holding the key every route but /health and /metrics needs "
                            "(Authorization: Bearer KEY); or set EPLB_GRAPH_API_KEY")
    serve.add_argument("--max-concurrency", type=int, default=64, metavar="N",
                       help="requests that generate or resize at once; one more is answered 503")
    serve.add_argument("--store-port", type=int, default=0,
                       help="the coordinator's TCP store port, for `eplb-graph join` (default: any free port, logged)")
    serve.add_argument("--secret-file", default=None, metavar="PATH",
                       help="the run's secret (mode 600): read if PATH exists, else generated and written there for "
                            "`join --secret-file` on other machines; or set EPLB_GRAPH_RUN_SECRET. Without either, "
                            "a secret in memory: only the members serve starts can join")
    add_elastic_arguments(serve)


def add_join_arguments(join: argparse.ArgumentParser) -> None:
    join.add_argument("--store", required=True, metavar="HOST:PORT", help="the coordinator's TCP store")
    join.add_argument("--name", default="ep", help="the run's name in the store")
    join.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the store and the run's spec")
    join.add_argument("--secret-file", default=None, metavar="PATH",
                      help="the run's secret (the file `serve --secret-file` wrote, copied with mode 600); or set "
                           "EPLB_GRAPH_RUN_SECRET")


def log_to_stderr() -> None:
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("eplb_graph.elastic").setLevel(logging.INFO)


def _check(config: RunConfig, args: argparse.Namespace, what: str) -> None:
    if config.cpp_wrapper or config.policy_process or config.device != "cpu":
        raise ValueError(f"{what} runs on the host (device cpu) without --cpp-wrapper or --policy-process")
    if not args.hang_timeout > 0:
        raise ValueError(f"--hang-timeout must be > 0 seconds, got {args.hang_timeout}")
    if not args.resize_deadline > 0:
        raise ValueError(f"--resize-deadline must be > 0 seconds, got {args.resize_deadline}")


def run_elastic_command(args: argparse.Namespace) -> int:
    """``run --scale-plan`` (the scripted workload resized at fixed steps) or ``run --chaos``."""
    if args.chaos is not None:
        return _chaos(args)
    from eplb_reference.elastic.report import write_elastic_report
    from eplb_reference.elastic.scripted import parse_kills, parse_scale_plan, run_elastic

    plan = parse_scale_plan(args.scale_plan)
    config = run_config(args, ranks=plan[0], tolerance=args.tolerance)
    _check(config, args, "--scale-plan")
    max_ranks = max(plan) if args.max_ranks is None else args.max_ranks
    kills = parse_kills(args.kill)
    out = output_dir(args.out)
    log_to_stderr()
    raw = run_elastic(config, plan, max_ranks, deadline_s=args.resize_deadline, hang_s=args.hang_timeout,
                      timeout_s=args.timeout, kills=kills)
    return write_elastic_report(out, config, plan, max_ranks, raw, as_json=args.json)


def _chaos(args: argparse.Namespace) -> int:
    from eplb_reference.elastic.chaos import run_chaos
    from eplb_reference.elastic.server import ElasticServer

    if args.scale_plan is not None or args.kill:
        raise ValueError("--chaos draws its own resizes and faults: without --scale-plan or --kill")
    if args.faults < 1:
        raise ValueError(f"--faults must be >= 1, got {args.faults}")
    max_ranks = 4 if args.max_ranks is None else args.max_ranks
    config = run_config(args, steps=1)
    _check(config, args, "--chaos")
    if max_ranks < 4:
        raise ValueError("--chaos kills two members of four during a recovery: --max-ranks must be >= 4")
    out = output_dir(args.out)
    log_to_stderr()
    server = ElasticServer(config, max_ranks, deadline_s=args.resize_deadline, hang_s=args.hang_timeout, chaos=True)
    report = run_chaos(server, args.chaos, args.faults)
    (out / "chaos.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if args.json else
          f"chaos seed {report['seed']}: {report['faults']} faults in {report['seconds']} s "
          f"({', '.join(f'{k} {n}' for k, n in sorted(report['faults_by_kind'].items()))}); "
          f"{report['requests_answered']} requests answered, {report['requests_duplicated']} twice, "
          f"{report['requests_unanswered']} unanswered; output mismatches {report['output_mismatches']}, recompiles "
          f"{report['recompiles']}; detection max {report['detection_s_max']} s, detection to serving max "
          f"{report['detection_to_serving_s_max']} s; wrote {out / 'chaos.json'}")
    for problem in report["failed"]:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if report["failed"] else 0


def serve_command(args: argparse.Namespace) -> int:
    """``serve``: the reference decoder as an elastic greedy-generation server over HTTP."""
    from eplb_reference.elastic.http import serve
    from eplb_reference.elastic.server import ElasticServer

    from eplb_reference.elastic.http_access import load_api_key
    from eplb_reference.elastic.protocol import RunSecret

    api_key = load_api_key(args.api_key_file, os.environ)  # an ApiKeyError (a ValueError) before anything starts
    secret = RunSecret.load(args.secret_file, os.environ, create=True)
    if args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, not {args.max_concurrency}")
    config = run_config(args, steps=1)
    _check(config, args, "serve")
    max_ranks = config.ranks if args.max_ranks is None else args.max_ranks
    log_to_stderr()
    server = ElasticServer(config, max_ranks, deadline_s=args.resize_deadline, hang_s=args.hang_timeout,
                           host=args.store_host, store_port=args.store_port, secret=secret)
    joining = (f"`eplb-graph join --store {server.spec.store_host}:{server.spec.store_port} --secret-file "
               f"{args.secret_file}`" if args.secret_file else "the run's secret (none given: --secret-file)")
    print(f"eplb-graph serve: {config.ranks} EP ranks (up to {max_ranks}) on http://{args.host}:{args.port}; "
          f"members join with {joining}", file=sys.stderr)
    serve(server, args.host, args.port, api_key=api_key, max_concurrency=args.max_concurrency)
    return 0


def join_command(args: argparse.Namespace) -> int:
    from eplb_reference.elastic.join import join
    from eplb_reference.elastic.protocol import RunSecret

    secret = RunSecret.load(args.secret_file, os.environ, create=False)  # refused before any connection
    log_to_stderr()
    return join(args.store, secret, name=args.name, timeout_s=args.timeout)
