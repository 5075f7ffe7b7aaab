"""The routing ops' PrivateUse1 registration run on ``npu`` tensors: opcheck, the plain-Python
reference, the layer op over live tables, and an in-place refresh under a captured NPU graph."""

import pytest
import torch

from eplb_graph import BatchFlags
from eplb_graph.core.layer_lookup import LayerLookup, RoutedLayer
from tests.custom_ops.routing_cases import flags, laid_out, random_tables
from tests.routing_reference import map_to_physical_reference, record_load_reference

ops = torch.ops.eplb_graph


def _on_npu(*tensors):
    return tuple(t.to("npu") for t in tensors)


@pytest.mark.parametrize("num_tokens,top_k", [(0, 1), (1, 8), (33, 4)])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_opcheck_on_npu(npu_emulation, num_tokens, top_k, layout):
    _, lookup, replica_count = random_tables(16, 5, seed=num_tokens)
    ids = torch.randint(-2, 18, (num_tokens, top_k), dtype=torch.int64)
    record_enabled, num_unpadded = flags(True, max(num_tokens - 1, 0), ())
    ids, lookup, replica_count, record_enabled, num_unpadded = _on_npu(ids, lookup, replica_count, record_enabled,
                                                                       num_unpadded)
    ids = laid_out(ids.cpu(), layout).to("npu") if layout == "contiguous" else ids.t().contiguous().t()
    load = torch.zeros(21, dtype=torch.int64, device="npu")
    torch.library.opcheck(ops.map_to_physical, (ids, lookup, replica_count))
    torch.library.opcheck(ops.record_load, (ids, load, record_enabled, num_unpadded))
    torch.library.opcheck(ops.map_and_record, (ids, lookup, replica_count, load.clone(), record_enabled, num_unpadded))


@pytest.mark.parametrize("record,num_unpadded", [(True, 30), (True, 0), (False, 40)])
def test_map_and_record_on_npu_matches_the_python_reference(npu_emulation, record, num_unpadded):
    _, lookup, replica_count = random_tables(12, 6, seed=5)
    ids = torch.randint(-3, 15, (40, 8), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    expected = map_to_physical_reference(ids.tolist(), lookup.tolist(), replica_count.tolist())
    record_enabled, unpadded = flags(record, num_unpadded, ())
    load = torch.zeros(18, dtype=torch.int64, device="npu")
    physical = ops.map_and_record(*_on_npu(ids, lookup, replica_count), load, *_on_npu(record_enabled, unpadded))
    assert physical.device.type == "npu" and physical.dtype == torch.int32
    assert physical.cpu().tolist() == expected
    assert load.cpu().tolist() == record_load_reference(expected, 18, record, num_unpadded)
    assert "eplb_graph::map_and_record" not in npu_emulation.fallback.ops_seen  # our kernel, not the fallback


def test_layer_op_reads_live_npu_tables_and_refresh_keeps_storage_under_a_graph(npu_emulation):
    tables, batch = LayerLookup(4, 6, device="npu"), BatchFlags("npu")
    layer = RoutedLayer("npu_layer", tables, batch)
    addresses = [t.data_ptr() for t in (tables.lookup, tables.replica_count, tables.load)]
    ids = torch.tensor([[0, 1], [2, 3], [1, 0]], device="npu")  # [T, K]
    try:
        batch.set_(record=True, num_unpadded_tokens=3)
        graph = torch.npu.NPUGraph()
        with torch.npu.graph(graph):
            physical = ops.map_and_record_layer(ids, "npu_layer")
        tables.load.zero_()  # the capture ran the work once (a real capture would not)
        graph.replay()
        assert physical.cpu().tolist() == [[0, 1], [2, 3], [1, 0]]

        tables.refresh_(torch.tensor([3, 2, 1, 0, 3, 3]))  # in place, between replays
        graph.replay()
        assert [t.data_ptr() for t in (tables.lookup, tables.replica_count, tables.load)] == addresses
        expected = map_to_physical_reference(ids.tolist(), tables.lookup.tolist(), tables.replica_count.tolist())
        assert physical.cpu().tolist() == expected and physical[0].tolist() == [3, 2]
        assert tables.load.sum().item() == 2 * 6  # two replays x 3 tokens x top-2
    finally:
        layer.close()
