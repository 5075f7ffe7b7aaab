"""The async worker's host time to plan one layer's weight transfer, upstream's vs ours; one run.

For each layer of a rearrangement, upstream's async worker calls ``move_to_buffer``, which
works out what this rank sends and receives (local copies, then ``add_send`` / ``add_recv``
on the communicator) with two calls of ``get_ep_ranks_with_experts_batch``: a Python loop over
the experts asked about. That thread shares the serving process's GIL, so its Python is time
the thread launching the next forward or replay can wait (``bench_policy_stall.py`` measures
that stall for the policy). Timed here, interleaved round after round on the same placements:

  * ``upstream``: ``move_to_buffer`` as shipped;
  * ``adapter``: ``move_to_buffer`` under ``CapabilityAdaptations``, which puts
    ``transfer_peers.ranks_with_experts`` in place of the per-expert loop (its other patch on
    this path, the host-aware ``device_stream``, is the same no-op as upstream's for the
    ``stream=None`` timed here, so the difference is the planning);

for rank 0 of an EP group of ``ranks`` ranks, with a communicator that records the sends and
receives it is given instead of moving bytes, so only the planning is timed. Both must post
the same sends and receives (expert, peer and row) and make the same local copies.

    python benchmarks/bench_transfer_planning.py --out out/bench_transfer_planning.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from eplb_graph.core.placement import check_expert_layout

# logical+redundant experts x EP ranks: the default job's model on one and two ranks; DeepSeek-V3
# with 32 redundant experts on one 8-GPU node and on 32 ranks.
DEFAULT_SHAPES = ("16+4x1", "16+4x2", "256+32x8", "256+32x32")
HIDDEN = 8  # per-expert weight rows are tiny: the planning, not the copies, is what is timed


def parse_shape(text: str) -> tuple[int, int, int]:
    experts, _, ranks = text.partition("x")
    logical, _, redundant = experts.partition("+")
    try:
        return int(logical), int(redundant or 0), int(ranks or 1)
    except ValueError:
        raise SystemExit(f"bench_transfer_planning: --shapes takes LOGICAL+REDUNDANTxRANKS, got {text!r}") from None


class RecordingCommunicator:
    """Upstream's ``EplbCommunicator`` calls, recorded (expert, peer, row) instead of moving bytes."""

    def __init__(self, weight: torch.Tensor, buffer: torch.Tensor) -> None:
        self.weight, self.buffer = weight, buffer
        self.posted: list[tuple[str, int, int, int]] = []

    def set_transfer_context(self, old_indices, layer_idx: int) -> None:
        pass

    def add_send(self, tensors: list[torch.Tensor], dst_rank: int, expert_id: int) -> None:
        self.posted.append(("send", expert_id, dst_rank, self._row(tensors[0], self.weight)))

    def add_recv(self, tensors: list[torch.Tensor], src_rank: int, expert_id: int) -> None:
        self.posted.append(("recv", expert_id, src_rank, self._row(tensors[0], self.buffer)))

    def execute(self) -> None:
        pass

    @staticmethod
    def _row(row: torch.Tensor, of: torch.Tensor) -> int:
        return (row.data_ptr() - of.data_ptr()) // (of.stride(0) * of.element_size())


def placement_pairs(num_logical: int, num_redundant_experts: int, count: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(old, new) placements as a rearrangement moves between them: every expert once, hot ones
    again, shuffled; each pair's new placement is the next pair's old one."""
    rng = np.random.default_rng(seed)
    placements = []
    for _ in range(count + 1):
        placement = np.concatenate([np.arange(num_logical), rng.integers(0, num_logical, num_redundant_experts)])
        placements.append(rng.permutation(placement))
    return list(zip(placements[:-1], placements[1:]))


def bench_shape(num_logical: int, num_redundant_experts: int, ranks: int, rounds: int) -> dict:
    from vllm.distributed.eplb import rebalance_execute

    from eplb_graph.upstream.capability import CapabilityAdaptations

    num_local = (num_logical + num_redundant_experts) // ranks
    adapter = CapabilityAdaptations(torch.device("cpu"), commit_hook=lambda model_state, layer: None)
    pairs = placement_pairs(num_logical, num_redundant_experts, count=8, seed=num_logical + ranks)
    weight = torch.randn(num_local, HIDDEN)
    samples = {"upstream": [], "adapter": []}
    posted_per_layer = []
    compared = 0
    for round_index in range(rounds + 1):  # round 0 warms up, untimed
        old, new = pairs[round_index % len(pairs)]
        outcome = {}
        for name in ("upstream", "adapter") if round_index % 2 else ("adapter", "upstream"):
            buffer = torch.zeros_like(weight)
            communicator = RecordingCommunicator(weight, buffer)
            if name == "adapter":
                adapter.install()
            try:
                start = time.perf_counter()
                rebalance_execute.move_to_buffer(
                    num_local_experts=num_local, old_indices=old, new_indices=new, expert_weights=[weight],
                    expert_weights_buffers=[buffer], stream=None, ep_rank=0, communicator=communicator)
                elapsed = time.perf_counter() - start
            finally:
                adapter.uninstall()
            if round_index:
                samples[name].append(elapsed)
            outcome[name] = (communicator.posted, buffer)
        (posted, copied), (posted_adapter, copied_adapter) = outcome["upstream"], outcome["adapter"]
        if posted != posted_adapter or not torch.equal(copied, copied_adapter):
            raise AssertionError(f"the adapter planned a different transfer from {old.tolist()} to {new.tolist()}")
        posted_per_layer.append(len(posted))
        compared += 1

    p50 = {name: statistics.median(s) * 1e3 for name, s in samples.items()}
    return {
        "num_logical": num_logical,
        "num_redundant_experts": num_redundant_experts,
        "ranks": ranks,
        "local_experts": num_local,
        "rounds": rounds,
        "plan_upstream_p50_ms": round(p50["upstream"], 4),
        "plan_adapter_p50_ms": round(p50["adapter"], 4),
        "upstream_over_adapter": round(p50["upstream"] / p50["adapter"], 2),
        "posted_per_layer_p50": statistics.median(posted_per_layer),
        "plans_compared_identical": compared,
    }


def check_arguments(args: argparse.Namespace) -> list[tuple[int, int, int]]:
    """Bad input stops here, with the flag's name, before anything is timed."""
    if args.rounds < 1:
        raise SystemExit(f"bench_transfer_planning: --rounds must be >= 1, got {args.rounds}")
    shapes = [parse_shape(text) for text in args.shapes]
    for num_logical, num_redundant_experts, ranks in shapes:
        try:
            check_expert_layout(num_logical, num_redundant_experts, top_k=1, ranks=ranks)
        except ValueError as error:
            raise SystemExit(f"bench_transfer_planning: --shapes {num_logical}+{num_redundant_experts}x{ranks}: {error}") from None
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="LOGICAL+REDUNDANTxRANKS")
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--out", default="out/bench_transfer_planning.json")
    args = parser.parse_args()
    shapes = check_arguments(args)
    torch.set_num_threads(1)
    results = [bench_shape(*shape, args.rounds) for shape in shapes]
    report = {"torch": torch.__version__, "machine": platform.machine(), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'experts x ranks':>16} {'upstream ms':>12} {'adapter ms':>11} {'ratio':>7} {'sends+recvs':>12}")
    for r in results:
        shape = f"{r['num_logical']}+{r['num_redundant_experts']}x{r['ranks']}"
        print(f"{shape:>16} {r['plan_upstream_p50_ms']:>12.3f} {r['plan_adapter_p50_ms']:>11.3f} "
              f"{r['upstream_over_adapter']:>7.2f} {r['posted_per_layer_p50']:>12}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
