"""Which EP ranks send and which receive each expert of a layer's transfer, vectorized.

Upstream vLLM's async worker plans every layer's weight transfer in ``move_to_buffer``,
which asks ``rebalance_execute.get_ep_ranks_with_experts_batch`` twice per layer (for the
experts this rank sends, then for those it receives). Upstream answers with a Python loop
over the queried experts, two ``np.unique`` calls each (``bench_transfer_planning.py`` times
it), on the worker thread, which shares the serving process's GIL, so the thread launching the
next forward or replay waits for it.

``ranks_with_experts`` keeps that contract with one scatter per placement into a
[queried experts, ranks] table and a short Python pass over its rows; the capability
adaptations (``upstream.capability``) put it in upstream's place. Tests hold it equal to
upstream's function on generated placements (empty slots and odd queries included).
"""

from __future__ import annotations

import numpy as np


def ranks_with_experts(
    expert_ids: np.ndarray,
    num_local_experts: int,
    old_indices: np.ndarray,
    new_indices: np.ndarray,
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """For each distinct expert in ``expert_ids``: the ranks that hold it now, and the ranks
    that will hold it and do not now.

    Args:
        expert_ids: [Q] experts asked about (any order, repeats allowed).
        num_local_experts: slots per rank; slot s is on rank s // num_local_experts.
        old_indices: [P] the placement now (logical id per slot, -1 for an empty slot).
        new_indices: [P] the placement being moved to.

    Returns ``(ranks_to_send, ranks_to_recv)``, each {expert: ascending list of ranks} with
    Python ints, an empty list where no rank qualifies: upstream's
    ``get_ep_ranks_with_experts_batch`` contract.
    """
    ranks_to_send: dict[int, list[int]] = {}
    ranks_to_recv: dict[int, list[int]] = {}
    if expert_ids.size == 0:
        return ranks_to_send, ranks_to_recv
    experts = np.unique(expert_ids)  # [E] ascending
    num_slots = old_indices.shape[0]
    num_ranks = -(-num_slots // num_local_experts)
    rank_of_slot = np.arange(num_slots) // num_local_experts  # [P]

    def held_by_rank(indices: np.ndarray) -> np.ndarray:
        """[E, ranks] bool: rank r has a slot holding experts[e] in this placement."""
        row = np.minimum(np.searchsorted(experts, indices), experts.size - 1)  # [P], the row if asked about
        asked = experts[row] == indices  # [P]
        held = np.zeros((experts.size, num_ranks), dtype=bool)
        held[row[asked], rank_of_slot[asked]] = True
        return held

    held_now = held_by_rank(old_indices)  # [E, ranks]
    gaining = held_by_rank(new_indices) & ~held_now  # [E, ranks]: a rank with a copy now receives nothing
    for expert, senders, receivers in zip(experts.tolist(), held_now.tolist(), gaining.tolist()):
        ranks_to_send[expert] = [rank for rank, holds in enumerate(senders) if holds]
        ranks_to_recv[expert] = [rank for rank, gains in enumerate(receivers) if gains]
    return ranks_to_send, ranks_to_recv
