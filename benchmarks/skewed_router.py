"""Qwen3-MoE checkpoints whose routers skew the load, for the vLLM expert-parallel benchmarks.

vLLM's initial placement of E logical experts with R redundant slots over two ranks: rank 0 holds
logical 0..(E+R)/2-1, rank 1 the rest and a replica of each of 0..R-1. The unreplicated experts
R..E-1 split evenly, rank 0's R..(E+R)/2-1 and rank 1's (E+R)/2..E-1; ``mirror`` swaps those
two halves, so a skew in placement "rank1" is the skew of "rank0" with its experts on the other
rank (which also controls for one core being faster than the other).

Two skews, each a bias per expert on the router logits, over a spread of one across tokens
(``calibrate_router``: each router rebuilt on what actually reaches it):

* **worst**: the ``--hot`` experts (rank 0's, unreplicated) take about half of the routed pairs:
  a constructed worst case, an upper bound of what rebalancing buys;
* **natural**: in each layer, the i-th most popular expert (a seeded order over all experts) has
  its mean logit shifted by ``-s * ln(i)``, so its share of the router's softmax mass follows a
  Zipf law of exponent ``s``. The load a top-k router makes
  of it is flatter at the top (a token picks an expert once): ``zipf_exponent`` fits the exponent
  of the load the engine actually recorded, and the benchmarks report it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

# A Qwen3-30B-A3B MoE layer (hidden 2048, moe_intermediate 768, top-8) over 32 experts: the
# natural configuration's shape, small enough for two CPU workers
NATURAL = {"hidden": 2048, "intermediate": 768, "experts": 32, "redundant": 8, "top_k": 8}
CALIBRATION = (8, 240)  # prompts x tokens each router is calibrated on (the benchmarks' prompt length)


def mirror(expert: int, experts: int, redundant: int) -> int:
    """The expert in the other rank's unreplicated half at the same position (replicated ones stay)."""
    if expert < redundant:
        return expert
    half = (experts - redundant) // 2
    return redundant + (expert - redundant + half) % (experts - redundant)


def worst_bias(args: argparse.Namespace) -> list[float]:
    """Router bias per logical expert: ``--bias`` on the ``--hot`` ones (mirrored for rank1)."""
    hot = {mirror(e, args.experts, args.redundant) if args.placement == "rank1" else e for e in args.hot}
    return [args.bias if e in hot else 0.0 for e in range(args.experts)]


def natural_logit_shift(args: argparse.Namespace, layer: int) -> list[float]:
    """One layer's logit shift per logical expert: -s * ln(i) for the i-th most popular (each layer
    its own order, as a real model's layers have their own hot experts), oriented so that the
    unreplicated half with more of the router's mass sits on rank 0 ("rank0") or rank 1 ("rank1")."""
    import torch

    generator = torch.Generator().manual_seed(args.seed * 1000 + layer)
    order = torch.randperm(args.experts, generator=generator).tolist()
    shift = [0.0] * args.experts
    for popularity, expert in enumerate(order, start=1):
        shift[expert] = -args.zipf * math.log(popularity)
    half = (args.experts - args.redundant) // 2
    mass = [sum(math.exp(x) for x in shift[start:start + half]) for start in (args.redundant, args.redundant + half)]
    hot_rank = 0 if mass[0] >= mass[1] else 1
    if hot_rank != int(args.placement == "rank1"):
        shift = [shift[mirror(e, args.experts, args.redundant)] for e in range(args.experts)]
    return shift


def router_inputs(model, prompts) -> list:
    """What reaches each MoE layer's router over ``prompts`` [N, S] (a transformers forward): [L] of [N*S, H]."""
    import torch

    seen, hooks = {}, []
    for index, block in enumerate(model.model.layers):
        def keep(module, args, output, index=index):
            seen[index] = args[0].detach().reshape(-1, args[0].shape[-1])
        hooks.append(block.mlp.gate.register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(prompts)
    finally:
        for hook in hooks:
            hook.remove()
    return [seen[index] for index in range(len(model.model.layers))]


def calibrate_router(gate, inputs, bias) -> None:
    """Rebuilds router rows ``gate`` [E, H] in place for ``inputs`` [N, H]: along the inputs' mean
    direction u each row carries its bias over the inputs' mean reach c along u; across it, the
    row's own direction, scaled so that the logits' spread over tokens is 1. So expert e's logit is
    about ``bias[e] * (x . u) / c`` plus noise of unit spread: the bias reads in logits, and the
    direction every token shares favours no expert."""
    mean = inputs.mean(0)
    u = mean / mean.norm()  # [H]
    reach = float((inputs @ u).mean())
    across = gate - (gate @ u)[:, None] * u  # [E, H]
    spread = float((inputs @ across.T).std())
    gate.copy_(across / spread + (bias / reach)[:, None] * u)


def write_skewed_checkpoint(directory: Path, *, hidden: int, intermediate: int, layers: int, experts: int,
                            router_bias: list[float] | list[list[float]], top_k: int = 2,
                            dtype: str = "float32") -> Path:
    """A Qwen3-MoE checkpoint whose routers favour experts by ``router_bias`` ([E], or [L, E] per
    layer), in logits over a spread of one across tokens (``calibrate_router``). Each layer's
    router is calibrated on what reaches it over seeded prompts, layer after layer (a layer's
    routing shapes the next one's input); without it, attention makes every token's router input
    nearly the same, and the same few experts take every token whatever the bias."""
    import torch
    import transformers

    from eplb_reference.models.tiny_checkpoint import write_tiny_qwen3_moe_checkpoint

    write_tiny_qwen3_moe_checkpoint(directory, hidden_size=hidden, moe_intermediate_size=intermediate,
                                    intermediate_size=intermediate, num_hidden_layers=layers, num_experts=experts,
                                    num_experts_per_tok=top_k, num_attention_heads=2, num_key_value_heads=1,
                                    vocab_size=512)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    prompts = torch.randint(3, 503, CALIBRATION, generator=torch.Generator().manual_seed(2))  # [N, S]
    bias = torch.tensor(router_bias, dtype=torch.float32).expand(layers, experts)  # [L, E]
    for layer in range(layers):
        with torch.no_grad():
            calibrate_router(model.model.layers[layer].mlp.gate.weight, router_inputs(model, prompts)[layer],
                             bias[layer])
    model.to(getattr(torch, dtype)).save_pretrained(directory, safe_serialization=True)
    return directory


def add_skewed_checkpoint_arguments(parser: argparse.ArgumentParser, *, intermediate: int) -> None:
    """The worst-case checkpoint's shape and skew (bench_vllm_eplb's, bench_kept_placement's and
    bench_vllm_elastic's)."""
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=intermediate)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--redundant", type=int, default=4)
    parser.add_argument("--hot", type=int, nargs="+", default=[4, 5], help="hot logical experts (rank 0's, unreplicated)")
    parser.add_argument("--bias", type=float, default=1.5,
                        help="router logit bias towards the hot experts (over a spread of one across tokens)")


def check_hot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses ``--hot`` experts outside rank 0's unreplicated slots (where the worst case puts them)."""
    if not all(args.redundant <= e < (args.experts + args.redundant) // 2 for e in args.hot):
        parser.error(f"--hot {args.hot}: hot experts must sit in rank 0's slots, unreplicated "
                     f"({args.redundant}..{(args.experts + args.redundant) // 2 - 1})")


def skewed_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace, directory: Path) -> Path:
    """The worst case ``add_skewed_checkpoint_arguments`` describes (in ``args.placement``, rank0
    where not given), its hot experts checked first."""
    check_hot(parser, args)
    placed = argparse.Namespace(**{"placement": "rank0", **vars(args)})
    return write_skewed_checkpoint(directory, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                                   experts=args.experts, router_bias=worst_bias(placed))


def natural_checkpoint(args: argparse.Namespace, directory: Path) -> Path:
    """The natural skew (``args.zipf``, ``args.seed``) at ``args``' shape, in ``args.placement``."""
    return write_skewed_checkpoint(directory, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers,
                                   experts=args.experts, top_k=args.top_k,
                                   router_bias=[natural_logit_shift(args, layer) for layer in range(args.layers)],
                                   dtype=args.dtype)


def zipf_exponent(load: list[int]) -> float | None:
    """The exponent s of the Zipf law load ~ rank^-s that fits ``load`` (least squares in log-log
    over the experts that got any), or None where fewer than two did."""
    ranked = sorted((x for x in load if x > 0), reverse=True)
    if len(ranked) < 2:
        return None
    xs, ys = [math.log(i) for i in range(1, len(ranked) + 1)], [math.log(x) for x in ranked]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return round(-slope, 3)
