"""Plain-Python statements of what the routing ops must compute (test oracle only)."""

KNUTH_MULTIPLIER = 2654435769


def map_to_physical_reference(topk_ids, lookup, replica_count):
    """Lists in, lists out: one Python loop per (token, k), no torch."""
    num_logical = len(lookup)
    out = []
    for token, row in enumerate(topk_ids):
        replica_hash = (token * KNUTH_MULTIPLIER) & 0xFFFFFFFF
        mapped = []
        for expert in row:
            if 0 <= expert < num_logical:
                mapped.append(lookup[expert][replica_hash % max(replica_count[expert], 1)])
            else:
                mapped.append(-1)
        out.append(mapped)
    return out


def record_load_reference(physical_ids, num_physical, record_enabled, num_unpadded_tokens):
    load = [0] * num_physical
    if not record_enabled:
        return load
    for token, row in enumerate(physical_ids):
        if token >= num_unpadded_tokens:
            break
        for p in row:
            if 0 <= p < num_physical:
                load[p] += 1
    return load
