"""CUDA kernel for ``eplb_graph::map_and_record``: map and record in one Triton launch.

Imported only where Triton and CUDA exist (see ``custom_ops/__init__.py``); the CPU
build of torch ships no Triton. One program handles BLOCK_SIZE flat (token, k) slots;
loads are masked, so the launch grid depends only on T*K, never on values, and the
kernel is safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .routing import HASH_MASK, KNUTH_MULTIPLIER

# A @triton.jit body may read a module global only when it is a constexpr: a plain int
# compiles under TRITON_INTERPRET=1 and is refused by the real GPU compile.
KNUTH_MULTIPLIER_C = tl.constexpr(KNUTH_MULTIPLIER)
HASH_MASK_C = tl.constexpr(HASH_MASK)


@triton.jit
def _map_and_record_kernel(
    topk_ids_ptr,  # [T*K] int32/int64
    lookup_ptr,  # [num_logical * max_replicas] int32
    replica_count_ptr,  # [num_logical] int32
    physical_ids_ptr,  # [T*K] out, dtype of topk_ids
    load_ptr,  # [num_physical]
    record_enabled_ptr,  # [1]
    num_unpadded_tokens_ptr,  # [1]
    numel,
    top_k,
    num_logical,
    max_replicas,
    num_physical,
    RECORD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_bounds = offsets < numel
    ids = tl.load(topk_ids_ptr + offsets, mask=in_bounds, other=-1).to(tl.int64)
    valid = in_bounds & (ids >= 0) & (ids < num_logical)
    safe_ids = tl.where(valid, ids, 0)

    count = tl.load(replica_count_ptr + safe_ids, mask=valid, other=1).to(tl.int64)
    count = tl.maximum(count, 1)
    rows = (offsets // top_k).to(tl.int64)
    replica = ((rows * KNUTH_MULTIPLIER_C) & HASH_MASK_C) % count
    physical = tl.load(lookup_ptr + safe_ids * max_replicas + replica, mask=valid, other=-1)
    physical = tl.where(valid, physical, -1)
    tl.store(physical_ids_ptr + offsets, physical.to(physical_ids_ptr.dtype.element_ty), mask=in_bounds)

    if RECORD:
        enabled = tl.load(record_enabled_ptr).to(tl.int32) != 0
        num_unpadded = tl.load(num_unpadded_tokens_ptr).to(tl.int64)
        counted = valid & enabled & (rows < num_unpadded) & (physical >= 0) & (physical < num_physical)
        safe_physical = tl.where(counted, physical, 0).to(tl.int64)
        one = tl.full([BLOCK_SIZE], 1, dtype=load_ptr.dtype.element_ty)
        tl.atomic_add(load_ptr + safe_physical, one, mask=counted)


def _launch(topk_ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens, record: bool):
    ids = topk_ids.contiguous()
    physical = torch.empty_like(ids)
    numel = ids.numel()
    if numel == 0:  # a shape, not a value: the same at capture and at every replay
        return physical
    block = 256
    _map_and_record_kernel[(triton.cdiv(numel, block),)](
        ids,
        lookup.contiguous(),
        replica_count.contiguous(),
        physical,
        load,
        record_enabled,
        num_unpadded_tokens,
        numel,
        ids.shape[1],
        lookup.shape[0],
        lookup.shape[1],
        load.shape[0],
        RECORD=record,
        BLOCK_SIZE=block,
    )
    return physical


def map_and_record_cuda(topk_ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens):
    return _launch(topk_ids, lookup, replica_count, load, record_enabled, num_unpadded_tokens, True)


def map_to_physical_cuda(topk_ids, lookup, replica_count):
    # The record pointers are never read when RECORD is False; pass valid tensors anyway.
    return _launch(topk_ids, lookup, replica_count, replica_count, replica_count, replica_count, False)
