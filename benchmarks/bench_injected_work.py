"""What a fixed amount of host work inside the forward costs a multi-rank decode step.

Two EPLB-off copies of the runtime's model run in the same rank processes, steps
alternating; one has a custom op after each router that only busy-waits ``--work-us`` and
passes the ids through (the shape of EPLB's routing op, without its work). The step-time
difference against the injected total says how the runtime turns host work into step time:
about 1x plus the op's dispatch on one rank, and on two ranks sharing two cores several
times more, because the collectives that follow wait longer. This is the yardstick for the
EPLB-on cost that ``eplb-graph bench`` reports.

    python benchmarks/bench_injected_work.py --ranks 2 --work-us 40 --out out/bench_injected_work.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

NAMESPACE = "eplb_graph_bench"


def _busy_wait(ids: torch.Tensor, us: float) -> torch.Tensor:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass
    return ids.clone()


def register_spin_op() -> torch.library.Library:
    """``eplb_graph_bench::spin(ids, us)``: busy-waits ``us`` microseconds, returns a copy of ids."""
    lib = torch.library.Library(NAMESPACE, "DEF")
    lib.define("spin(Tensor ids, float us) -> Tensor")
    lib.impl("spin", _busy_wait, "CPU")
    torch.library.register_fake(f"{NAMESPACE}::spin", lambda ids, us: torch.empty_like(ids), lib=lib)
    return lib


def inject_after_routers(model, work_us: float) -> None:
    """Each MoE router's ids pass through the spin op (bound to the router instance)."""
    spin = getattr(torch.ops, NAMESPACE).spin
    for block in model.layers:
        gate = block.mlp.gate
        route = gate.forward

        def forward(x, route=route):
            weights, ids = route(x)  # [T, K] each
            return weights, spin(ids, work_us)

        gate.forward = forward


def rank_main(rank: int, world_size: int, init_method: str, cfg, work_us: float) -> dict:
    from eplb_reference.bench.harness import decode_batches, rotating_steps
    from eplb_reference.runtime.groups import shutdown_expert_parallel
    from eplb_reference.runtime.compile import prepare_step
    from eplb_reference.runtime.groups import rank_session
    from eplb_reference.runtime.stack import build_rank_models
    from eplb_reference.runtime.step import rank_device, timed_step

    library = register_spin_op()  # held for the life of the registrations
    with rank_session(rank, world_size, init_method, cfg) as (group, _):
        device = rank_device(cfg)
        plain, _, _, plain_flags = build_rank_models(cfg, rank, world_size, group)
        injected, _, _, injected_flags = build_rank_models(cfg, rank, world_size, group)
        inject_after_routers(injected, work_us)
        forwards = {"plain": prepare_step(plain, cfg, [], plain_flags, [])[0],
                    "injected": prepare_step(injected, cfg, [], injected_flags, [])[0]}
        decode = decode_batches(cfg, rank, device)
        for forward in forwards.values():  # compile and warm up
            for _ in range(10):
                timed_step(forward, decode[0], device, None)
        timed = rotating_steps(forwards, {}, decode, cfg.steps, device)
        times = {name: [t.seconds * 1e3 for t in steps] for name, steps in timed.items()}
    shutdown_expert_parallel()
    del library
    return times


def check_arguments(args: argparse.Namespace) -> None:
    """Bad input stops here, with the flag's name, before any rank process starts."""
    for flag, value, least in (("--ranks", args.ranks, 1), ("--steps", args.steps, 20), ("--work-us", args.work_us, 0)):
        if value < least:
            raise SystemExit(f"bench_injected_work: {flag} must be >= {least}, got {value}")


def main() -> None:
    from eplb_reference.runtime.launch import run_ranks
    from eplb_reference.runtime.config import RunConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--work-us", type=float, default=40.0, help="busy-wait per router call, microseconds")
    parser.add_argument("--out", type=Path, default=Path("out/bench_injected_work.json"))
    args = parser.parse_args()
    check_arguments(args)
    cfg = RunConfig(mode="compiled", ranks=args.ranks, steps=args.steps, eplb=False, check_outputs=False,
                    progress=False, collect_load_stats=False)
    cfg.validate()
    results = run_ranks(rank_main, args.ranks, cfg, args.work_us, timeout_s=600)
    plain = statistics.median(ms for r in results for ms in r["plain"])
    injected = statistics.median(ms for r in results for ms in r["injected"])
    injected_us = args.work_us * cfg.num_layers
    report = {
        "benchmark": "step cost of host work injected after each router (compiled, EPLB off)",
        "ranks": args.ranks,
        "steps": args.steps,
        "injected_us_per_step": injected_us,
        "plain_p50_ms": round(plain, 3),
        "injected_p50_ms": round(injected, 3),
        "step_cost_us": round((injected - plain) * 1e3, 1),
        "step_cost_over_injected": round((injected - plain) * 1e3 / injected_us, 2) if injected_us else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
