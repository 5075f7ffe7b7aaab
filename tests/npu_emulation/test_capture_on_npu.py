"""CapturedForward's graph-mode cases (tests/eplb_graph/graph/test_graph_capture.py) on the emulated
device's NPUGraph: replays read the captured addresses, so an in-place commit is followed without
recapture and a replaced table is recaptured and counted, from real ``npu`` data pointers."""

import pytest

from eplb_graph.graph.graph_capture import NpuGraph, device_graph_factory
from tests.eplb_graph.graph import test_graph_capture as cases

DEVICE_CASES = [
    cases.test_replays_follow_in_place_moves_without_recapture,
    cases.test_a_replaced_table_is_recaptured_and_counted,
    cases.test_checked_between_steps_a_replay_reads_no_address_and_a_replaced_table_recaptures_every_size,
]


@pytest.mark.parametrize("case", DEVICE_CASES, ids=lambda case: case.__name__.removeprefix("test_"))
def test_graph_capture_case_on_npu(npu_emulation, case):
    graphs_before = npu_emulation.capture.graphs_captured
    case("npu", NpuGraph)
    assert npu_emulation.capture.graphs_captured > graphs_before  # captured by the emulated device, not a double


def test_the_npu_graph_factory_needs_the_device_and_gives_npu_graphs(npu_emulation):
    assert device_graph_factory("npu") is NpuGraph
