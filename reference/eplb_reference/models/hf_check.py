"""One transformers MoE family through graph-mode EPLB, the way a user would run it.

``check_family`` builds the family tiny (``hf_families``), then per backend: ``enable`` ->
``torch.compile(fullgraph=True)`` -> output against the logical model in eager -> the
load that forward recorded (skewed input) -> ``rearrange()`` -> the same compiled graph
again, with recompiles an error. Every outcome is a row: works, refused at ``enable``
(the reason is the ValueError), cannot be built tiny, or failed (a bug to fix, with the
error); ``benchmarks/support_matrix.py`` runs it for every family and writes the matrix.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

import eplb_graph
from eplb_graph.pytorch.adapters import find_moe_layers
from eplb_graph.pytorch.hf_adapter import is_hf_experts
from eplb_reference.models.hf_families import CannotBuildTiny, TinyFamily, build_tiny_family
from eplb_reference.runtime.compile import unique_graphs


TOLERANCE = 1e-4  # |compiled EPLB - logical eager| per element, relative to the output's largest magnitude
NUM_REDUNDANT = 4
EP_SIZE = 2
SHARED_EXPERT_NAMES = ("shared_expert", "shared_experts", "shared_mlp")


@dataclass
class BackendResult:
    backend: str
    routers_mapped: int = 0
    unmapped_router_topk: int = 0  # top-k inside a router that do not select experts (group level)
    verified: bool = False
    max_abs_diff: float | None = None  # first forward, initial placement
    max_abs_diff_after: float | None = None  # after rearrange(), same graph
    load_recorded: int = 0
    placement_changed: bool = False
    recompiled: bool = False
    error: str | None = None

    @property
    def works(self) -> bool:
        return self.error is None and self.verified and not self.recompiled and self.placement_changed


@dataclass
class FamilyRow:
    family: str
    status: str  # works | refused | cannot-build | failed
    model_class: str = ""
    implementation: str = ""
    router: str = ""  # router kind, e.g. "sigmoid + bias correction, grouped top-k"
    moe_layers: int = 0
    reason: str = ""  # the refusal, the build problem or the failure
    backends: list[BackendResult] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def skewed_tokens(vocab_size: int, *, batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    """[batch, seq] ids from a narrow slice of the vocabulary: routing concentrates on few experts."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, max(vocab_size // 8, 4), (batch, seq), generator=generator)


def model_output(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """One forward without a KV cache (the matrix checks routing, not generation; hybrid caches
    of some families need a generation loop to be set up)."""
    output = model(input_ids=tokens, use_cache=False)
    return output.logits if hasattr(output, "logits") and output.logits is not None else output.last_hidden_state


def routed_pairs(model: nn.Module, tokens: torch.Tensor) -> int:
    """(token, expert) pairs the experts of an eager model receive in one forward: what the
    enabled model must record (a block with text and vision experts splits the tokens)."""
    received = []

    def count(_module, args, kwargs):
        received.append(kwargs["top_k_index"].numel() if "top_k_index" in kwargs else args[1].numel())

    hooks = [m.register_forward_pre_hook(count, with_kwargs=True) for m in model.modules() if is_hf_experts(m)]
    try:
        model_output(model, tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return sum(received)


def describe_router(model: nn.Module) -> tuple[str, int]:
    """(router kind of the first MoE layer, number of decoder layers without routed experts)."""
    _, specs = find_moe_layers(model)
    spec = specs[0]
    router = model.get_submodule(spec.router_path)
    block = model.get_submodule(spec.name)
    kinds = [type(router).__name__]
    if spec.router_path == spec.name:
        kinds.append("top-k in the MoE block")
    if any("e_score_correction_bias" in name for name, _ in [*router.named_parameters(), *router.named_buffers()]):
        kinds.append("bias-corrected scores")
    groups = getattr(router, "num_group", getattr(router, "n_group", None))
    if isinstance(groups, int) and groups > 1:
        kinds.append(f"grouped top-k ({groups} groups, {getattr(router, 'topk_group', '?')} kept)")
    if any(hasattr(block, name) for name in SHARED_EXPERT_NAMES):
        kinds.append("shared experts")
    decoder_layers = next((m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)), [])
    dense = sum(1 for layer in decoder_layers if not any(is_hf_experts(m) for m in layer.modules()))
    if dense:
        kinds.append(f"{dense} dense layer(s)")
    return ", ".join(kinds), len(specs)


def check_backend(tiny: TinyFamily, backend: str) -> BackendResult:
    result = BackendResult(backend)
    logical = tiny.model
    model = copy.deepcopy(logical)
    handle = eplb_graph.enable(model, num_redundant_experts=NUM_REDUNDANT, ep_size=EP_SIZE)
    tokens = skewed_tokens(model.config.vocab_size)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            expected = model_output(logical, tokens)
            expected_load = routed_pairs(logical, tokens)
            compiled = torch.compile(model, backend=handle.backend(backend), fullgraph=True)
            scale = float(expected.abs().max()) or 1.0
            result.max_abs_diff = float((model_output(compiled, tokens) - expected).abs().max())
            record = handle.compiled_graphs[-1]
            result.routers_mapped, result.verified = record.result.routers_mapped, bool(record.report and record.report.ok)
            result.unmapped_router_topk = sum(1 for s in record.result.sites if s.router is not None and not s.selects_experts)
            result.load_recorded = int(handle.logical_load().sum())
            before = handle.physical_to_logical()
            result.placement_changed = not torch.equal(handle.rearrange(), before)
            graphs = unique_graphs()
            with torch._dynamo.config.patch(error_on_recompile=True):
                result.max_abs_diff_after = float((model_output(compiled, tokens) - expected).abs().max())
            result.recompiled = unique_graphs() != graphs
        if result.load_recorded != expected_load:
            result.error = f"recorded {result.load_recorded} (token, expert) pairs, expected {expected_load}"
        elif max(result.max_abs_diff, result.max_abs_diff_after) > TOLERANCE * scale:
            result.error = f"outputs differ from the logical model by {max(result.max_abs_diff, result.max_abs_diff_after):.3g}"
        elif not result.works:
            result.error = "not verified, recompiled or placement unchanged"
    except Exception as error:  # a row, not a crash: the matrix names what failed where
        result.error = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
    finally:
        handle.close()
        torch._dynamo.reset()
    return result


def compiles_without_eplb(tiny: TinyFamily, backend: str) -> str | None:
    """None if the logical model compiles with fullgraph=True on this backend, else the error."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            model_output(torch.compile(tiny.model, backend=backend, fullgraph=True), skewed_tokens(tiny.model.config.vocab_size))
        return None
    except Exception as error:
        return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    finally:
        torch._dynamo.reset()


def check_family(family: str, backends: tuple[str, ...] = ("aot_eager", "inductor")) -> FamilyRow:
    try:
        tiny = build_tiny_family(family)
    except CannotBuildTiny as error:
        return FamilyRow(family, "cannot-build", reason=str(error))
    row = FamilyRow(family, "works", model_class=type(tiny.model).__name__,
                    implementation=str(tiny.model.config._experts_implementation))
    try:
        row.router, row.moe_layers = describe_router(tiny.model)
        eplb_graph.enable(copy.deepcopy(tiny.model), num_redundant_experts=NUM_REDUNDANT, ep_size=EP_SIZE).close()
    except ValueError as refusal:
        row.status, row.reason = "refused", str(refusal)
        return row
    row.backends = [check_backend(tiny, backend) for backend in backends]
    listed = max((result.unmapped_router_topk for result in row.backends), default=0)
    if listed and row.moe_layers:
        row.router += f"; {listed // row.moe_layers} group-level top-k per router listed, not mapped"
    failed = [result for result in row.backends if result.error is not None]
    if failed:
        row.status = "failed"
        without = compiles_without_eplb(tiny, failed[0].backend)
        prefix = f"does not compile with fullgraph=True even without EPLB ({without}); " if without else ""
        row.reason = prefix + "; ".join(f"{r.backend}: {r.error}" for r in failed)
    return row
