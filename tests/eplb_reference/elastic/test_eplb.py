"""``runtime/elastic/eplb.py``: what upstream's EPLB sees of an elastic member, in one process.

Upstream's async EPLB running in a generation of several members, drained before each switch
and discarded at a death, runs between processes in ``test_scripted.py`` (its reports count
each generation's rearrangements) and under traffic in ``test_server.py``.
"""

from types import SimpleNamespace

import pytest
import torch

from eplb_graph.custom_ops import EP_GROUPS
from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.eplb import (
    ElasticEplb, GenerationCoordinator, elastic_eplb_session, placement_balancedness,
)
from eplb_reference.elastic.stack import build_elastic_models

parallel_state = pytest.importorskip("vllm.distributed.parallel_state")


def test_balancedness_splits_each_experts_load_over_its_replicas():
    load = torch.tensor([[30.0, 10.0]])  # [L, E]
    # rank 0 holds 2 of expert 0's 3 replicas (20), rank 1 the third (10) and expert 1 (10): balanced
    assert placement_balancedness(load, torch.tensor([[0, 0, 0, 1]]), ranks=2) == 1.0
    # every replica of expert 0 on rank 0: 30 against 10
    assert placement_balancedness(load, torch.tensor([[0, 0, 1, -1]]), ranks=2) == pytest.approx(20 / 30)


class Slot:
    """The elastic group as the coordinator resolves it by name."""

    def __init__(self, ep, eplb, rank, size):
        self.process_group, self.eplb_process_group, self.rank, self.size = ep, eplb, rank, size
        self.generation = SimpleNamespace(index=3)
        self.collectives = 0

    def current(self):
        self.collectives += 1
        return self.process_group, self.rank, self.size


def test_the_coordinator_follows_the_group_registered_under_its_name():
    slot = Slot("ep-group", "eplb-group", 1, 3)
    EP_GROUPS.register("coordinator-test", slot)
    try:
        ep, eplb = GenerationCoordinator("coordinator-test", "ep"), GenerationCoordinator("coordinator-test", "eplb")
        assert (ep.cpu_group, ep.device_group, eplb.cpu_group) == ("ep-group", "ep-group", "eplb-group")
        assert slot.collectives == 2  # the main thread's reads count (the keep-alive reports them), the worker's not
        assert (ep.rank_in_group, ep.world_size) == (1, 3)
        slot.process_group, slot.rank, slot.size = "next-group", 0, 4  # a switch: read at every call
        assert (ep.cpu_group, ep.rank_in_group, ep.world_size) == ("next-group", 0, 4)
        slot.eplb_process_group = None
        with pytest.raises(RuntimeError, match="has no eplb group in generation 3"):
            eplb.cpu_group
    finally:
        EP_GROUPS.unregister("coordinator-test")


def test_the_session_puts_the_runs_eplb_config_and_the_elastic_groups_in_upstreams_place():
    from vllm.config import get_current_vllm_config

    before = parallel_state._EP, parallel_state._EPLB
    cfg = RunConfig(window_size=7, step_interval=11)
    with elastic_eplb_session(cfg, "session-test", max_ranks=4):
        assert isinstance(parallel_state.get_ep_group(), GenerationCoordinator)
        assert parallel_state.get_eplb_group().kind == "eplb" and parallel_state.get_node_count() == 1
        eplb = get_current_vllm_config().parallel_config.eplb_config
        assert (eplb.window_size, eplb.step_interval, eplb.use_async) == (7, 11, True)
    assert (parallel_state._EP, parallel_state._EPLB) == before


def test_without_a_controller_the_tables_record_what_a_resize_balances():
    cfg = RunConfig(mode="eager")
    models = build_elastic_models(cfg, member=0, founding_rank=0, max_ranks=4, group_name="no-controller-test")
    eplb = ElasticEplb(models, cfg, timeout_s=5)
    eplb.start(SimpleNamespace(size=1, generation=SimpleNamespace(index=0)))  # one member: nothing to balance
    assert not eplb.running
    for layer in models.rank_layers:  # the rows graphs hold: one buffer, the maximum size's width
        assert layer.tables.load.data_ptr() in {row.data_ptr() for row in models.load}
    eplb.begin_batch(num_unpadded_tokens=5, is_prefill=False)
    assert bool(models.flags.record_enabled) and int(models.flags.num_unpadded_tokens) == 5
    models.load[0, 0] = 4  # slot 0 hosts logical expert 0 in the initial placement
    assert eplb.end_batch() is False
    load = eplb.stop()
    assert load.shape == (cfg.num_layers, cfg.num_experts) and load[0, 0] == 4 and int(load.sum()) == 4
    eplb.begin_batch(num_unpadded_tokens=0, is_prefill=False, record=False)  # a catch-up step records nothing
    assert not bool(models.flags.record_enabled)
    assert eplb.summary() == {"rearrangements_finished": {}, "layers_committed": {}, "rearrangement_stalls": {}}
    for layer in models.rank_layers:
        layer.close()
