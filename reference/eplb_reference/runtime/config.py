"""What one run of the reference EP runtime is: ``RunConfig``, checked before any process starts.

``eplb-graph run`` and ``bench`` build one from their flags, ``RunConfig.validate`` refuses
every bad value by name (exit code 2, nothing started), and every rank of the run receives
the same frozen object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from eplb_reference.models.reference import ReferenceMoEConfig
from eplb_graph.core.placement import check_expert_layout
from eplb_graph.core.placement_file import PlacementIdentity, check_start_file, config_hash
from eplb_reference.runtime.workload import WorkloadSpec
from eplb_graph.upstream.watchdog import StallBound

MODES = ("eager", "compiled", "graph")
DEVICES = ("cpu", "cuda", "npu")


@dataclass(frozen=True)
class RunConfig:
    mode: str = "compiled"
    device: str = "cpu"
    ranks: int = 2
    steps: int = 300
    num_layers: int = 2
    num_experts: int = 16
    num_redundant_experts: int = 4  # 25 % redundant experts
    top_k: int = 4
    hidden: int = 64
    expert_intermediate: int = 64
    shared_expert_intermediate: int = 64
    vocab_size: int = 256
    weight_format: str = "unquantized"
    expert_kernel: str = "pairs"  # weight_views: per (token, k) pair, or "dense" (every local expert, every token)
    eplb: bool = True
    window_size: int = 20
    step_interval: int = 20
    capture_sizes: tuple[int, ...] = (16, 64)
    decode_tokens: int = 16
    prefill_tokens: int = 48
    drift_every: int = 100
    hot_fraction: float = 0.02
    hot_probability: float = 0.95
    seed: int = 0
    check_outputs: bool = True
    tolerance: float | None = None  # rtol = atol of the output check (0: exact); None: see output_tolerance
    backend: str = "inductor"
    cpp_wrapper: bool = False  # compiled / graph mode on CPU: Inductor's wrapper in C++ (see inductor_with_cpp_wrapper)
    progress: bool = False  # rank 0 shows a progress bar and one line per window
    collect_load_stats: bool = True  # all-reduce the load each step for balancedness (off in bench)
    step_breakdown: bool = False  # per-step probes of where the time goes (runtime/step_probes.py; bench)
    policy_process: bool = False  # upstream's policy in a helper process per rank (off the GIL)
    threads: int | None = None  # torch intra-op threads per rank; None: see rank_threads
    stall_steps: int = 1000  # a rearrangement with no layer committed for longer is a stall (watchdog)
    stall_seconds: float = 300.0
    placement_file: str | None = None  # started from where it exists, rewritten as rearrangements commit

    def stall_bound(self) -> StallBound:
        return StallBound(max_steps=self.stall_steps, max_seconds=self.stall_seconds)

    @property
    def output_tolerance(self) -> float:
        """The output check's rtol = atol. Eager on the host runs the reference's own kernels in
        the same order (the EP combine is exact), so it is exact (0), in every format; compiled,
        Inductor's fused kernels round differently from the eager reference, by the format's
        own measured tolerance. (CUDA eager is not held to exactness: cuBLAS may pick another
        algorithm for the EP model's larger batch of (token, expert) pairs.)"""
        from eplb_graph.movement.weight_views import expert_format

        if self.tolerance is not None:
            return self.tolerance
        if self.mode == "eager" and self.device == "cpu":
            return 0.0
        return expert_format(self.weight_format).output_tolerance

    @property
    def num_physical(self) -> int:
        return self.num_experts + (self.num_redundant_experts if self.eplb else 0)

    def model_config(self) -> ReferenceMoEConfig:
        """The reference decoder's config, checked on construction."""
        return ReferenceMoEConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden, num_layers=self.num_layers,
            num_experts=self.num_experts, top_k=self.top_k, expert_intermediate_size=self.expert_intermediate,
            shared_expert_intermediate_size=self.shared_expert_intermediate,
        )

    def placement_identity(self) -> PlacementIdentity:
        """What a placement file of this run fits (``placement_file.py``): the seeded model, the layout."""
        shape = {name: getattr(self, name) for name in ("hidden", "expert_intermediate", "shared_expert_intermediate",
                                                         "vocab_size", "top_k", "seed")}
        return PlacementIdentity("ReferenceMoEModel", config_hash(shape), self.num_layers, self.num_experts,
                                 self.num_physical, self.ranks, self.weight_format)

    def workload(self) -> WorkloadSpec:
        return WorkloadSpec(
            vocab_size=self.vocab_size, capture_sizes=tuple(self.capture_sizes), decode_tokens=self.decode_tokens,
            prefill_tokens=self.prefill_tokens, drift_every=self.drift_every, seed=self.seed,
            hot_fraction=self.hot_fraction, hot_probability=self.hot_probability,
        )

    def validate(self) -> None:
        """Every check that can fail, before any process starts."""
        from eplb_graph.movement.expert_kernels import check_expert_kernel
        from eplb_graph.movement.weight_views import expert_format

        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if self.device not in DEVICES:
            raise ValueError(f"unknown device {self.device!r}; expected one of {', '.join(DEVICES)}")
        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device 'cuda': torch.cuda.is_available() is False on this machine or torch build")
            on_this_machine = int(os.environ.get("LOCAL_WORLD_SIZE", self.ranks))  # torchrun: this node's ranks
            if on_this_machine > torch.cuda.device_count():
                raise ValueError(
                    f"device 'cuda': {on_this_machine} ranks need {on_this_machine} GPUs (NCCL runs one rank per "
                    f"GPU), {torch.cuda.device_count()} visible"
                )
        if self.device == "npu":
            check_npu(self.ranks, self.backend)
        check_expert_layout(self.num_experts, self.num_physical - self.num_experts, self.top_k, self.ranks)
        for name in ("step_interval", "window_size"):  # upstream's EPLBConfig would refuse them inside each rank
            if getattr(self, name) < 1:
                raise ValueError(f"EPLB {name} must be >= 1 step, got {getattr(self, name)}")
        fmt = expert_format(self.weight_format)
        check_expert_kernel(self.expert_kernel)
        self.workload().validate()
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.tolerance is not None and not self.tolerance >= 0:
            raise ValueError(f"tolerance must be >= 0 (0: exact), got {self.tolerance}")
        for name in ("hidden", "expert_intermediate", "num_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        fmt.check_dims(self.hidden, self.expert_intermediate)
        self.model_config()  # e.g. a width the attention heads do not divide
        if self.cpp_wrapper:
            check_cpp_wrapper(self.device, self.backend, self.ranks)
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 per rank, got {self.threads}")
        self.stall_bound().validate(("--stall-steps", "--stall-seconds", "on_stall"))
        if self.placement_file is not None:
            self.check_placement_file()

    def check_placement_file(self) -> None:
        """A placement file this run cannot write, or one it cannot start from, refused by name."""
        if not self.eplb:
            raise ValueError("a placement file keeps what EPLB placed: it needs EPLB on")
        check_start_file(self.placement_file, self.placement_identity())


def check_npu(ranks: int, backend: str) -> None:
    """Where an NPU run can start: ValueError naming what is missing, before any process starts."""
    from eplb_graph.graph.npu_backend import npu_unavailable

    why = npu_unavailable()
    if why is not None:
        raise ValueError(f"device 'npu': the NPU runtime needs torch_npu and an ACL graph runner: {why}")
    on_this_machine = int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    if on_this_machine > torch.npu.device_count():
        raise ValueError(f"device 'npu': {on_this_machine} ranks need {on_this_machine} NPUs (HCCL runs one rank per "
                         f"NPU), {torch.npu.device_count()} visible")
    if backend == "inductor":
        raise ValueError("device 'npu': Inductor has no NPU code generation; graph mode on NPU captures the Dynamo "
                         "graph run as aten ops (backend aot_eager) into NPU graphs")


def collectives_refuse_cpp_wrapper() -> bool:
    """Whether torch's functional collectives take an ``Any`` group argument, which Inductor's
    C++ wrapper cannot pass (torch 2.13: "arg type Any is not yet supported by custom_op_wrapper"
    when a graph with an all-gather compiles)."""
    schema = torch.ops._c10d_functional.all_gather_into_tensor.default._schema
    return any(isinstance(argument.type, torch._C.AnyType) for argument in schema.arguments)


def check_cpp_wrapper(device: str, backend: str, ranks: int) -> None:
    """Where Inductor's C++ wrapper can serve a run: ValueError naming why not, before any process starts."""
    if device != "cpu":
        raise ValueError(f"cpp_wrapper is a host option (device cpu), not for device {device!r}: there graph mode "
                         "replays captured graphs, with no wrapper code in the step")
    if backend != "inductor":
        raise ValueError(f"cpp_wrapper is an Inductor option; the backend is {backend!r}")
    if ranks > 1 and collectives_refuse_cpp_wrapper():
        raise ValueError(f"cpp_wrapper needs ranks 1 with torch {torch.__version__}: its functional collectives (the "
                         "ranks' token all-gather) take an `Any` group argument that Inductor's C++ wrapper cannot pass")
