"""Shared by the routing-op tests: random valid tables, batch flags, dtypes and memory layouts
of the arguments, and the check that a layer kernel follows its layer's live tables."""

from collections.abc import Callable

import torch
from hypothesis import strategies as st

from eplb_graph import BatchFlags, build_lookup, validate_placement
from eplb_graph.custom_ops.routing import map_and_record_composite
from eplb_graph.core.layer_lookup import LayerLookup, RoutedLayer

ID_DTYPES = (torch.int32, torch.int64)
# Every dtype the torch composite counts into (index_add_'s on CPU): the kernels must take each.
LOAD_DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
)
# A 0-dim flag (BatchFlags' own) and a 1-element one (a row of someone else's buffer).
FLAG_SHAPES = ((), (1,))
LAYOUTS = ("contiguous", "transposed", "strided")

# Hypothesis arguments of a routing case: table sizes, a batch, its flags, the ids' dtype.
ROUTING_CASES = dict(
    num_logical=st.integers(1, 12),
    num_redundant_experts=st.integers(0, 6),
    num_tokens=st.integers(0, 40),
    top_k=st.integers(1, 8),
    num_unpadded=st.integers(0, 50),
    record=st.booleans(),
    seed=st.integers(0, 2**16),
    id_dtype=st.sampled_from([torch.int32, torch.int64]),
)


def random_tables(num_logical: int, num_redundant_experts: int, seed: int):
    """A random valid placement and its tables: every expert once, extra slots random."""
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, num_logical, (num_redundant_experts,), generator=gen)
    placement = torch.cat([torch.arange(num_logical), extra])[torch.randperm(num_logical + num_redundant_experts, generator=gen)]
    max_replicas = num_redundant_experts + 1
    placement = validate_placement(placement, num_logical, num_logical + num_redundant_experts, max_replicas)
    lookup, replica_count = build_lookup(placement, num_logical, max_replicas)
    return placement, lookup, replica_count


def laid_out(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in another memory layout: contiguous; "transposed" (2-d only), the
    ``.t()`` of a contiguous transpose (a [K, T] top-k read as [T, K]); "strided", every other
    element of a larger tensor's last dim, at a storage offset."""
    if layout == "contiguous":
        return tensor.contiguous()
    if layout == "transposed":
        if tensor.dim() != 2:
            raise ValueError(f"only a 2-d tensor has a transposed layout, got {tuple(tensor.shape)}")
        return tensor.t().contiguous().t()
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1] + 1, dtype=tensor.dtype)
    view = wide[..., 1::2]
    view.copy_(tensor)
    return view


def as_load(counts: list[int], dtype: torch.dtype) -> list:
    """The reference's exact counts as a load buffer of ``dtype`` holds them (bool: counted at all)."""
    return torch.tensor(counts, dtype=torch.int64).to(dtype).tolist()


def flags(record: bool, num_unpadded: int, shape=()):
    return (
        torch.full(shape, record, dtype=torch.bool),
        torch.full(shape, num_unpadded, dtype=torch.int32),
    )


def check_layer_kernel_follows_its_tables(map_and_record_layer: Callable[[torch.Tensor, str], torch.Tensor],
                                          key: str) -> None:
    """``map_and_record_layer(ids, key)`` (the registered op, or a device's layer kernel) reads
    the named layer's live tables at every call, as a replayed graph must: an in-place refresh,
    the record flag, the padding count and a rebound load buffer all take effect at the next call."""
    tables, batch = LayerLookup(4, 6), BatchFlags()
    layer = RoutedLayer(key, tables, batch)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]])  # [T, K]

    def expected(load):
        return map_and_record_composite(ids, tables.lookup, tables.replica_count, load, batch.record_enabled,
                                        batch.num_unpadded_tokens)

    try:
        batch.set_(record=True, num_unpadded_tokens=2)
        first = map_and_record_layer(ids, key)
        assert torch.equal(first, expected(torch.zeros(6, dtype=tables.load.dtype)))
        assert torch.equal(first, ids)  # initial placement: expert e in slot e
        first_load = tables.load.clone()
        assert first_load.tolist() == [1, 1, 1, 1, 0, 0]  # two unpadded rows counted

        tables.refresh_(torch.tensor([3, 2, 1, 0, 3, 3]))  # in place: expert 3 now has three replicas
        batch.set_(record=False, num_unpadded_tokens=3)
        after = map_and_record_layer(ids, key)
        assert torch.equal(after, expected(torch.zeros(6, dtype=tables.load.dtype)))
        assert after[0].tolist() == [3, 2]
        assert torch.equal(tables.load, first_load)  # recording off: nothing counted

        rebound = torch.zeros(6, dtype=tables.load.dtype)
        tables.bind_load_(rebound)
        batch.set_(record=True, num_unpadded_tokens=3)
        physical = map_and_record_layer(ids, key)
        reference_load = torch.zeros(6, dtype=tables.load.dtype)
        assert torch.equal(physical, expected(reference_load))
        assert torch.equal(rebound, reference_load) and int(rebound.sum()) == 6  # the new buffer counts
    finally:
        layer.close()
