"""vLLM's elastic EP scaling steps on CPU (``elastic_scaling.py``): each adaptation on stand-ins
for upstream's executor, worker and groups, and their installation on upstream's class. What a
resize does end to end is test_elastic_server.py's."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("vllm")

from eplb_graph.upstream import patches  # noqa: E402
from eplb_graph.vllm_plugin import elastic_scaling  # noqa: E402
from eplb_graph.vllm_plugin.elastic_scaling import KEYS, ElasticCpuScaling  # noqa: E402


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def executor(reuse: bool = False, runner=None) -> SimpleNamespace:
    worker = Recorder()
    worker.model_runner = runner
    worker.device = torch.device("cpu")
    return SimpleNamespace(worker=worker, _can_reuse_fused_moe_kernel=lambda: reuse, warm_and_capture=worker.warmed)


def test_a_new_engine_loads_the_checkpoint_not_dummy_weights():
    upstream_called = []
    load = elastic_scaling.load_model(lambda self: upstream_called.append(self))
    scaling = executor()
    load(scaling)
    assert scaling.worker.calls == [("load_model", (), {})] and not upstream_called


def test_no_side_transfers_the_non_expert_weights():
    model = torch.nn.Linear(2, 2)
    before = model.weight.detach().clone()
    transfer = elastic_scaling.batch_transfer_weights(None)
    assert transfer(model, False, 0, None, []) is None  # no group is touched (None would raise)
    assert torch.equal(model.weight, before)


def test_the_new_groups_are_warmed_on_their_own_process_groups(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    group = dist.ProcessGroupGloo(store, 0, 1)  # a group c10d never registered, as a stateless one
    reduced = []

    class Counting:
        def allreduce(self, tensors):
            reduced.append(tensors[0].clone())
            return group.allreduce(tensors)

    warm = elastic_scaling.warm_target_groups(None)
    groups = SimpleNamespace(device_group=Counting())
    warm(executor(), groups, groups)
    assert len(reduced) == 2 and all(t.dtype == torch.int32 for t in reduced)


@pytest.mark.parametrize("reuse", [False, True])
def test_a_new_engine_skips_upstreams_kernel_warm_up(reuse):
    warm = elastic_scaling.warmup_new_worker(None)
    scaling = executor(reuse)
    warm(scaling)
    assert [name for name, *_ in scaling.worker.calls] == (["warmed"] if reuse else [])


def test_where_graphs_are_kept_a_new_engine_compiles_alone_before_it_joins():
    """Its warm-up forward runs before the commit, DP coordination skipped and the dispatch alone; the
    compile watch starts after it, so a compile at the commit is reported as one while serving."""
    from vllm.v1.worker.dp_utils import should_skip_dp_coordination

    from eplb_graph.vllm_plugin.compile_watch import CompileWatch
    from eplb_graph.vllm_plugin.dp_dispatch import VllmGroupSlot

    slot = VllmGroupSlot(device_group=object(), rank=2, size=3, token_counts=lambda: [1, 1, 1])
    watch = CompileWatch(lambda: 4, logging.getLogger("test"))
    bound = SimpleNamespace(keeps_graphs=True, dp_dispatch=SimpleNamespace(slot=slot), compile_watch=watch)
    scaling = executor(runner=SimpleNamespace(eplb_graph=bound))
    seen = []
    scaling.warm_and_capture = lambda: seen.append((should_skip_dp_coordination(), slot.current(),
                                                     watch.since_start()))
    elastic_scaling.warmup_new_worker(None)(scaling)
    assert seen == [(True, (None, 2, 3), None)]  # alone, the group's size kept; the watch not yet started
    assert slot.current()[0] is slot.device_group and not should_skip_dp_coordination()
    assert watch.since_start() == 0
    bound.keeps_graphs = False  # upstream resets the graphs at the switch: nothing to compile before it
    elastic_scaling.warmup_new_worker(None)(scaling)
    assert len(seen) == 1


def test_the_re_warm_gets_the_workspace_manager_it_locks(monkeypatch):
    from vllm.v1.worker import workspace

    monkeypatch.setattr(workspace, "_manager", None, raising=False)
    if workspace.is_workspace_manager_initialized():
        pytest.skip("vLLM's workspace manager is held elsewhere in this process")
    seen = []
    warm = elastic_scaling.warm_and_capture(lambda self: seen.append(workspace.is_workspace_manager_initialized()))
    try:
        warm(executor())
        assert seen == [True]
    finally:
        workspace.reset_workspace_manager()


def test_the_switch_is_followed_by_the_workers_eplb_graph():
    order = []
    bound = SimpleNamespace(before_switch=lambda: order.append("before"), after_switch=lambda: order.append("after"))
    switch = elastic_scaling.switch_and_prepare(lambda self: order.append("upstream") or ("retired",))
    assert switch(executor(runner=SimpleNamespace(eplb_graph=bound))) == ("retired",)
    assert order == ["before", "upstream", "after"]
    assert switch(executor(runner=SimpleNamespace())) == ("retired",)  # EPLB off on that runner: upstream only


def test_the_compiled_state_is_kept_where_the_worker_says_its_graphs_hold_no_group_size():
    resets = []
    release = elastic_scaling.release_cuda_graphs(lambda self: resets.append(self))
    kept = executor(runner=SimpleNamespace(eplb_graph=SimpleNamespace(keeps_graphs=True)))
    assert release(kept) is None and resets == []  # nothing reset: Dynamo's and vLLM's compiled state stay
    for not_kept in (executor(runner=SimpleNamespace(eplb_graph=SimpleNamespace(keeps_graphs=False))),
                     executor(runner=SimpleNamespace())):  # asked to reset (KEEP_GRAPHS=0), or EPLB off
        release(not_kept)
        assert resets[-1] is not_kept
    assert len(resets) == 2


def test_the_adaptations_install_on_upstreams_executor_once():
    from vllm.distributed.elastic_ep import elastic_execute

    upstream_transfer = patches.current("elastic_scaling.batch_transfer_weights")
    ours = [key for key in KEYS if not patches.installed(key)]  # the plugin may have installed them already
    installer = object()
    ElasticCpuScaling.install(installer)
    ElasticCpuScaling.install(installer)  # again: nothing more
    try:
        assert all(patches.installed(key) for key in KEYS)
        assert elastic_execute.ElasticEPScalingExecutor.load_model.__code__.co_filename == elastic_scaling.__file__
        assert elastic_execute.batch_transfer_weights.__code__.co_filename == elastic_scaling.__file__
    finally:
        for key in reversed(ours):
            patches.uninstall(key)
    assert all(not patches.installed(key) for key in ours)
    if ours:
        assert elastic_execute.batch_transfer_weights is upstream_transfer
