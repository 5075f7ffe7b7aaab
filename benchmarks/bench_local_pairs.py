"""What ``eplb_graph::local_expert_pairs`` costs over the local work it does, at a real model's MoE shape.

One rank of EP=2 at Qwen3-30B-A3B's MoE layer (hidden 2048, moe_intermediate 768, 128 experts,
top-8; this rank holds experts 0..63), tokens routed uniformly over every expert, so about half
of each token's pairs are this rank's. Two ways to compute this rank's share, timed interleaved
round after round in one process:

* ``op``: the registered op as the plugin calls it, given the layer's [T, 8] global ids: it finds
  the local pairs, compacts them into top-1 rows, runs vLLM's CPU fused-MoE kernel on them and
  sums the rows back into [T, H];
* ``ideal``: the same vLLM kernel on exactly the local rows, already compacted ([P, H] rows,
  [P, 1] local ids and weights): what the local work costs with nothing around it.

The kernel is vLLM's ``cpu_fused_moe`` on weights prepacked for the host's ISA (``amx`` where the
CPU has AMX tiles; else ``vec``), in bfloat16 (float32 where the host's kernel takes no bfloat16:
the report's ``isa``, ``dtype`` and ``cpu`` say which ran where). The op's kernel here calls it directly, as
``LocalPairExperts.run_pairs`` calls upstream's ``apply``, which calls it. Per T, the JSON has
``op_s``, ``ideal_s`` (medians) and ``overhead_ratio``: the median of the rounds' op / ideal
(each round times every arm back to back, so a ratio pairs samples taken together); the target
is <= 1.10 at every T. A third arm, ``composite``, runs the op with the torch composite's compaction and
combine in place of the C++ ones (``passes`` says which serve ``op``): what the C++ saves.

    python benchmarks/bench_local_pairs.py --out out/bench_local_pairs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import eplb_graph  # noqa: F401  (registers the op)
from eplb_graph.custom_ops import LOCAL_EXPERTS
from eplb_graph.custom_ops.local_experts import PairPasses, local_pairs

EP = 2
TARGET = 1.10
LAYER = "bench.local_pairs"


class FusedMoEPairs:
    """vLLM's CPU fused-MoE kernel over top-1 rows (a ``PairKernel``)."""

    def __init__(self, isa: str) -> None:
        self.isa = isa

    def run_pairs(self, hidden_states, topk_weights, local_ids, weights):
        from vllm._custom_ops import cpu_fused_moe

        w13, w2 = weights
        out = torch.empty_like(hidden_states)  # [P, H]
        cpu_fused_moe(out, hidden_states, w13, w2, None, None, topk_weights, local_ids, "silu", self.isa)
        return out


def host_kernel() -> tuple[str, torch.dtype]:
    """The ISA vLLM's CPU experts pick on this host, and the dtype its kernel runs in: bfloat16
    wherever the kernel takes it (AMX always does; the portable ``vec`` kernel where this build
    has bfloat16 vectors), else float32."""
    # AMX tiles need the kernel's permission first (what vLLM's CPU worker asks for at start)
    if platform.machine() in ("x86_64", "AMD64") and torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx():
        return "amx", torch.bfloat16
    return "vec", torch.bfloat16 if runs_in("vec", torch.bfloat16) else torch.float32


def runs_in(isa: str, dtype: torch.dtype) -> bool:
    """Whether vLLM's fused-MoE kernel for ``isa`` runs one tiny layer in ``dtype`` here."""
    from vllm._custom_ops import cpu_fused_moe, cpu_prepack_moe_weight

    w13, w2 = (cpu_prepack_moe_weight(torch.zeros(shape, dtype=dtype), isa) for shape in ((1, 64, 32), (1, 32, 32)))
    try:
        cpu_fused_moe(torch.empty(1, 32, dtype=dtype), torch.zeros(1, 32, dtype=dtype), w13, w2, None, None,
                      torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), "silu", isa)
    except RuntimeError:
        return False
    return True


def local_weights(shape: argparse.Namespace, isa: str, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """This rank's half of the experts, [E, 2I, H] and [E, H, I], prepacked for ``isa`` as vLLM loads them."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    local, hidden, intermediate = shape.experts // EP, shape.hidden, shape.intermediate
    w13 = (torch.randn(local, 2 * intermediate, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(local, hidden, intermediate, generator=gen) / intermediate ** 0.5).to(dtype)
    return [cpu_prepack_moe_weight(w13, isa), cpu_prepack_moe_weight(w2, isa)]


def seconds_per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def bench(tokens: int, shape: argparse.Namespace, kernel: FusedMoEPairs, weights: list[torch.Tensor],
          dtype: torch.dtype, rounds: int, gen: torch.Generator) -> dict:
    experts = shape.experts
    hidden = torch.randn(tokens, shape.hidden, generator=gen).to(dtype)  # [T, H]
    ids = torch.stack([torch.randperm(experts, generator=gen)[: shape.top_k] for _ in range(tokens)]).int()  # [T, K]
    topk_weights = torch.rand(tokens, shape.top_k, generator=gen)  # [T, K], float32 as vLLM's router gives them
    expert_map = torch.full((experts,), -1, dtype=torch.int32)  # [num_physical]: rank 0 holds the first half
    expert_map[: experts // EP] = torch.arange(experts // EP, dtype=torch.int32)
    local = local_pairs(ids, expert_map)  # [T, K]
    token, slot = (local >= 0).nonzero(as_tuple=True)  # [P], [P]
    rows, row_ids = hidden[token].contiguous(), local[token, slot].unsqueeze(1).int()  # [P, H], [P, 1]
    row_weights = topk_weights[token, slot].unsqueeze(1).contiguous()  # [P, 1]

    op = lambda: torch.ops.eplb_graph.local_expert_pairs(hidden, topk_weights, ids, expert_map, weights, LAYER)  # noqa: E731
    ideal = lambda: kernel.run_pairs(rows, row_weights, row_ids, weights)  # noqa: E731
    arms = {"op": op, "composite": lambda: on_composite(op), "ideal": ideal}
    expected = torch.zeros(tokens, shape.hidden).index_add_(0, token, ideal().float()).to(dtype)
    for name in ("op", "composite"):
        assert torch.equal(arms[name](), expected), f"the {name} arm must compute exactly the local rows' sum"
    calls = max(1, int(0.05 / max(seconds_per_call(ideal, 3), 1e-6)))  # about 50 ms a sample
    samples: dict[str, list[float]] = {name: [] for name in arms}
    order = list(arms)
    for _ in range(rounds):
        for name in order:
            samples[name].append(seconds_per_call(arms[name], calls))
        order = order[1:] + order[:1]  # each arm leads in turn: a drift favours none
    median = {name: statistics.median(values) for name, values in samples.items()}
    ratios = {name: [o / i for o, i in zip(samples[name], samples["ideal"])] for name in ("op", "composite")}
    return {"tokens": tokens, "local_pairs": int(token.numel()), "op_s": median["op"], "ideal_s": median["ideal"],
            "overhead_ratio": round(statistics.median(ratios["op"]), 3),
            "per_round_ratios": [round(ratio, 3) for ratio in ratios["op"]],
            "composite_s": median["composite"],
            "composite_overhead_ratio": round(statistics.median(ratios["composite"]), 3)}


def on_composite(op):
    """``op`` with the torch composite's compaction and combine, whatever serves the op here."""
    with LOCAL_EXPERTS.serving_with(PairPasses()):
        return op()


def cpu_name() -> str:
    """The host CPU's model name, as /proc/cpuinfo gives it (the platform's processor elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--rounds", type=int, default=7)
    # Qwen3-30B-A3B's MoE layer; smaller shapes only to test the benchmark itself
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    args = parser.parse_args(argv)
    if args.rounds < 1 or min(args.tokens) < 1:
        parser.error("--rounds and every --tokens must be >= 1")
    if args.experts % EP or not 1 <= args.top_k <= args.experts or args.hidden % 32 or args.intermediate % 32:
        parser.error(f"--experts divisible by {EP}, --top-k in 1..--experts, --hidden and --intermediate by 32 "
                     f"(the kernel's alignment)")
    torch.set_num_threads(1)  # one rank's share of a 2-core host; the op adds no parallelism of its own
    isa, dtype = host_kernel()
    gen = torch.Generator().manual_seed(0)
    weights = local_weights(args, isa, dtype, gen)
    kernel = FusedMoEPairs(isa)
    LOCAL_EXPERTS.register(LAYER, kernel)
    try:
        runs = [bench(tokens, args, kernel, weights, dtype, args.rounds, gen) for tokens in args.tokens]
    finally:
        LOCAL_EXPERTS.unregister(LAYER)
    report = {"runs": runs, "isa": isa, "dtype": str(dtype).removeprefix("torch."), "cpu": cpu_name(),
              "passes": LOCAL_EXPERTS.passes.kind, "target": TARGET,
              "target_met": all(run["overhead_ratio"] <= TARGET for run in runs),
              "shape": {"hidden": args.hidden, "moe_intermediate": args.intermediate, "experts": args.experts,
                        "top_k": args.top_k, "ep": EP}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
