"""Our EPLB state follows a resize of vLLM's elastic EP group, in one process, without an engine.

Upstream's own ``EplbState`` is built for a small model stand-in with elastic EP on (its buffers
sized for the capacity, ``elastic_ep_max_dp_size`` DP ranks of 5 slots each), and driven the way
upstream's elastic execution drives it: ``reconfigure_physical_expert_slots`` 10 -> 15 -> 10 (EP
2 -> 3 -> 2, ``switch_and_prepare``), commits of a rearrangement between, and ``update_mapping`` on
a new engine (``setup_eplb_from_mapping``). After each, our capacity-sized lookups route only to
slots holding the expert upstream's placement names, empty slots route and record nothing, the
lookup and load storage a graph reads is the same, and the metrics split loads over the live EP
size. Only upstream's group getters and the communicator factory are stood in for (one process).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.eplb import eplb_state as upstream_eplb  # noqa: E402
from vllm.distributed.eplb.eplb_state import EplbLayerState, EplbState  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter  # noqa: E402
from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # noqa: E402

from eplb_graph.core.placement import rank_loads  # noqa: E402
from eplb_graph.upstream import patches  # noqa: E402
from eplb_graph.upstream.binding import UpstreamBinding  # noqa: E402
from eplb_graph.vllm_plugin.layers import ROUTER_HOOK, VllmMoELayer  # noqa: E402
from eplb_graph.vllm_plugin.metrics import WorkerMetrics  # noqa: E402
from eplb_graph.vllm_plugin.elastic_follow import after_switch, follow_new_engine_mapping, slot_capacity  # noqa: E402
from eplb_graph.vllm_plugin.worker import VllmEplbWorker  # noqa: E402

NUM_LOGICAL, NUM_LOCAL, NUM_LAYERS, MAX_DP = 8, 5, 2, 4
CAPACITY = NUM_LOCAL * MAX_DP  # upstream's physical_expert_capacity at TP=1


class ToyMoE:
    """What ``EplbState.add_model`` and ``switch_and_prepare`` read of a MixtureOfExperts."""

    def __init__(self, prefix: str, ep_size: int) -> None:
        self.num_moe_layers, self.num_logical_experts, self.num_routed_experts = NUM_LAYERS, NUM_LOGICAL, NUM_LOGICAL
        self.num_expert_groups, self.num_shared_experts = 1, 0
        self.update_physical_experts_metadata(NUM_LOCAL * ep_size, NUM_LOCAL)
        self.moe_layers = []
        for index in range(NUM_LAYERS):
            state = EplbLayerState()
            router = CPURouter(top_k=2, global_num_experts=NUM_LOGICAL, eplb_state=state)
            self.moe_layers.append(SimpleNamespace(layer_name=f"{prefix}.{index}", eplb_state=state, router=router))
        self.expert_weights = [[torch.zeros(NUM_LOCAL, 4)] for _ in range(NUM_LAYERS)]

    def update_physical_experts_metadata(self, num_physical_experts: int, num_local_physical_experts: int) -> None:
        self.num_physical_experts, self.num_local_physical_experts = num_physical_experts, num_local_physical_experts
        self.num_redundant_experts = num_physical_experts - NUM_LOGICAL

    def set_eplb_state(self, expert_load_view, logical_to_physical_map, logical_replica_count) -> None:
        for index, layer in enumerate(self.moe_layers):
            layer.eplb_state.set_layer_state(index, expert_load_view, logical_to_physical_map, logical_replica_count)


@pytest.fixture
def group(monkeypatch):
    """The EP group upstream's getters answer with; a resize changes its size."""
    ep = SimpleNamespace(world_size=2, rank_in_group=0)
    monkeypatch.setattr(upstream_eplb, "get_ep_group", lambda: ep)
    monkeypatch.setattr(parallel_state, "get_ep_group", lambda: ep)
    monkeypatch.setattr(upstream_eplb, "get_eplb_group", lambda: None)
    monkeypatch.setattr(upstream_eplb, "create_eplb_communicator", lambda **kwargs: None)
    return ep


def parallel_config(dp_size: int, *, elastic: bool = True) -> SimpleNamespace:
    eplb = SimpleNamespace(use_async=False, window_size=4, step_interval=100, policy="default",
                           communicator="torch_gloo")
    return SimpleNamespace(enable_elastic_ep=elastic, elastic_ep_max_dp_size=MAX_DP, data_parallel_size=dp_size,
                           num_ubatches=0, eplb_config=eplb)


class Engine:
    """One engine's worker, bound as ``VllmEplbWorker`` binds it: upstream's state, our layers,
    a runner carrying them; the binding is the process's one (two engines here share it)."""

    def __init__(self, binding: UpstreamBinding, name: str, dp_size: int, *, elastic: bool = True) -> None:
        self.model_config = SimpleNamespace(model=name, compute_hash=lambda: name)
        self.parallel_config = parallel_config(dp_size, elastic=elastic)
        self.model = ToyMoE(name, dp_size)
        self.state = EplbState(self.parallel_config, torch.device("cpu"))
        self.state.add_model(self.model, self.model_config)
        self.model_state = self.state.model_states[name]
        self.binding = binding
        capacity = slot_capacity(self.parallel_config, self.model_state)
        committed = self.model_state.physical_to_logical_map.cpu()
        self.layers = [
            VllmMoELayer(runner, num_logical_experts=NUM_LOGICAL, num_physical_experts=self.model.num_physical_experts,
                         placement=committed[index], mapped_by=ROUTER_HOOK, router_path=None, capacity=capacity)
            for index, runner in enumerate(self.model.moe_layers)
        ]
        self.binding.bind(self.model, self.layers)
        self.runner = CPUModelRunner.__new__(CPUModelRunner)  # only what setup_eplb_from_mapping reads
        self.runner.eplb_state, self.runner.model_config = self.state, self.model_config
        self.runner.parallel_config = self.parallel_config
        self.worker = VllmEplbWorker.__new__(VllmEplbWorker)  # its elastic methods need the runner and binding
        self.worker.runner, self.worker.binding = self.runner, self.binding
        self.worker.dp_dispatch, self.worker.local_experts = None, {}  # no DP dispatch, no EP experts here
        self.pointers = self.storage()

    def storage(self) -> list[tuple[int, int, int]]:
        return [(layer.lookup.data_ptr(), layer.replica_count.data_ptr(), layer.load.data_ptr()) for layer in self.layers]

    def switch(self, group, new_ep_size: int) -> None:
        """What ``switch_and_prepare`` does to EPLB (elastic_execute.py): the new group, the
        re-viewed slots, the model's metadata; then our ``after_switch``."""
        group.world_size = new_ep_size
        self.state.reconfigure_physical_expert_slots(self.model_config, NUM_LOCAL * new_ep_size)
        self.model.set_eplb_state(self.model_state.expert_load_pass_buffer, self.model_state.logical_to_physical_map,
                                  self.model_state.logical_replica_count)
        self.model.update_physical_experts_metadata(NUM_LOCAL * new_ep_size, NUM_LOCAL)
        after_switch(self.worker)

    def close(self) -> None:
        patches.uninstall("worker.setup_eplb_from_mapping", on=self.runner)
        for layer in self.layers:
            layer.close()


@pytest.fixture
def engines():
    made, binding = [], UpstreamBinding("cpu")
    yield lambda *args, **kwargs: made.append(Engine(binding, *args, **kwargs)) or made[-1]
    for engine in reversed(made):
        engine.close()
    binding.close()


def assert_routes_as_upstream_places(engine: Engine) -> None:
    """Every logical expert reaches only slots upstream's placement gives it; empty slots (-1,
    and every slot beyond the ones placed) are reached by nothing and record nothing; the
    storage a graph reads is the one bound at the start."""
    placed = engine.model_state.physical_to_logical_map.cpu()  # [L, num_physical now]
    assert placed.shape[1] == engine.model.num_physical_experts
    assert engine.storage() == engine.pointers
    for index, layer in enumerate(engine.layers):
        expected = torch.full((CAPACITY,), -1, dtype=torch.int64)
        expected[: placed.shape[1]] = placed[index]
        assert layer.tables.physical_to_logical.tolist() == expected.tolist()
        layer.check_agrees_with_upstream()
        engine.state.should_record_tensor.fill_(True)
        layer.upstream.num_unpadded_tokens_tensors[0].fill_(64)
        layer.load.zero_()
        ids = torch.arange(NUM_LOGICAL).repeat(8).reshape(-1, 2)  # [32, 2]: every expert, many tokens
        ids = torch.cat([ids, ids.flip(1)])  # [64, 2]
        physical = torch.ops.eplb_graph.map_and_record_layer(ids.to(torch.int32), layer.key).long()
        assert (physical >= 0).all() and (physical < placed.shape[1]).all()
        assert torch.equal(expected[physical], ids.long())  # each slot holds the expert routed to it
        assert int(layer.load[expected < 0].sum()) == 0 and int(layer.load.sum()) == ids.numel()
        # the load is upstream's own capacity row: what its window sums
        assert layer.load.data_ptr() == engine.model_state.expert_load_pass_buffer[index].data_ptr()


def test_capacity_tables_follow_a_resize_2_3_2_with_storage_kept(group, engines):
    engine = engines("elastic-resize", 2)
    assert slot_capacity(engine.parallel_config, engine.model_state) == CAPACITY == 20
    layer = engine.layers[0]
    assert (layer.tables.num_physical_experts, layer.tables.max_replicas) == (CAPACITY, CAPACITY - NUM_LOGICAL + 1)
    assert_routes_as_upstream_places(engine)
    metrics = WorkerMetrics({"model_name": "m", "engine": "0", "ep_rank": "0"}, ep_size=VllmEplbWorker.current_ep_size,
                            publish_dir=None)

    engine.switch(group, 3)  # scale-up: 15 slots, the new rank's 5 empty until experts move there
    assert engine.worker.ep_size == 3 and metrics.ep_size == 3
    assert_routes_as_upstream_places(engine)
    assert (layer.tables.physical_to_logical[10:] == -1).all()

    # the scale-up's rearrangement commits a placement using the new rank's slots (commit hook)
    spread = torch.tensor([list(range(NUM_LOGICAL)) + [0, 1, 2, 3, 4, 5, 6]] * NUM_LAYERS)  # [L, 15]
    upstream_eplb._commit_eplb_maps(engine.model_state, new_physical_to_logical_map=spread)
    assert_routes_as_upstream_places(engine)
    assert (layer.tables.physical_to_logical[10:15] >= 0).all()
    per_rank = rank_loads(torch.ones(NUM_LAYERS, NUM_LOGICAL), engine.model_state.physical_to_logical_map, engine.worker.ep_size)
    assert per_rank.shape == (NUM_LAYERS, 3)  # 15 slots over the live 3 ranks (the bind-time 2 raised)

    # scale-down: upstream first moves the departing rank's experts to the survivors (its sync
    # reshuffle commits the 10 slots left), then switches back to EP 2
    survivors = torch.tensor([list(range(NUM_LOGICAL)) + [7, 0]] * NUM_LAYERS)  # [L, 10]
    upstream_eplb._commit_eplb_maps(engine.model_state, new_physical_to_logical_map=survivors)
    assert (layer.tables.physical_to_logical[10:] == -1).all()
    engine.switch(group, 2)
    assert engine.worker.ep_size == 2
    assert_routes_as_upstream_places(engine)
    assert engine.model_state.physical_to_logical_map[0].tolist() == survivors[0].tolist()
    assert rank_loads(torch.ones(NUM_LAYERS, NUM_LOGICAL), engine.model_state.physical_to_logical_map,
                      engine.worker.ep_size).shape == (NUM_LAYERS, 2)


def test_a_new_engine_routes_by_the_mapping_upstream_installs_past_the_commit_hooks(group, engines):
    existing = engines("elastic-existing", 2)
    placed = torch.tensor([[7, 6, 5, 4, 3, 2, 1, 0, 7, 7]] * NUM_LAYERS)
    upstream_eplb._commit_eplb_maps(existing.model_state, new_physical_to_logical_map=placed)
    mapping = existing.model_state.physical_to_logical_map_buffer.clone()  # [L, capacity]: what is broadcast

    group.world_size = 3  # the new engine starts in the new group: 15 slots, upstream's initial placement
    new = engines("elastic-new", 3)
    assert new.model.num_physical_experts == 15 and new.layers[0].tables.num_physical_experts == CAPACITY
    follow_new_engine_mapping(new.worker)
    assert patches.installed("worker.setup_eplb_from_mapping", on=new.runner)
    assert new.layers[0].tables.physical_to_logical[:15].tolist() != [7, 6, 5, 4, 3, 2, 1, 0, 7, 7] + [-1] * 5
    committed_before = new.binding.stats.layers_committed  # the existing engine's commit (shared binding)
    new.runner.setup_eplb_from_mapping(mapping)  # upstream's update_mapping: no commit function runs
    assert new.layers[0].tables.physical_to_logical.tolist() == placed[0].tolist() + [-1] * (CAPACITY - 10)
    assert_routes_as_upstream_places(new)  # the new rank's slots 10..14 empty: nothing routed to it yet
    assert new.binding.stats.layers_committed == committed_before  # a refresh, not a rearrangement


def test_with_elastic_off_the_tables_are_todays_size(group, engines):
    engine = engines("elastic-off", 2, elastic=False)
    assert slot_capacity(engine.parallel_config, engine.model_state) is None
    tables = engine.layers[0].tables
    assert (tables.num_physical_experts, tables.max_replicas, tables.allow_empty_slots) == (10, 3, False)
    assert engine.layers[0].load.shape == (10,)
    placed = engine.model_state.physical_to_logical_map.cpu()
    for index, layer in enumerate(engine.layers):
        assert layer.tables.physical_to_logical.tolist() == placed[index].tolist()
        layer.check_agrees_with_upstream()


def test_graphs_are_kept_unless_the_operator_asks_for_upstreams_reset():
    from eplb_graph.vllm_plugin.elastic_follow import keep_graphs

    assert keep_graphs({}) and keep_graphs({"EPLB_GRAPH_ELASTIC_KEEP_GRAPHS": "1"})
    assert not keep_graphs({"EPLB_GRAPH_ELASTIC_KEEP_GRAPHS": "0"})
    with pytest.raises(ValueError, match="EPLB_GRAPH_ELASTIC_KEEP_GRAPHS='true': 1 keeps"):
        keep_graphs({"EPLB_GRAPH_ELASTIC_KEEP_GRAPHS": "true"})
