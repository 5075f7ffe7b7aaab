"""vLLM's elastic EP scaling steps (``ElasticEPScalingExecutor``) on the CPU engine.

Upstream writes each step of a resize for CUDA. On CPU (vLLM 0.32) four of them fail, and one
would serve wrong tokens silently:

* a new engine loads dummy weights and receives the others' non-expert weights point to point
  from ``model.state_dict()``; the CPU runner refuses dummy weights, the CPU communicator has no
  ``batch_isend_irecv``, and the CPU build packs its linear weights into oneDNN handles that leave
  ``layer.weight`` empty, so the transfer would send nothing for them. A new engine here loads the
  checkpoint itself, and no engine sends or receives those weights (``load_model``,
  ``batch_transfer_weights``): its expert slots are empty in the placement it installs, and EPLB's
  reshuffle after the switch fills them;
* the new groups are warmed with ``torch.distributed.all_reduce`` on a stateless group, which c10d
  never registered: the all-reduce runs on the group's own process group (``warm_target_groups``);
* a new engine's warm-up runs upstream's kernel warm-up, which imports CUDA models and which the
  CPU worker never runs at start; where the graphs are kept, it compiles the model alone instead,
  before it joins (``warmup_new_worker`` -> ``elastic_follow.warm_alone``): upstream would compile
  it at the commit's collective warm-up, every engine paused until it is done;
* the re-warm after a switch unlocks and locks a workspace manager the CPU worker never creates:
  upstream's manager is created, empty, first (``warm_and_capture``);
* after the switch the EP group, its DP dispatch and each layer's experts are new objects: the
  worker's eplb-graph follows them (``switch_and_prepare`` -> ``VllmEplbWorker.after_switch``);
* at the switch upstream resets torch.compile and every compiled model, and the re-warm compiles
  them again while the scheduler waits: where the worker's graphs hold no value of the group's
  size (``elastic_follow``), the compiled state is kept (``release_cuda_graphs``; the CPU engine
  captures no CUDA graph to release).

``ElasticCpuScaling`` installs the seven (``elastic_scaling.*`` in ``adaptations.py``); the plugin
installs it in every vLLM process on CPU that imports upstream's module.
"""

from __future__ import annotations

import functools

import torch

from eplb_graph.upstream import patches

from . import elastic_follow

KEYS = ("elastic_scaling.load_model", "elastic_scaling.batch_transfer_weights",
        "elastic_scaling.warm_target_groups", "elastic_scaling.warmup_new_worker",
        "elastic_scaling.warm_and_capture", "elastic_scaling.switch_and_prepare",
        "elastic_scaling.release_cuda_graphs")


def load_model(upstream):
    @functools.wraps(upstream)
    def load_model(self) -> None:
        self.worker.load_model()  # the checkpoint, not dummy weights (see the module docstring)

    return load_model


def batch_transfer_weights(upstream):
    @functools.wraps(upstream)
    def batch_transfer_weights(model, is_sender, peer_rank, dp_group, expert_weights) -> None:
        """Neither side transfers: the new engine loaded the same checkpoint (``load_model``)."""

    return batch_transfer_weights


def warm_target_groups(upstream):
    @functools.wraps(upstream)
    def _warm_target_groups(self, dp_group, ep_group) -> None:
        tensor = torch.zeros(1, dtype=torch.int32)
        for group in (dp_group, ep_group):  # every member takes part, as upstream's all_reduce
            group.device_group.allreduce([tensor]).wait()

    return _warm_target_groups


def warmup_new_worker(upstream):
    @functools.wraps(upstream)
    def warmup_new_worker(self) -> None:
        # no kernel warm-up: the CPU worker runs none at start either (upstream's imports CUDA models')
        if self._can_reuse_fused_moe_kernel():
            self.warm_and_capture()
            return
        bound = getattr(self.worker.model_runner, "eplb_graph", None)
        if bound is not None and bound.keeps_graphs:  # compiled now, not at the commit while all wait
            elastic_follow.warm_alone(bound, self.warm_and_capture)

    return warmup_new_worker


def warm_and_capture(upstream):
    from vllm.v1.worker import workspace

    @functools.wraps(upstream)
    def warm_and_capture(self) -> None:
        if not workspace.is_workspace_manager_initialized():  # the CPU worker never creates one
            workspace.init_workspace_manager(self.worker.device)  # empty until a kernel reserves
        return upstream(self)

    return warm_and_capture


def switch_and_prepare(upstream):
    @functools.wraps(upstream)
    def switch_and_prepare(self):
        bound = getattr(self.worker.model_runner, "eplb_graph", None)
        if bound is not None:
            bound.before_switch()
        retired = upstream(self)
        if bound is not None:
            bound.after_switch()
        return retired

    return switch_and_prepare


def release_cuda_graphs(upstream):
    @functools.wraps(upstream)
    def _release_cuda_graphs(self) -> None:
        bound = getattr(self.worker.model_runner, "eplb_graph", None)
        if bound is None or not bound.keeps_graphs:
            return upstream(self)
        return None  # the compiled model serves the resized group as it is (elastic_follow)

    return _release_cuda_graphs


class ElasticCpuScaling:
    """Installs the adaptations above once per process (by the plugin's name), on CPU only."""

    MAKERS = dict(zip(KEYS, (load_model, batch_transfer_weights, warm_target_groups, warmup_new_worker,
                             warm_and_capture, switch_and_prepare, release_cuda_graphs)))

    @classmethod
    def install(cls, installer: object) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for key, make in cls.MAKERS.items():
            if not patches.installed(key):
                patches.install(key, make(patches.current(key)), by=installer)
