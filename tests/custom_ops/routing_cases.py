"""Random valid routing tables and batch flags, shared by the routing-op tests."""

import torch

from eplb_graph import build_lookup, validate_placement


def random_tables(num_logical: int, num_redundant: int, seed: int):
    """A random valid placement and its tables: every expert once, extra slots random."""
    gen = torch.Generator().manual_seed(seed)
    extra = torch.randint(0, num_logical, (num_redundant,), generator=gen)
    placement = torch.cat([torch.arange(num_logical), extra])[torch.randperm(num_logical + num_redundant, generator=gen)]
    max_replicas = num_redundant + 1
    placement = validate_placement(placement, num_logical, num_logical + num_redundant, max_replicas)
    lookup, replica_count = build_lookup(placement, num_logical, max_replicas)
    return placement, lookup, replica_count


def flags(record: bool, num_unpadded: int, shape=()):
    return (
        torch.full(shape, record, dtype=torch.bool),
        torch.full(shape, num_unpadded, dtype=torch.int32),
    )
