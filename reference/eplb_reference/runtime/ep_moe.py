"""The EP MoE layer of the reference runtime: router -> EPLB routing -> this rank's experts -> combine.

Each EP rank holds ``num_physical / ep_size`` consecutive physical experts. Token dispatch
is all-gather / all-reduce (in an elastic run through the ops of ``ep_collectives``, which
resolve the group by name and keep shapes at the group's maximum size): every rank gathers all ranks' tokens, physical ids and routing
weights, computes the (token, k) pairs its local experts own (with either expert kernel of
``weight_views``: per pair, or every local expert over every gathered token), and an
all-reduce sums the partial outputs (gloo has no reduce-scatter); each rank keeps its own
tokens' rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from eplb_graph.movement.expert_kernels import check_expert_kernel
from eplb_graph.movement.weight_views import ExpertWeights

# torch 2.13 calls the traceable all-gather all_gather_single; torch 2.11 (the lent GPU image's)
# has only all_gather_tensor, which 2.13 keeps as a deprecated alias of it.
traceable_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor

class ExpertParallelMoE(nn.Module):
    """Router (replicated, logical ids) -> EPLB routing -> this rank's experts -> combine.

    ``gate`` returns logical ids. With ``route_in_module`` the block calls
    ``map_and_record_layer`` itself (eager); compiled, it is left to the EPLB pass, which
    inserts the same op after the gate's top-k. Collectives are functional, so the block
    traces into one graph under torch.compile.

    The combine sums every (token, k) contribution over ranks before the k-sum, not partial
    k-sums: a placement then never changes the order of any addition, so in eager mode the
    output equals the one-process model's exactly (the price: K times the bytes of a
    combine of [T, H] partial sums).
    """

    def __init__(
        self,
        gate: nn.Module,  # returns (weights [T, K], logical ids [T, K])
        experts: ExpertWeights,  # this rank's physical slots
        layer_key: str | None,  # None: no EPLB, logical ids index experts directly
        ep_rank: int = 0,
        ep_size: int = 1,
        ep_group: dist.ProcessGroup | None = None,
        shared_expert: nn.Module | None = None,
        expert_kernel: str = "pairs",  # see weight_views: "pairs" or "dense"
        elastic_group: str | None = None,  # an ElasticEpGroup's name: rank, size and group resolved per call
    ) -> None:
        super().__init__()
        check_expert_kernel(expert_kernel)
        self.gate = gate
        self.experts = experts
        self.expert_kernel = expert_kernel
        self.shared_expert = shared_expert
        self.layer_key = layer_key
        self.route_in_module = layer_key is not None
        self.ep_rank, self.ep_size, self.ep_group = ep_rank, ep_size, ep_group
        self.elastic_group = elastic_group

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.elastic_group is not None:  # [max_size * T, C], rows of non-members zero
            return torch.ops.eplb_graph.ep_all_gather(tensor.contiguous(), self.elastic_group)
        if self.ep_size == 1:
            return tensor
        if torch.compiler.is_compiling():  # traceable into the graph
            return traceable_all_gather(tensor.contiguous(), 0, self.ep_group)
        # Eager: a synchronous collective. (Eager functional collectives on gloo corrupted the
        # heap here when ranks ran ahead with several collectives in flight.)
        parts = [torch.empty_like(tensor) for _ in range(self.ep_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.ep_group)
        return torch.cat(parts)

    def _gather_all(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's rows of each [T, *] tensor, as [W*T, *], in one all-gather.

        The tensors travel as raw bytes side by side (bit-exact for any dtype, no arithmetic
        on them), so each layer has one collective in flight, never several: Inductor issued
        the three separate all-gathers before waiting on any, and several concurrent gloo
        collectives crashed a rank (SIGSEGV, twice in about ten full test runs), as eager
        functional collectives had corrupted the heap before.
        """
        if self.ep_size == 1 and self.elastic_group is None:
            return list(tensors)
        parts = [t.contiguous() for t in tensors]
        packed = self._gather(torch.cat([t.view(torch.uint8) for t in parts], dim=1))  # [W*T, bytes]
        out, start = [], 0
        for t in parts:
            width = t.shape[1] * t.element_size()
            out.append(packed[:, start : start + width].contiguous().view(t.dtype))
            start += width
        return out

    def _sum_over_ranks(self, tensor: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return funcol.all_reduce(tensor, "sum", self.ep_group)
        dist.all_reduce(tensor, group=self.ep_group)
        return tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # [T, H], T equal on every rank
        num_tokens = tokens.shape[0]
        weights, expert_ids = self.gate(tokens)  # [T, K] each
        if self.route_in_module:
            expert_ids = torch.ops.eplb_graph.map_and_record_layer(expert_ids, self.layer_key)  # [T, K] physical
        all_x, all_weights, all_ids = self._gather_all(tokens, weights, expert_ids)  # [W*T, H], [W*T, K] x2
        num_local = self.experts.num_experts
        if self.elastic_group is not None:  # this rank's slot of each pair now, -1 elsewhere
            local = torch.ops.eplb_graph.ep_local_slots(all_ids, self.elastic_group, num_local)
        else:
            local = all_ids - self.ep_rank * num_local  # [W*T, K]
        mine = (local >= 0) & (local < num_local)
        slots = local.clamp(0, num_local - 1)  # [W*T, K]; pairs hosted elsewhere are masked below
        if self.expert_kernel == "dense":
            per_expert = self.experts(all_x)  # [E_local, W*T, H]: every local expert on every token
            token_index = torch.arange(all_x.shape[0], device=all_x.device).unsqueeze(1)  # [W*T, 1]
            pairs = per_expert[slots, token_index]  # [W*T, K, H]
        else:
            top_k = slots.shape[1]
            pairs = self.experts(all_x.repeat_interleave(top_k, dim=0), slots.reshape(-1)).view(-1, top_k, shape[-1])
        # each (token, k) pair is computed by one rank and is exactly zero on the others
        contributions = pairs * (all_weights * mine).unsqueeze(-1)  # [W*T, K, H]
        if self.elastic_group is not None:
            contributions = torch.ops.eplb_graph.ep_sum_own_rows(contributions, self.elastic_group)  # [T, K, H]
        elif self.ep_size > 1:
            # summing a value with zeros is exact, so this rank's pairs arrive bit for bit whatever
            # the placement; the k-sum below then adds them in one process's order
            contributions = self._sum_over_ranks(contributions)
            contributions = contributions[self.ep_rank * num_tokens : (self.ep_rank + 1) * num_tokens]
        out = contributions.sum(1)  # [T, H]
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(shape)
