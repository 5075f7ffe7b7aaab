"""GlooStagedCommunicator: upstream's own rearrangement driven through it equals the direct layout."""

import pytest

from eplb_reference.runtime.launch import run_ranks
from tests.eplb_reference.runtime import multirank_cases


pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast


def test_upstream_rearrange_with_gloo_staged_communicator_matches_direct_layout():
    results = run_ranks(multirank_cases.upstream_rearrange_with_our_communicator, 2, timeout_s=120)
    assert all(r["equal"] for r in results)
    assert sum(r["bytes_received"] for r in results) > 0
