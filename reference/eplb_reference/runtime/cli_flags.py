"""The flags every runtime command shares (``run``, ``serve``, ``bench``), and the config they make.

``RunConfig.validate`` refuses every bad value by name before any process starts; the product's
``output_dir`` creates --out only once the flags are known to be good.
"""

from __future__ import annotations

import argparse

from eplb_reference.runtime.config import DEVICES, MODES, RunConfig


def run_config(args: argparse.Namespace, **overrides) -> RunConfig:
    fields = dict(
        mode=args.mode, device=args.device, ranks=args.ranks, steps=args.steps, weight_format=args.format,
        num_experts=args.experts, num_redundant_experts=args.redundant, top_k=args.top_k, num_layers=args.layers,
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


def capture_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts such as 16,64, got {text!r}") from None
    return sizes


def add_runtime_arguments(parser: argparse.ArgumentParser, *, steps: int, mode: str = "compiled",
                          interval: int = 20, ranks: int | None = 2) -> None:
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
    parser.add_argument("--capture-sizes", type=capture_sizes, default=(16, 64), metavar="N[,N...]",
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
