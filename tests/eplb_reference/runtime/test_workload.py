"""The runtime's workload: seeded, server-shaped batches padded to capture sizes, a drifting hot set."""

import pytest

from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.workload import WorkloadSpec, capture_size_for, make_batch


def test_a_batch_larger_than_every_capture_size_is_rejected():
    with pytest.raises(ValueError, match="prefill_tokens=100 exceeds the largest capture size 64"):
        RunConfig(prefill_tokens=100).validate()
    with pytest.raises(ValueError, match="exceeds every capture size"):
        capture_size_for(65, (16, 64))


def test_workload_is_seeded_padded_and_drifts():
    spec = WorkloadSpec(vocab_size=256, drift_every=10)
    first, again = make_batch(spec, 3, 1), make_batch(spec, 3, 1)
    assert first.tokens.equal(again.tokens)
    assert first.kind == "decode" and first.tokens.shape == (1, 16)
    prefill = make_batch(spec, 0, 0)
    assert prefill.is_prefill and prefill.tokens.shape == (1, 64) and prefill.num_tokens == 48
    assert (prefill.tokens[0, 48:] == 0).all()
    mixed = make_batch(spec, 8, 0)
    assert mixed.kind == "mixed" and mixed.is_prefill
    early = {int(t) for step in range(1, 8) for t in make_batch(spec, step, 0).tokens[0]}
    late = {int(t) for step in range(21, 28) for t in make_batch(spec, step, 0).tokens[0]}
    assert early != late  # the hot slice moved
