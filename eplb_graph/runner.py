"""The main job: a reference MoE decoder over real EP ranks with live EPLB, step by step.

One process per EP rank (``eplb_graph.launch``; the per-rank body ``run_rank`` also runs
under torchrun). Each rank builds the same seeded model, keeps its slice of the physical
experts, and runs server-shaped batches (``eplb_graph.workload``) in one of three modes:

    eager     the EP model as written (the block calls map_and_record_layer itself)
    compiled  torch.compile(fullgraph=True) with the EPLB pass inserting the routing op
    graph     CUDA graph capture/replay per capture size on CUDA; on CPU, compiled mode
              *is* the graph mode (there is no capture on the host)

EPLB steps and layer commits happen only between forwards/replays (``begin_batch`` /
``end_batch``). Every step checks the output against the no-EPLB model (logical experts,
one process, the same expert kernels) and records balancedness from the global load.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from eplb_graph.launch import Heartbeat
from eplb_graph.layer_lookup import check_expert_layout
from eplb_graph.models.reference import ReferenceMoEConfig
from eplb_graph.run_report import balancedness
from eplb_graph.workload import Batch, WorkloadSpec, make_batch

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
    num_redundant: int = 4  # 25 % redundant experts
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
    policy_process: bool = False  # upstream's policy in a helper process per rank (off the GIL)
    threads: int | None = None  # torch intra-op threads per rank; None: see rank_threads

    @property
    def output_tolerance(self) -> float:
        """The output check's rtol = atol. Eager on the host runs the reference's own kernels in
        the same order (the EP combine is exact), so it is exact (0), in every format; compiled,
        Inductor's fused kernels round differently from the eager reference, by the format's
        own measured tolerance. (CUDA eager is not held to exactness: cuBLAS may pick another
        algorithm for the EP model's larger batch of (token, expert) pairs.)"""
        from eplb_graph.weight_views import expert_format

        if self.tolerance is not None:
            return self.tolerance
        if self.mode == "eager" and self.device == "cpu":
            return 0.0
        return expert_format(self.weight_format).output_tolerance

    @property
    def num_physical(self) -> int:
        return self.num_experts + (self.num_redundant if self.eplb else 0)

    def model_config(self) -> ReferenceMoEConfig:
        """The reference decoder's config, checked on construction."""
        return ReferenceMoEConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden, num_layers=self.num_layers,
            num_experts=self.num_experts, top_k=self.top_k, expert_intermediate_size=self.expert_intermediate,
            shared_expert_intermediate_size=self.shared_expert_intermediate,
        )

    def workload(self) -> WorkloadSpec:
        return WorkloadSpec(
            vocab_size=self.vocab_size, capture_sizes=tuple(self.capture_sizes), decode_tokens=self.decode_tokens,
            prefill_tokens=self.prefill_tokens, drift_every=self.drift_every, seed=self.seed,
            hot_fraction=self.hot_fraction, hot_probability=self.hot_probability,
        )

    def validate(self) -> None:
        """Every check that can fail, before any process starts."""
        from eplb_graph.weight_views import check_expert_kernel, expert_format

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
            raise ValueError("device 'npu': the NPU runtime needs torch_npu and an ACL graph runner, not available here")
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


@dataclass
class RankResult:
    rank: int
    step_ms: list[float] = field(default_factory=list)
    eplb_host_ms: list[float] = field(default_factory=list)  # of step_ms: begin_batch + end_batch (commits)
    kinds: list[str] = field(default_factory=list)
    rebalancing: list[bool] = field(default_factory=list)
    rank_load: list[list[list[int]]] = field(default_factory=list)  # per step: [layers][ranks], all ranks' tokens
    logical_load: list[list[list[int]]] = field(default_factory=list)  # per step: [layers][logical experts]
    rearrangement_finished_steps: list[int] = field(default_factory=list)
    layers_committed: int = 0
    rearrangements_started: int = 0
    rearrangements_finished: int = 0
    output_mismatches: int = 0
    first_mismatch_step: int | None = None
    first_mismatch_during_rearrangement: bool | None = None  # a rearrangement in flight at that step
    nonfinite_output_steps: int = 0  # steps with NaN/Inf outputs where the reference is finite
    max_abs_diff: float = 0.0  # over the entries finite in both
    recompiles: int = 0
    recaptures: int | None = None  # None: this mode captures no graphs (every mode on CPU)
    compile_or_capture_s: float = 0.0
    intra_op_threads: int = 0  # torch's, in this rank's process
    verifier_ok: bool = True
    routers_mapped: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class OutputCheck:
    ok: bool
    max_abs_diff: float  # over the entries finite in both outputs
    nonfinite: bool  # the EPLB output has NaN/Inf where the reference is finite


def check_output(out: torch.Tensor, expected: torch.Tensor, tolerance: float) -> OutputCheck:
    """One step's output against the no-EPLB reference. At tolerance 0 this is exact equality
    (0.0 and -0.0 compare equal); NaN where the reference has NaN too counts as equal (the
    model's, not EPLB's), and a NaN or Inf only in ``out`` is a mismatch that ``max_abs_diff``
    alone would hide (NaN compares false), so it is flagged on its own."""
    finite_out, finite_expected = torch.isfinite(out), torch.isfinite(expected)
    both = finite_out & finite_expected
    diff = (out - expected).abs()[both]
    return OutputCheck(
        ok=torch.allclose(out, expected, rtol=tolerance, atol=tolerance, equal_nan=True),
        max_abs_diff=float(diff.max()) if diff.numel() else 0.0,
        nonfinite=bool((finite_expected & ~finite_out).any()),
    )


def rank_device(cfg: RunConfig) -> torch.device:
    """This rank's device with its index: threads started later (upstream's async worker)
    default to device 0 unless told which device their rank owns."""
    if cfg.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())  # set by rank_session
    return torch.device(cfg.device)


def build_rank_models(cfg: RunConfig, rank: int, ep_size: int, group):
    """(EPLB model on this rank, no-EPLB reference, RankLayers, flags). Same seed on every rank."""
    from eplb_graph.ep_runtime import build_ep_layer
    from eplb_graph.expert_parallel import ExpertParallelMoE, LinearTopKRouter
    from eplb_graph.layer_lookup import BatchFlags
    from eplb_graph.models.reference import build_reference_model
    from eplb_graph.weight_views import expert_format

    fmt = expert_format(cfg.weight_format)
    device = rank_device(cfg)
    logical = build_reference_model(cfg.model_config(), seed=cfg.seed, device=device)
    reference, model = copy.deepcopy(logical), copy.deepcopy(logical)
    flags = BatchFlags(device)
    rank_layers = []
    for index, block in enumerate(logical.layers):
        moe = block.mlp
        router = moe.gate.weight.detach().clone()
        logical_experts = fmt.from_float(moe.experts.w13.detach(), moe.experts.w2.detach())
        reference.layers[index].mlp = ExpertParallelMoE(
            LinearTopKRouter(router.clone(), cfg.top_k), logical_experts, None, shared_expert=copy.deepcopy(moe.shared_expert),
            expert_kernel=cfg.expert_kernel,
        )
        key = f"run{rank}.{index}" if cfg.eplb else None
        model.layers[index].mlp, rank_layer = build_ep_layer(
            key, router, logical_experts, cfg.top_k, cfg.num_physical, rank, ep_size, group, flags,
            shared_expert=copy.deepcopy(moe.shared_expert), device=device, expert_kernel=cfg.expert_kernel,
        )
        if rank_layer is not None:
            rank_layers.append(rank_layer)
    # The expert weights are on the device already, so .to() keeps the very tensors the
    # RankLayers' weight views (what upstream's mover writes) name.
    return model.to(device).eval(), reference.to(device).eval(), rank_layers, flags


def _global_loads(rank_layers, ep_size: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's load over all ranks' batches: per rank [L, ranks] and per logical expert [L, E]."""
    import torch.distributed as dist

    load = torch.stack([layer.tables.load.to("cpu", torch.int64) for layer in rank_layers])  # [L, P]
    if ep_size > 1:
        dist.all_reduce(load, group=group)
    num_logical = rank_layers[0].tables.num_logical_experts
    logical = torch.stack([
        torch.zeros(num_logical, dtype=torch.int64).index_add_(0, layer.tables.physical_to_logical, row)
        for layer, row in zip(rank_layers, load)
    ])
    return load.view(load.shape[0], ep_size, -1).sum(-1), logical


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


def inductor_with_cpp_wrapper(graph_module, example_inputs):
    """Inductor with its wrapper generated in C++ rather than Python: the compiled forward calls
    its kernels, and the routing op through the dispatcher, with no Python between them. On the
    host that Python is a measured share of a small decode step, and the routing op's call
    through it is most of the EPLB-on cost (README, the data-plane bench)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(graph_module, example_inputs, config_patches={"cpp_wrapper": True})


def prepare_forward(model, cfg: RunConfig, rank_layers, records: list):
    """The callable for the mode: the model itself (eager) or torch.compile with the EPLB pass."""
    from eplb_graph.enable import make_eplb_backend
    from eplb_graph.passes.router_sites import RouterBinding

    if cfg.mode == "eager":
        return model
    bindings = []
    for index, block in enumerate(model.layers):
        if block.mlp.layer_key is not None:
            block.mlp.route_in_module = False  # the pass inserts the routing op instead
            bindings.append(RouterBinding(block.mlp.layer_key, f"layers.{index}.mlp.gate", cfg.num_experts, cfg.top_k))
    live = {layer.key: layer for layer in rank_layers}
    inner = inductor_with_cpp_wrapper if cfg.cpp_wrapper else cfg.backend
    backend = make_eplb_backend(bindings, inner, records, live.__getitem__)
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False)


def graph_tensor_reader(model, rank_layers) -> Callable[[], list[torch.Tensor]]:
    """Reads, now, every tensor a captured graph of ``model`` holds by address: weights
    (expert weight views included), buffers, and each layer's routing tables, load buffer
    and batch flags. Called before every replay, so it reads the modules' parameter and
    buffer slots directly (a module walk costs ~60 us per call on the default model); a
    tensor assigned into a slot later is what it returns."""
    slots = [(module._parameters, name) for module in model.modules() for name in module._parameters]
    slots += [(module._buffers, name) for module in model.modules() for name in module._buffers]

    def read() -> list[torch.Tensor]:
        tensors = [table[name] for table, name in slots]
        for layer in rank_layers:
            tensors.extend(layer.routing_tensors())
        return [t for t in tensors if t is not None]

    return read


def prepare_step(model, cfg: RunConfig, rank_layers, flags, records: list):
    """(the step's callable, its CapturedForward or None). Graph mode on a device captures the
    compiled forward once per capture size; on CPU graph mode is compiled mode."""
    forward = prepare_forward(model, cfg, rank_layers, records)
    if cfg.mode != "graph" or cfg.device == "cpu":
        return forward, None
    from eplb_graph.graph_capture import CapturedForward

    captured = CapturedForward(
        forward, tuple(cfg.capture_sizes), device=cfg.device, flags=flags,
        graph_tensors=graph_tensor_reader(model, rank_layers),
        check_addresses_on_replay=False,  # timed_step's untimed ``after`` checks them between steps
    )
    captured.capture_all()
    return captured, captured


def synchronize(device: torch.device) -> None:
    """Before reading a step's time: device work is asynchronous."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TimedStep:
    out: torch.Tensor
    seconds: float  # begin_batch + forward (synchronized) + end_batch
    eplb_host_s: float  # of which begin_batch + end_batch: upstream's step, rearrange, layer commits


def timed_step(forward, batch: Batch, device: torch.device, controller=None, between=None,
               after=None) -> TimedStep:
    """One step as a server runs it: EPLB's host work before and after the forward counts;
    ``between`` (bookkeeping that must read the pass's load before ``end_batch`` folds it into
    upstream's window) and ``after`` (a captured forward's address check, once the step's
    commits are done) run untimed."""
    start = time.perf_counter()
    if controller is not None:
        controller.begin_batch(num_unpadded_tokens=batch.num_tokens, is_prefill=batch.is_prefill)
    forward_start = time.perf_counter()
    out = forward(batch.tokens)
    synchronize(device)
    forward_end = time.perf_counter()
    if between is not None:
        between()
    end_start = time.perf_counter()
    if controller is not None:
        controller.end_batch()
        synchronize(device)
    end = time.perf_counter()
    if after is not None:
        after()
    return TimedStep(out, forward_end - start + end - end_start, forward_start - start + end - end_start)


def rank_threads(cfg: RunConfig, local_world: int) -> int:
    """torch intra-op threads for one rank's process: ``cfg.threads`` if given. Otherwise, on
    the host, where the forward computes, this machine's cores (torch's default count, which
    OMP_NUM_THREADS sets) shared among its ranks; on a device, one, as vLLM's GPU worker serves
    (``set_torch_threads_for_runtime``): the device computes, and idle OpenMP workers spin after
    each host op, taking cycles from the step's Python and from EPLB's worker thread."""
    if cfg.threads is not None:
        return cfg.threads
    if cfg.device != "cpu":
        return 1
    return max(1, torch.get_num_threads() // local_world)


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count for a block, restored after it: for a process that is the
    one rank only for a while (the data-plane bench runs in the CLI's process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def rank_session(rank: int, world_size: int, init_method: str, cfg: RunConfig) -> Iterator[tuple]:
    """This process as one EP rank: vLLM's groups with the run's EPLB window and interval, the
    vLLM config current and autograd off. Yields (activation group or None, CPU group)."""
    from eplb_graph.expert_parallel import inductor_compile_threads_kept, init_expert_parallel

    with inductor_compile_threads_kept():
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import get_ep_group

    # torchrun sets LOCAL_RANK / LOCAL_WORLD_SIZE; our own launcher runs every rank on this machine
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(rank_threads(cfg, local_world))
    if cfg.device == "cuda":
        torch.cuda.set_device(local_rank)
    config = init_expert_parallel(
        rank, world_size, init_method, local_rank=local_rank, num_redundant_experts=cfg.num_physical - cfg.num_experts,
        window_size=cfg.window_size, step_interval=cfg.step_interval, timeout_s=60,
        backend="nccl" if cfg.device == "cuda" else "gloo",
    )
    with set_current_vllm_config(config), torch.no_grad():
        ep_group = get_ep_group()
        yield (ep_group.device_group if world_size > 1 else None), ep_group.cpu_group


def run_rank(rank: int, world_size: int, init_method: str, cfg: RunConfig, heartbeat: Heartbeat | None = None) -> dict:
    """One rank's whole run. ``heartbeat`` (from ``run_ranks``) beats after every step, so the
    launcher's timeout bounds a stuck step, not the run's length."""
    from eplb_graph.controller import EplbController

    result = RankResult(rank)
    with rank_session(rank, world_size, init_method, cfg) as (group, cpu_group):
        result.intra_op_threads = torch.get_num_threads()
        model, reference, rank_layers, flags = build_rank_models(cfg, rank, world_size, group)
        device = rank_device(cfg)
        controller = None
        if cfg.eplb:
            # binds the load buffers: before capture
            controller = EplbController(rank_layers, device=device, policy_process=cfg.policy_process)
        records = []
        forward, captured = prepare_step(model, cfg, rank_layers, flags, records)
        if captured is not None:
            result.compile_or_capture_s += captured.stats.capture_s

        workload = cfg.workload()
        tolerance = cfg.output_tolerance
        progress = None
        if cfg.progress and rank == 0:
            from tqdm import tqdm

            progress = tqdm(total=cfg.steps, desc=f"{cfg.mode} x{world_size} ranks", unit="step")
        sizes_used = workload.capture_sizes_used()
        seen_sizes: set[int] = set()
        graphs_after_warmup = None
        last_finished = 0

        def record_loads() -> None:  # this step's global load, for balancedness
            per_rank, logical_load = _global_loads(rank_layers, world_size, cpu_group)
            result.rank_load.append(per_rank.tolist())
            result.logical_load.append(logical_load.tolist())

        for step in range(cfg.steps):
            batch = make_batch(workload, step, rank).to(device)
            tokens = batch.tokens
            size = tokens.shape[1]
            busy = controller is not None and controller.rebalancing
            timed = timed_step(forward, batch, device, controller,
                               record_loads if cfg.eplb and cfg.collect_load_stats else None,
                               captured.check_addresses if captured is not None else None)
            out, elapsed = timed.out, timed.seconds
            if controller is not None:
                busy = busy or controller.rebalancing  # the step that starts a rearrangement pays for it
                if controller.stats.rearrangements_finished > last_finished:
                    last_finished = controller.stats.rearrangements_finished
                    result.rearrangement_finished_steps.append(step)
            if size not in seen_sizes:  # first forward of a capture size: compile, not a step
                seen_sizes.add(size)
                result.compile_or_capture_s += elapsed
                if seen_sizes == sizes_used:
                    graphs_after_warmup = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            else:  # timed steps only, aligned lists
                result.step_ms.append(elapsed * 1e3)
                result.eplb_host_ms.append(timed.eplb_host_s * 1e3)
                result.kinds.append(batch.kind)
                result.rebalancing.append(busy)
            result.tokens += batch.num_tokens
            if heartbeat is not None:
                heartbeat.beat()
            if progress is not None:
                progress.update(1)
                if result.rank_load and (step + 1) % cfg.step_interval == 0:
                    balance = balancedness(torch.tensor(result.rank_load[-cfg.step_interval :]).sum(0))  # [L, ranks]
                    stats = controller.stats
                    progress.write(
                        f"steps {step + 2 - cfg.step_interval:>4}-{step + 1:<4} balancedness {balance:.3f}  "
                        f"rearrangements started {stats.rearrangements_started} finished "
                        f"{stats.rearrangements_finished}  layers committed {stats.layers_committed}"
                    )
            if cfg.check_outputs:
                real = slice(0, batch.num_tokens)
                check = check_output(out[:, real], reference(tokens)[:, real], tolerance)
                result.max_abs_diff = max(result.max_abs_diff, check.max_abs_diff)
                result.nonfinite_output_steps += check.nonfinite
                if not check.ok:
                    result.output_mismatches += 1
                    if result.first_mismatch_step is None:  # where to look: the step, and whether a move was in flight
                        result.first_mismatch_step, result.first_mismatch_during_rearrangement = step, busy

        if graphs_after_warmup is not None:
            result.recompiles = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_after_warmup
        if captured is not None:
            result.recaptures = captured.stats.recaptures
        if progress is not None:
            progress.close()
        result.verifier_ok = all(r.report is None or r.report.ok for r in records)
        result.routers_mapped = min((r.result.routers_mapped for r in records), default=0)
        if controller is not None:
            result.layers_committed = controller.stats.layers_committed
            result.rearrangements_started = controller.stats.rearrangements_started
            result.rearrangements_finished = controller.stats.rearrangements_finished
            controller.close()
    return asdict(result)


def run_rank_and_shut_down(rank: int, world_size: int, init_method: str, cfg: RunConfig,
                           heartbeat: Heartbeat | None = None) -> dict:
    """``run_rank`` for a process that ends with it: the groups are torn down afterwards."""
    from eplb_graph.expert_parallel import shutdown_expert_parallel

    try:
        return run_rank(rank, world_size, init_method, cfg, heartbeat)
    finally:
        shutdown_expert_parallel()
