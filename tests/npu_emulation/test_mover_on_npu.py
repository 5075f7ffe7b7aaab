"""GlooStagedCommunicator moving ``npu`` expert weights between two rank processes: upstream's own
rearrangement through host staging, into the very storage the weights had."""

import pytest

from eplb_reference.runtime.launch import run_ranks
from tests.npu_emulation import rank_cases


@pytest.mark.launches
def test_upstream_rearrange_moves_npu_experts_through_host_staging(npu_emulation):
    results = run_ranks(rank_cases.upstream_rearrange_moves_npu_experts_through_host_staging, 2, timeout_s=120)
    for result in results:
        assert result["equal"] and result["on_npu"] and result["storage_kept"]
        assert result["bytes_received"] > 0
        assert result["host_copies"] > 0  # staged: device -> host before gloo, host -> device after
        # no pinned allocator on the emulation: the pool says so instead of failing mid-transfer
        assert not result["pinned"] and "getPinnedMemoryAllocator" in result["unpinned_because"]
