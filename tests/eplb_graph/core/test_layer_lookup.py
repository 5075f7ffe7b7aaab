import pytest
import torch

from eplb_graph import BatchFlags, LayerLookup, initial_placement
from tests.markers import requires_cuda


ops = torch.ops.eplb_graph


def test_refresh_writes_in_place():
    layer = LayerLookup(4, 6)
    tensors = (layer.lookup, layer.replica_count, layer.load)
    pointers = [t.data_ptr() for t in tensors]
    layer.refresh_(torch.tensor([2, 2, 0, 1, 3, 2]))
    assert (layer.lookup, layer.replica_count, layer.load) == tensors
    assert [t.data_ptr() for t in tensors] == pointers
    assert layer.lookup.tolist() == [[2, -1, -1], [3, -1, -1], [0, 1, 5], [4, -1, -1]]
    assert layer.replica_count.tolist() == [1, 1, 3, 1]
    assert layer.physical_to_logical.tolist() == [2, 2, 0, 1, 3, 2]


@pytest.mark.parametrize(
    "placement,match",
    [
        (torch.tensor([0, 1, 2, 3, 0]), "5 physical slots, expected 6"),
        (torch.tensor([0, 1, 2, 3, 4, 0]), "slot 4 holds logical id 4, outside"),
        (torch.tensor([0, 1, 2, -1, 0, 1]), "slot 3 holds logical id -1"),
        (torch.tensor([0, 1, 2, 2, 0, 1]), r"logical experts \[3\] have no replica"),
        (torch.tensor([0, 1, 2, 3, 0, 0, 0])[:6].reshape(2, 3), "1-D"),
        (torch.tensor([0.0, 1, 2, 3, 0, 1]), "integer logical ids"),
    ],
)
def test_invalid_placement_is_rejected_and_tables_untouched(placement, match):
    layer = LayerLookup(4, 6)
    before = (layer.lookup.clone(), layer.replica_count.clone(), layer.physical_to_logical.clone())
    with pytest.raises(ValueError, match=match):
        layer.refresh_(placement)
    assert torch.equal(layer.lookup, before[0])
    assert torch.equal(layer.replica_count, before[1])
    assert torch.equal(layer.physical_to_logical, before[2])


def test_too_many_replicas_for_the_table_is_rejected():
    layer = LayerLookup(4, 8, max_replicas=2)
    with pytest.raises(ValueError, match="logical expert 0 has 3 replicas, more than max_replicas=2"):
        layer.refresh_(torch.tensor([0, 1, 2, 3, 0, 0, 1, 2]))


def test_constructor_rejects_impossible_sizes():
    with pytest.raises(ValueError, match="num_logical_experts <= num_physical_experts"):
        LayerLookup(8, 6)
    with pytest.raises(ValueError, match="num_unpadded_tokens must be >= 0"):
        BatchFlags().set_(record=True, num_unpadded_tokens=-1)


def test_flags_are_written_into_their_own_storage_shared_ones_included():
    own = BatchFlags()
    record_tensor, tokens_tensor = own.record_enabled, own.num_unpadded_tokens
    own.set_(record=False, num_unpadded_tokens=7)
    assert own.record_enabled is record_tensor and own.num_unpadded_tokens is tokens_tensor  # what a graph holds
    assert own.record_enabled.item() is False and own.num_unpadded_tokens.item() == 7

    upstream_record, upstream_tokens = torch.ones(1, dtype=torch.bool), torch.zeros(3, dtype=torch.int32)[1:2]
    shared = BatchFlags.sharing(upstream_record, upstream_tokens)
    shared.set_(record=False, num_unpadded_tokens=5)
    assert upstream_record.tolist() == [False] and upstream_tokens.tolist() == [5]
    with pytest.raises(OverflowError):  # too large for upstream's int32: nothing is written
        shared.set_(record=True, num_unpadded_tokens=2**40)
    assert upstream_record.tolist() == [False] and upstream_tokens.tolist() == [5]


def test_logical_load_folds_replicas():
    layer = LayerLookup(3, 5, placement=torch.tensor([0, 1, 2, 0, 0]))
    layer.load.copy_(torch.tensor([1, 2, 3, 4, 5]))
    assert layer.logical_load().tolist() == [10, 2, 3]


def _route_through(layer: LayerLookup, batch: BatchFlags):
    def route(ids):  # [T, K] logical -> physical
        return ops.map_and_record(
            ids, layer.lookup, layer.replica_count, layer.load, batch.record_enabled, batch.num_unpadded_tokens
        )

    return route


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_refreshed_lookup_survives_compilation_without_recompiles(backend):
    layer = LayerLookup(4, 6)
    batch = BatchFlags()
    batch.set_(record=True, num_unpadded_tokens=64)
    compiled = torch.compile(_route_through(layer, batch), backend=backend, fullgraph=True)
    ids = torch.arange(4).repeat(16).reshape(64, 1)  # every expert, 16 tokens each
    pointer = layer.lookup.data_ptr()

    first = compiled(ids)
    assert set(first[ids[:, 0] == 3].flatten().tolist()) == {3}

    new_placement = torch.tensor([3, 3, 0, 1, 2, 3])  # expert 3 now lives in slots 0, 1, 5
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            layer.refresh_(new_placement)
            after = compiled(ids)
            assert torch.equal(after, ops.map_to_physical(ids, layer.lookup, layer.replica_count))
            layer.refresh_(initial_placement(4, 2))
            again = compiled(ids)

    assert layer.lookup.data_ptr() == pointer
    assert set(after[ids[:, 0] == 3].flatten().tolist()) == {0, 1, 5}
    assert torch.equal(again, first)
    # every call recorded into the same live buffer: 7 calls x 64 tokens
    assert int(layer.load.sum()) == 7 * 64
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@requires_cuda
def test_refreshed_lookup_survives_cuda_graph_replay():
    layer = LayerLookup(4, 6, device="cuda")
    batch = BatchFlags("cuda")
    batch.set_(record=True, num_unpadded_tokens=64)
    ids = torch.arange(4, device="cuda").repeat(16).reshape(64, 1)
    route = _route_through(layer, batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (Triton JIT) outside capture
        route(ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        physical = route(ids)
    layer.reset_load_()
    graph.replay()
    assert set(physical[ids[:, 0] == 3].flatten().tolist()) == {3}
    layer.refresh_(torch.tensor([3, 3, 0, 1, 2, 3]))
    batch.set_(record=True, num_unpadded_tokens=8)
    graph.replay()
    assert set(physical[ids[:, 0] == 3].flatten().tolist()) == {0, 1, 5}
    assert int(layer.load.sum()) == 64 + 8  # the replay read the new unpadded count


def test_a_lookup_with_empty_slots_routes_and_folds_load_only_onto_hosted_slots():
    from eplb_graph.core.layer_lookup import LayerLookup

    tables = LayerLookup(2, 6, placement=torch.tensor([0, 1, -1, -1, 1, -1]), allow_empty_slots=True)
    assert tables.replica_count.tolist() == [1, 2] and tables.lookup[1, :2].tolist() == [1, 4]
    tables.load.copy_(torch.tensor([3, 1, 0, 0, 2, 0]))
    assert tables.logical_load().tolist() == [3, 3]
