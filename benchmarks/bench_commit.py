"""Main-thread cost of one async layer commit: upstream's placement inversion vs ours, one run.

Between two graph replays, upstream's ``_move_to_workspace`` commits a layer's new placement
with ``_commit_eplb_maps_for_layer``, which inverts it with ``compute_logical_maps`` -- a
Python loop over the physical slots -- before the worker may move the next layer. The
capability adaptations put ``layer_lookup.logical_maps`` (vectorized, same contract) in its
place. Timed here, interleaved round after round in one process, on the same placements:

  * ``upstream``: upstream's commit as shipped, then our lookup refresh (the commit hook);
  * ``adapter``: the commit as it runs under ``CapabilityAdaptations`` (upstream's
    commit with the inversion swapped, then the same refresh through the hook);

and the two must leave upstream's maps and our lookup bit-identical. No processes, no
collectives: this is the commit alone, the part of a rearranging step that scales with
the expert count (the readiness all-reduce and the weight copy do not change here).

    python benchmarks/bench_commit.py --out out/bench_commit.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from eplb_graph import LayerLookup, initial_placement
from eplb_graph.core.placement import check_expert_layout, logical_maps

# (logical, redundant): the default job's model, a mid-size one, DeepSeek-V3 with 32 redundant.
DEFAULT_SHAPES = ("16+4", "64+16", "256+32")
UPSTREAM_WIDTH = 1024  # upstream pads every layer's logical-to-physical row to MAX_EXPERT_REDUNDANCY + 1


def parse_shape(text: str) -> tuple[int, int]:
    logical, _, redundant = text.partition("+")
    try:
        return int(logical), int(redundant or 0)
    except ValueError:
        raise SystemExit(f"bench_commit: --shapes takes LOGICAL+REDUNDANT, got {text!r}") from None


def random_placements(num_logical: int, num_redundant_experts: int, count: int, seed: int) -> list[torch.Tensor]:
    """Valid placements as a policy returns them: every expert once, hot ones again, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    placements = []
    for _ in range(count):
        extra = torch.randint(0, num_logical, (num_redundant_experts,), generator=gen)
        placement = torch.cat([torch.arange(num_logical), extra])
        placements.append(placement[torch.randperm(placement.numel(), generator=gen)])
    return placements


def upstream_model_state(num_logical: int, num_redundant_experts: int, num_layers: int) -> SimpleNamespace:
    """The three maps of upstream's ``EplbModelState`` that a layer commit writes."""
    placement = initial_placement(num_logical, num_redundant_experts)
    return SimpleNamespace(
        physical_to_logical_map=placement.repeat(num_layers, 1),  # [L, P]
        logical_to_physical_map=torch.full((num_layers, num_logical, UPSTREAM_WIDTH), -1, dtype=torch.int64),
        logical_replica_count=torch.zeros(num_layers, num_logical, dtype=torch.int64),
    )


def bench_shape(num_logical: int, num_redundant_experts: int, rounds: int, num_layers: int = 2) -> dict:
    from vllm.distributed.eplb import eplb_state

    from eplb_graph.upstream.capability import CapabilityAdaptations

    upstream_commit = eplb_state._commit_eplb_maps_for_layer
    upstream_inversion = eplb_state.compute_logical_maps
    lookups = {name: [LayerLookup(num_logical, num_logical + num_redundant_experts) for _ in range(num_layers)]
               for name in ("upstream", "adapter")}
    states = {name: upstream_model_state(num_logical, num_redundant_experts, num_layers) for name in lookups}

    def refresh(name):
        def commit_hook(model_state, layer):
            lookups[name][layer].refresh_(model_state.physical_to_logical_map[layer])
        return commit_hook

    adapter = CapabilityAdaptations(torch.device("cpu"), commit_hook=refresh("adapter"))
    upstream_hook = refresh("upstream")

    def commit_upstream(placement, layer):
        upstream_commit(states["upstream"], new_physical_to_logical_map=placement, layer=layer)
        upstream_hook(states["upstream"], layer)

    def commit_adapter(placement, layer):  # with the adapter installed: the names it patched
        eplb_state._commit_eplb_maps_for_layer(states["adapter"], new_physical_to_logical_map=placement, layer=layer)

    placements = random_placements(num_logical, num_redundant_experts, count=8, seed=num_logical)
    samples = {"upstream": [], "adapter": []}
    inversion = {"upstream": [], "adapter": []}
    compared = 0
    for round_index in range(rounds + 1):  # round 0 warms up, untimed
        placement, layer = placements[round_index % len(placements)], round_index % num_layers
        order = [("upstream", commit_upstream, upstream_inversion), ("adapter", commit_adapter, logical_maps)]
        for name, commit, invert in order if round_index % 2 else order[::-1]:
            if name == "adapter":
                adapter.install()
            try:
                start = time.perf_counter()
                commit(placement, layer)
                committed = time.perf_counter()
                invert(placement, num_logical)
                inverted = time.perf_counter()
            finally:
                adapter.uninstall()
            if round_index:
                samples[name].append(committed - start)
                inversion[name].append(inverted - committed)
        # the swap must not change what upstream or routing sees
        for field in ("physical_to_logical_map", "logical_to_physical_map", "logical_replica_count"):
            if not torch.equal(getattr(states["upstream"], field), getattr(states["adapter"], field)):
                raise AssertionError(f"{field} differs after committing placement {placement.tolist()} to layer {layer}")
        for ours, theirs in zip(lookups["adapter"], lookups["upstream"]):
            if not torch.equal(ours.lookup, theirs.lookup):
                raise AssertionError(f"our lookup differs after committing placement {placement.tolist()}")
        compared += 1

    p50 = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    inversion_p50 = {name: statistics.median(s) * 1e3 for name, s in inversion.items()}
    return {
        "num_logical": num_logical,
        "num_redundant_experts": num_redundant_experts,
        "rounds": rounds,
        "commit_upstream_p50_ms": round(p50["upstream"], 4),
        "commit_adapter_p50_ms": round(p50["adapter"], 4),
        "commit_upstream_over_adapter": round(p50["upstream"] / p50["adapter"], 2),
        "inversion_upstream_p50_ms": round(inversion_p50["upstream"], 4),
        "inversion_adapter_p50_ms": round(inversion_p50["adapter"], 4),
        "commits_compared_identical": compared,
    }


def check_arguments(args: argparse.Namespace) -> list[tuple[int, int]]:
    """Bad input stops here, with the flag's name, before anything is timed."""
    if args.rounds < 1:
        raise SystemExit(f"bench_commit: --rounds must be >= 1, got {args.rounds}")
    shapes = [parse_shape(text) for text in args.shapes]
    for num_logical, num_redundant_experts in shapes:
        try:
            check_expert_layout(num_logical, num_redundant_experts, top_k=1, ranks=1)
        except ValueError as error:
            raise SystemExit(f"bench_commit: --shapes {num_logical}+{num_redundant_experts}: {error}") from None
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="LOGICAL+REDUNDANT experts per layer")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--out", default="out/bench_commit.json")
    args = parser.parse_args()
    shapes = check_arguments(args)
    torch.set_num_threads(1)
    results = [bench_shape(num_logical, num_redundant_experts, args.rounds) for num_logical, num_redundant_experts in shapes]
    report = {"torch": torch.__version__, "machine": platform.machine(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'experts':>10} {'upstream ms':>12} {'adapter ms':>11} {'ratio':>7} {'inversion up/ours ms':>22}")
    for r in results:
        print(f"{r['num_logical']:>6}+{r['num_redundant_experts']:<3} {r['commit_upstream_p50_ms']:>12.3f} "
              f"{r['commit_adapter_p50_ms']:>11.3f} {r['commit_upstream_over_adapter']:>7.2f} "
              f"{r['inversion_upstream_p50_ms']:>12.3f} / {r['inversion_adapter_p50_ms']:.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
