"""``eplb_graph.enable(model)``: graph-mode EPLB for a MoE model, one process.

    handle = eplb_graph.enable(model, num_redundant_experts=4)
    compiled = torch.compile(model, backend=handle.backend(), fullgraph=True)
    ...                       # every forward records load per physical expert
    handle.rearrange()        # upstream policy -> move weights -> refresh lookups in place
    handle.save_placement("placement.json")  # enable(model, placement="placement.json") starts from it

``enable`` validates everything before it touches the model, then turns each MoE layer's
routed-expert weights from logical [num_logical, ...] into physical [num_physical, ...]
layout (initial placement: every logical expert once, then redundant slots round-robin,
as upstream's initial map) and creates one ``LayerLookup`` per layer. The compiled graph
reaches each layer's tables by name through ``map_and_record_layer``.

Load recording needs no call: the batch flags start at "record every row" (the op counts
rows below ``num_unpadded_tokens``; ``EVERY_ROW`` is above any batch), so a plain forward
records each of its tokens. ``set_batch`` narrows one batch (trailing padding rows, the
load phase) and ``set_batch()`` returns to every row. The flags are device tensors the
graph reads, so the default costs the hot path nothing: no branch, no host sync.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from eplb_graph.pytorch.adapter_base import ENABLED_MARK
from eplb_graph.pytorch.adapters import DEFAULT_ADAPTERS, MoEAdapter, MoELayerSpec, find_moe_layers
from eplb_graph.pytorch.enable_placement import kept_placement, model_identity
from eplb_graph.core.layer_lookup import BatchFlags, LayerLookup, RoutedLayer, batch_in_load_phase, check_load_phase
from eplb_graph.core.placement import check_expert_layout, initial_placement, validate_layer_placements
from eplb_graph.core.placement_file import PlacementRecord
from eplb_graph.core.placement_file import save as save_placement_file
from eplb_graph.pytorch.backend import CompiledGraphRecord, make_eplb_backend
from eplb_graph.passes.inductor_pass import EplbPostGradPass, torchair_backend, vllm_inductor_pass
from eplb_graph.passes.router_sites import RouterSpec

_handle_ids = itertools.count()
# Above any batch's row count: the routing op records rows t < num_unpadded_tokens.
EVERY_ROW = torch.iinfo(torch.int64).max


class NoLoadRecordedError(RuntimeError):
    """``rearrange()`` was asked to balance while no layer has recorded load since the last placement."""


@dataclass(frozen=True)
class EplbOptions:
    num_redundant_experts: int = 0
    ep_size: int = 1  # physical experts are split evenly over this many ranks
    load_phase: str = "all"  # which batches record load: all | prefill | decode
    strict: bool = True  # unattributable router top-k: error (True) or warning
    verify: bool = True  # run the verifier on every graph the backend compiles

    def validate(self) -> None:
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be an int >= 0, got {self.num_redundant_experts!r}")
        if not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise ValueError(f"ep_size must be an int >= 1, got {self.ep_size!r}")
        check_load_phase(self.load_phase)


class EplbLayer(RoutedLayer):
    """One MoE layer of an enabled model: its routing tables and its expert weights."""

    def __init__(self, key: str, spec: MoELayerSpec, tables: LayerLookup, flags: BatchFlags) -> None:
        super().__init__(key, tables, flags)
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    def router(self) -> RouterSpec:
        return RouterSpec(
            self.key, self.spec.router_path, self.spec.num_experts, self.spec.top_k, experts_path=self.spec.experts_path
        )

    def expert_weights(self) -> list[torch.Tensor]:
        return [getattr(self.spec.experts, name) for name in self.spec.expert_param_names]

    def __repr__(self) -> str:
        return f"EplbLayer({self.key!r}, {self.name}, {self.tables})"


def to_physical_layout(weight: torch.Tensor, placement: torch.Tensor) -> nn.Parameter | torch.Tensor:
    """[num_logical, ...] -> [num_physical, ...]: slot p holds logical expert placement[p]."""
    physical = weight.detach()[placement.to(weight.device)].clone()
    if isinstance(weight, nn.Parameter):
        return nn.Parameter(physical, requires_grad=weight.requires_grad)
    return physical


class EplbHandle:
    """EPLB state of one enabled model: layers, batch flags, the pass and its records."""

    def __init__(self, model: nn.Module, layers: list[EplbLayer], flags: BatchFlags, options: EplbOptions) -> None:
        self.model = model
        self.layers = layers
        self.flags = flags
        self.options = options
        self.compiled_graphs: list[CompiledGraphRecord] = []
        self.rearrangements = 0
        self.last_load: torch.Tensor | None = None  # [num_layers, num_logical]: what the placement was computed from

    # -- the pass, in every form a compiler wants ----------------------------------------

    def routers(self) -> list[RouterSpec]:
        return [layer.router() for layer in self.layers]

    def layer(self, key: str) -> EplbLayer:
        return next(layer for layer in self.layers if layer.key == key)

    def backend(self, inner: str | Callable = "inductor") -> Callable:
        """A torch.compile backend: the EPLB pass on the Dynamo graph, then ``inner``.

        Args:
            inner: the backend that compiles the result (a name torch.compile knows, or a callable).
        Returns:
            The backend for ``torch.compile``; each graph it compiles is recorded in ``compiled_graphs``.
        """
        return make_eplb_backend(
            self.routers(), inner, self.compiled_graphs, self.layer,
            strict=self.options.strict, verify_graphs=self.options.verify,
        )

    def run_pass(self, graph_module: fx.GraphModule) -> CompiledGraphRecord:
        """Inserts routing into a Dynamo graph module in place and verifies it; returns its record."""
        self.backend(inner=lambda gm, example_inputs: gm)(graph_module, [])
        return self.compiled_graphs[-1]

    def post_grad_pass(self) -> EplbPostGradPass:
        """For ``torch._inductor.config.post_grad_custom_post_pass``."""
        return EplbPostGradPass(self.routers(), strict=self.options.strict)

    def vllm_inductor_pass(self):
        """The post-grad pass as vLLM's ``CallableInductorPass``."""
        return vllm_inductor_pass(self.post_grad_pass())

    def torchair_backend(self, compiler_config=None) -> Callable:
        """torchair's NPU backend with the EPLB pass first (Ascend hosts only)."""
        return torchair_backend(self.run_pass, compiler_config)

    # -- between forwards ------------------------------------------------------------------

    def set_batch(self, *, num_tokens: int | None = None, is_prefill: bool = False) -> None:
        """Before a forward: whether this batch records load, and how many of its rows are real.

        Args:
            num_tokens: real tokens among the flattened [batch * seq] rows (the rest is trailing
                padding); None: every row. Holds for the following forwards until called again.
            is_prefill: the batch's phase, against ``load_phase`` (any prefill work: prefill).
        """
        record = batch_in_load_phase(self.options.load_phase, is_prefill)
        self.flags.set_(record=record, num_unpadded_tokens=EVERY_ROW if num_tokens is None else num_tokens)

    def logical_load(self) -> torch.Tensor:
        """[num_layers, num_logical] recorded load folded onto logical experts."""
        return torch.stack([layer.tables.logical_load() for layer in self.layers])

    def physical_to_logical(self) -> torch.Tensor:
        """[num_layers, num_physical] the placement routed by now."""
        return torch.stack([layer.tables.physical_to_logical for layer in self.layers])

    def rearrange(self) -> torch.Tensor:
        """The one-process path for a model with no vLLM engine (a PyTorch or Hugging Face user,
        the demo, the tests): upstream's ``DefaultEplbPolicy`` on the recorded load, then, for
        each layer, the expert weights moved locally and the lookup refreshed in place. Under
        vLLM the placement is upstream's ``EplbState``'s, through the plugin; this handle's
        tables are the state here because nothing else holds one.

        A layer that recorded no load since the last placement keeps its placement (the
        vision experts of a multimodal model under text-only traffic); with no load in any
        layer, ``NoLoadRecordedError``. Every new placement is validated before any weight
        moves, so a bad policy output leaves the model exactly as it was.

        Returns:
            The new placement, [num_layers, num_physical] int64.
        Raises:
            NoLoadRecordedError: no layer recorded load since the last placement.
        """
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

        load = self.logical_load()  # [num_layers, num_logical]
        idle = load.sum(dim=1) == 0  # [num_layers]
        self.check_load_recorded(idle)
        old = self.physical_to_logical()
        new = DefaultEplbPolicy.rebalance_experts(load, old.shape[1], 1, 1, self.options.ep_size, old)
        placed = self.apply_placement(torch.where(idle[:, None], old, new.to(old.dtype)))
        self.last_load = load.cpu()
        return placed

    def save_placement(self, path: str | os.PathLike) -> None:
        """Writes the placement routed now, with the load it was computed from, to a placement file.

        Args:
            path: the file (``core/placement_file.py``), written atomically;
                ``enable(model, placement=path)`` starts from it.
        """
        identity = model_identity(self.model, [layer.spec for layer in self.layers], self.options)
        save_placement_file(path, PlacementRecord(identity, self.physical_to_logical().cpu(), self.last_load,
                                                  self.rearrangements, "enable"))

    def check_load_recorded(self, idle: torch.Tensor) -> None:
        """Refuses to balance on nothing: some layer must have recorded load since the last placement."""
        if not bool(idle.all()):
            return
        if self.options.load_phase == "all":
            hint = "run forwards first (each records every row unless set_batch narrowed it)"
        else:
            hint = f"load_phase={self.options.load_phase!r} records only batches announced with set_batch(is_prefill=...)"
        raise NoLoadRecordedError(
            f"no load recorded in any of the {len(self.layers)} MoE layers since the last placement: {hint}; "
            f"a placement balanced on zero load would move experts for nothing"
        )

    def apply_placement(self, placements: torch.Tensor) -> torch.Tensor:
        """Moves the experts to a placement and routes by it.

        Args:
            placements: [num_layers, num_physical], slot -> logical expert; validated whole before
                any weight moves.
        Returns:
            The placement installed, int64 on the host.
        """
        if placements.dim() != 2 or placements.shape[0] != len(self.layers):
            raise ValueError(f"placement must be [num_layers={len(self.layers)}, num_physical], got {tuple(placements.shape)}")
        validate_layer_placements(placements, [layer.tables for layer in self.layers])  # all, before any move
        checked = placements.to("cpu", torch.int64)
        for layer, placement in zip(self.layers, checked):
            # source slot for each new slot: the first old replica of its logical expert
            source = layer.tables.lookup[placement.to(layer.lookup.device), 0].long()  # [num_physical]
            with torch.no_grad():
                for weight in layer.expert_weights():
                    weight.copy_(weight[source.to(weight.device)])  # gather copies first: no aliasing
            layer.tables.refresh_(placement)
            layer.tables.reset_load_()
        self.rearrangements += 1
        return checked

    def close(self) -> None:
        for layer in self.layers:
            layer.close()

    def __repr__(self) -> str:
        return f"EplbHandle({len(self.layers)} layers, {self.options})"


def enable(
    model: nn.Module,
    *,
    num_redundant_experts: int = 0,
    ep_size: int = 1,
    load_phase: str = "all",
    strict: bool = True,
    verify: bool = True,
    adapters: tuple[MoEAdapter, ...] = DEFAULT_ADAPTERS,
    placement: str | os.PathLike | None = None,
) -> EplbHandle:
    """Puts a MoE model under graph-mode EPLB (see the module docstring).

    Args:
        model: the model; its MoE layers are found by the first adapter that finds any (those its
            modules name first, then ``adapters``).
        num_redundant_experts: extra physical slots per layer, for replicas of hot experts.
        ep_size: how many EP ranks the physical experts are split over (the policy's view).
        load_phase: which batches record load: ``all``, ``prefill`` or ``decode`` (``set_batch``).
        strict: an unattributable router top-k is an error (True) or a warning.
        verify: run the verifier on every graph the backend compiles.
        adapters: the model adapters to try.
        placement: a placement file (``handle.save_placement``) the experts start from instead of
            the initial placement, refused before any weight moves if it does not fit this model.

    Returns:
        The ``EplbHandle``: the compile backends, ``set_batch``, ``rearrange``, ``save_placement``.
    Raises:
        ValueError: naming the module, with the model left exactly as it was.
    """
    options = EplbOptions(num_redundant_experts, ep_size, load_phase, strict, verify)
    options.validate()
    adapter, specs = find_moe_layers(model, adapters)
    for spec in specs:  # every check before the first weight is touched
        adapter.check_supported(spec)
        try:  # the one check of an expert layout, worded for this layer
            check_expert_layout(spec.num_experts, num_redundant_experts, spec.top_k, ep_size)
        except ValueError as error:
            raise ValueError(f"{spec.name} ({spec.num_experts} logical + {num_redundant_experts} redundant experts, "
                             f"ep_size={ep_size}): {error}") from None
        for name in spec.expert_param_names:
            leading = getattr(spec.experts, name).shape[0]
            if leading != spec.num_experts:
                raise ValueError(f"{spec.name}.experts.{name} has {leading} rows, expected {spec.num_experts} logical experts")
    kept = None if placement is None else kept_placement(placement, model_identity(model, specs, options))

    handle_id = next(_handle_ids)
    device = next(model.parameters()).device
    flags = BatchFlags(device)
    flags.set_(record=load_phase == "all", num_unpadded_tokens=EVERY_ROW)  # until set_batch says otherwise
    layers = []
    for index, spec in enumerate(specs):
        start = initial_placement(spec.num_experts, num_redundant_experts) if kept is None else kept.physical_to_logical[index]
        for name in spec.expert_param_names:
            setattr(spec.experts, name, to_physical_layout(getattr(spec.experts, name), start))
        adapter.set_num_physical(spec, spec.num_experts + num_redundant_experts)
        tables = LayerLookup(spec.num_experts, spec.num_experts + num_redundant_experts, placement=start, device=device)
        layers.append(EplbLayer(f"eplb{handle_id}.{index}", spec, tables, flags))
        setattr(spec.experts, ENABLED_MARK, layers[-1].key)
    handle = EplbHandle(model, layers, flags, options)
    if kept is not None:
        handle.rearrangements, handle.last_load = kept.rearrangements, kept.load_window
    return handle

