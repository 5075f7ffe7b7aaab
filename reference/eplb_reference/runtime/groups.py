"""A process as one EP rank: vLLM's parallel groups on gloo (or NCCL), with EPLB switched on.

Upstream's ``ParallelConfig`` refuses ``enable_eplb`` on the CPU platform and ``VllmConfig``
re-validates it, so EPLB is switched on after construction, before the groups exist; the
communicator is named since auto-selection lives in the validator. vLLM adds a gloo CPU
group beside the activation group either way, which EPLB's mover uses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from datetime import timedelta

import torch

from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.step import rank_threads
from eplb_graph.upstream import patches

# Building a VllmConfig runs the platform's checks for vLLM's own model runner, whose warnings
# (no Triton for the V2 runner, the mamba state dtype) do not apply to bare EP groups; every
# rank printed three of them on each run.
MODEL_RUNNER_CHECK_LOGGERS = ("vllm.platforms.cpu", "vllm.config.vllm")


@contextlib.contextmanager
def _quiet_model_runner_checks() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in MODEL_RUNNER_CHECK_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def inductor_compile_threads_kept() -> Iterator[None]:
    """Around a first import of vLLM in a process of ours (a rank, a benchmark's parent): vLLM's
    import sets ``TORCHINDUCTOR_COMPILE_THREADS=1`` for its own engine processes, which would
    make every Inductor compile of this process and of every process it starts serial."""
    name = "TORCHINDUCTOR_COMPILE_THREADS"
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        config = sys.modules.get("torch._inductor.config")
        if config is not None:  # decided at its import: decide again under the restored environment
            patches.configure("runtime.compile_threads", config.decide_compile_threads(), on=config)


def eplb_vllm_config(world_size: int, *, num_redundant_experts: int, window_size: int, step_interval: int):
    """A ``VllmConfig`` for EP = ``world_size`` with asynchronous EPLB on (see the module docstring)."""
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.config.parallel import EPLBConfig

    with _quiet_model_runner_checks():
        config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=world_size, enable_expert_parallel=True))
    patches.configure("config.cpu_enable_eplb", True, on=config.parallel_config)  # ParallelConfig refuses it on CPU
    eplb = EPLBConfig(window_size=window_size, step_interval=step_interval, use_async=True, communicator="torch_gloo",
                      num_redundant_experts=num_redundant_experts)
    patches.configure("config.cpu_eplb_config", eplb, on=config.parallel_config)
    return config


def init_expert_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    local_rank: int | None = None,
    num_redundant_experts: int,
    window_size: int = 8,
    step_interval: int = 16,
    timeout_s: float = 60.0,
    backend: str = "gloo",
):
    """vLLM parallel state for EP = world_size (tensor parallel x expert parallel).

    ``backend`` carries the activations: gloo on CPU, nccl on CUDA (one rank per GPU);
    vLLM adds a gloo CPU group beside it either way, which EPLB's mover uses.

    ``ParallelConfig`` refuses ``enable_eplb`` on the CPU platform and ``VllmConfig``
    re-validates it, so EPLB is switched on after construction, before the groups exist;
    the communicator is named since auto-selection lives in the validator. Returns the
    VllmConfig, which must stay current (``set_current_vllm_config``) while EPLB runs.
    """
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    config = eplb_vllm_config(world_size, num_redundant_experts=num_redundant_experts, window_size=window_size,
                              step_interval=step_interval)
    with set_current_vllm_config(config):
        parallel_state.init_distributed_environment(
            world_size, rank, init_method, rank if local_rank is None else local_rank, backend=backend,
            timeout=timedelta(seconds=timeout_s),
        )
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size, backend=backend)
    return config


def shutdown_expert_parallel() -> None:
    """Tears down vLLM's groups (and their shared-memory broadcasters) at the end of a rank."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


# The activation group's collective library per device (the EPLB worker always uses gloo).
DEVICE_GROUP_BACKENDS = {"cuda": "nccl", "npu": "hccl"}


@contextlib.contextmanager
def rank_session(rank: int, world_size: int, init_method: str, cfg: RunConfig) -> Iterator[tuple]:
    """This process as one EP rank: vLLM's groups with the run's EPLB window and interval, the
    vLLM config current and autograd off. Yields (activation group or None, CPU group)."""

    with inductor_compile_threads_kept():
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import get_ep_group

    # torchrun sets LOCAL_RANK / LOCAL_WORLD_SIZE; our own launcher runs every rank on this machine
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(rank_threads(cfg, local_world))
    if cfg.device == "cuda":
        torch.cuda.set_device(local_rank)
    if cfg.device == "npu":
        from eplb_graph.graph.npu_backend import require_npu

        require_npu()  # this process's npu device: torch_npu, or the module EPLB_GRAPH_NPU_MODULE names
        torch.npu.set_device(local_rank)
    config = init_expert_parallel(
        rank, world_size, init_method, local_rank=local_rank, num_redundant_experts=cfg.num_physical - cfg.num_experts,
        window_size=cfg.window_size, step_interval=cfg.step_interval, timeout_s=60,
        backend=DEVICE_GROUP_BACKENDS.get(cfg.device, "gloo"),
    )
    with set_current_vllm_config(config), torch.no_grad():
        ep_group = get_ep_group()
        yield (ep_group.device_group if world_size > 1 else None), ep_group.cpu_group
