"""Graph-safe EPLB routing ops: logical -> physical expert ids, and load recording.

The three ops live in the ``eplb_graph`` namespace and are registered directly on a
``torch.library.Library`` fragment (as vLLM does for its hot-path ops): the
``torch.library.custom_op`` decorator adds Python work to every call, and these ops run
once per MoE layer per forward.

Every kernel here is written so that a captured graph (CUDA graph, ACL graph,
``torch.compile``) stays valid across placement changes:
  * no host sync and no data-dependent output shape;
  * no Python branching on tensor *values* -- the record flag and the unpadded-token
    count are device tensors, read by the kernel, so a replay sees their current values;
  * the lookup is read from the caller's tensor, never copied or cached.

Replica choice is upstream vLLM's: Knuth's multiplicative hash of the token (row)
index, modulo the expert's replica count. The same batch always maps the same way.
"""

from __future__ import annotations

import torch

# floor(2^32 / golden ratio): Knuth's multiplicative hash, as upstream vLLM's EPLB kernel.
KNUTH_MULTIPLIER = 2654435769
HASH_MASK = 0xFFFFFFFF

MAP_TO_PHYSICAL_SCHEMA = (
    "map_to_physical(Tensor topk_ids, Tensor lookup, Tensor replica_count) -> Tensor"
)
RECORD_LOAD_SCHEMA = (
    "record_load(Tensor physical_ids, Tensor(a!) load, Tensor record_enabled, "
    "Tensor num_unpadded_tokens) -> ()"
)
MAP_AND_RECORD_SCHEMA = (
    "map_and_record(Tensor topk_ids, Tensor lookup, Tensor replica_count, "
    "Tensor(a!) load, Tensor record_enabled, Tensor num_unpadded_tokens) -> Tensor"
)

_ID_DTYPES = (torch.int32, torch.int64)
_FLAG_DTYPES = (torch.bool, torch.int32, torch.int64)


def check_ids(topk_ids: torch.Tensor) -> None:
    """[T, K] int32/int64 ids. Rank and dtype are static even on fake tensors, so plain tests
    serve the kernels and the fakes alike, and cost less at run time than ``torch._check``."""
    if topk_ids.dim() != 2:
        raise RuntimeError(f"topk_ids must be [T, K], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in _ID_DTYPES:
        raise RuntimeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")


def check_routing_args(
    topk_ids: torch.Tensor, lookup: torch.Tensor, replica_count: torch.Tensor
) -> None:
    """Shape and dtype checks shared by the kernels and the fake implementations.

    They run at trace time under torch.compile, so a wrong call fails when the graph
    is built, not at the first replay. The C++ CPU kernels (csrc/routing.cpp) make the
    same checks, in this order and with these messages.
    """
    check_ids(topk_ids)
    torch._check(lookup.dim() == 2, lambda: f"lookup must be [num_logical, max_replicas], got {tuple(lookup.shape)}")
    torch._check(lookup.dtype == torch.int32, lambda: f"lookup must be int32, got {lookup.dtype}")
    torch._check(
        replica_count.dim() == 1 and replica_count.shape[0] == lookup.shape[0],
        lambda: f"replica_count must be [num_logical={lookup.shape[0]}], got {tuple(replica_count.shape)}",
    )
    torch._check(replica_count.dtype == torch.int32, lambda: f"replica_count must be int32, got {replica_count.dtype}")


def check_record_args(
    physical_ids: torch.Tensor,
    load: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
) -> None:
    """Like check_routing_args, for the recording half. Ids and flags must be integers (the
    record flag may be bool): every kernel then reads them alike, where a float one would
    be truncated by one kernel and compared as a float by another."""
    torch._check(physical_ids.dim() == 2, lambda: f"physical_ids must be [T, K], got {tuple(physical_ids.shape)}")
    torch._check(
        physical_ids.dtype in _ID_DTYPES, lambda: f"physical_ids must be int32 or int64, got {physical_ids.dtype}"
    )
    torch._check(load.dim() == 1, lambda: f"load must be [num_physical], got {tuple(load.shape)}")
    torch._check(load.is_contiguous(), lambda: "load must be contiguous")
    torch._check(
        record_enabled.numel() == 1,
        lambda: f"record_enabled must be a 0-dim or 1-element tensor, got {tuple(record_enabled.shape)}",
    )
    torch._check(
        record_enabled.dtype in _FLAG_DTYPES,
        lambda: f"record_enabled must be bool, int32 or int64, got {record_enabled.dtype}",
    )
    torch._check(
        num_unpadded_tokens.numel() == 1,
        lambda: f"num_unpadded_tokens must be a 0-dim or 1-element tensor, got {tuple(num_unpadded_tokens.shape)}",
    )
    torch._check(
        num_unpadded_tokens.dtype in _ID_DTYPES,
        lambda: f"num_unpadded_tokens must be int32 or int64, got {num_unpadded_tokens.dtype}",
    )


def token_replica_hash(num_tokens: int, device: torch.device) -> torch.Tensor:
    """[T, 1] int64: the per-row hash that picks a replica (same for every k of a row)."""
    rows = torch.arange(num_tokens, device=device, dtype=torch.int64)  # [T]
    return ((rows * KNUTH_MULTIPLIER) & HASH_MASK).unsqueeze(1)  # [T, 1]


def map_to_physical_composite(
    topk_ids: torch.Tensor, lookup: torch.Tensor, replica_count: torch.Tensor
) -> torch.Tensor:
    """Logical expert ids [T, K] -> physical expert ids [T, K] (dtype of topk_ids).

    lookup: [num_logical, max_replicas] int32, physical slots of each logical expert, -1 padded.
    replica_count: [num_logical] int32, how many leading slots of each lookup row are valid.
    Ids outside [0, num_logical) map to -1.
    """
    num_logical, max_replicas = lookup.shape
    ids = topk_ids.long()  # [T, K]
    valid = (ids >= 0) & (ids < num_logical)  # [T, K]
    safe_ids = ids.clamp(0, max(num_logical - 1, 0))  # [T, K]
    # clamp_min(1): an integer modulo by zero would raise on CPU; routing stays total.
    count = replica_count.long()[safe_ids].clamp_min_(1)  # [T, K]
    replica = token_replica_hash(ids.shape[0], ids.device) % count  # [T, K]
    physical = lookup.reshape(-1)[safe_ids * max_replicas + replica]  # [T, K] int32
    return physical.masked_fill_(~valid, -1).to(topk_ids.dtype)


def record_load_composite(
    physical_ids: torch.Tensor,
    load: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
) -> None:
    """load[p] += 1 for each id p in [0, numel(load)) of rows < num_unpadded_tokens, if enabled.

    Padding rows, ids out of range (-1 included) and a disabled flag add zeros: the
    scatter always runs, so the kernel sequence does not depend on the flag's value.
    """
    num_physical = load.shape[0]
    ids = physical_ids.long()  # [T, K]
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)  # [T, 1]
    counted = (
        (ids >= 0)
        & (ids < num_physical)
        & (rows < num_unpadded_tokens.reshape(()).to(ids.device))
        & (record_enabled.reshape(()).to(ids.device) != 0)
    )  # [T, K]
    safe_ids = ids.clamp(0, max(num_physical - 1, 0))
    load.index_add_(0, safe_ids.reshape(-1), counted.reshape(-1).to(load.dtype))


def map_and_record_composite(
    topk_ids: torch.Tensor,
    lookup: torch.Tensor,
    replica_count: torch.Tensor,
    load: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor,
) -> torch.Tensor:
    physical = map_to_physical_composite(topk_ids, lookup, replica_count)
    record_load_composite(physical, load, record_enabled, num_unpadded_tokens)
    return physical


# --- kernels registered per dispatch key: argument checks, then an implementation -----


def checked_map_to_physical(impl):
    def map_to_physical_kernel(topk_ids, lookup, replica_count):
        check_routing_args(topk_ids, lookup, replica_count)
        return impl(topk_ids, lookup, replica_count)

    return map_to_physical_kernel


def checked_record_load(impl):
    def record_load_kernel(physical_ids, load, record_enabled, num_unpadded_tokens):
        check_record_args(physical_ids, load, record_enabled, num_unpadded_tokens)
        impl(physical_ids, load, record_enabled, num_unpadded_tokens)

    return record_load_kernel


def checked_map_and_record(impl):
    def map_and_record_kernel(topk_ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens):
        check_routing_args(topk_ids, lookup, replica_count)
        check_record_args(topk_ids, load, record_enabled, num_unpadded_tokens)
        return impl(topk_ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens)

    return map_and_record_kernel


map_to_physical_kernel = checked_map_to_physical(map_to_physical_composite)
record_load_kernel = checked_record_load(record_load_composite)
map_and_record_kernel = checked_map_and_record(map_and_record_composite)


# --- fake (meta) implementations: shapes only, for tracing ------------------------


def map_to_physical_fake(topk_ids, lookup, replica_count):
    check_routing_args(topk_ids, lookup, replica_count)
    return torch.empty_like(topk_ids)


def record_load_fake(physical_ids, load, record_enabled, num_unpadded_tokens):
    check_record_args(physical_ids, load, record_enabled, num_unpadded_tokens)


def map_and_record_fake(topk_ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens):
    check_routing_args(topk_ids, lookup, replica_count)
    check_record_args(topk_ids, load, record_enabled, num_unpadded_tokens)
    return torch.empty_like(topk_ids)
