"""Which top-k selects a layer's experts, seen by running the layer once on a probe input.

The pass maps the ids of one ``torch.topk`` per layer. Whether that is the right one is a
question about the model's code, which differs by family (a plain top-k, a group-level
top-k first, bias-corrected scores, routing inside the MoE block itself, no top-k at all).
``probe_selection`` answers it before ``enable`` touches the model: it runs the MoE block
(or, where the block needs more than hidden states, the router alone) on random hidden
states, records every top-k and where it ran, and captures the ids the experts receive.
The layer is mappable only if the experts receive exactly the indices of the last top-k
over the layer's experts with the layer's k -- the one the pass maps. Nothing is written:
no grad, the caller's RNG state restored, the forward stopped at the experts' entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

PROBE_TOKENS = 16


@dataclass(frozen=True)
class TopKCall:
    candidates: int  # size of the dimension the top-k ran over
    k: int
    last_dim: bool
    in_router: bool  # ran while the router module was executing
    indices: torch.Tensor = field(repr=False)


@dataclass
class ProbeResult:
    calls: list[TopKCall]
    ran: str  # "block" or "router": which module the probe could run
    experts_ids: torch.Tensor | None  # ids the experts received (block run) or the router returned
    selection: TopKCall | None  # the last top-k over num_experts with k=top_k

    @property
    def mappable(self) -> bool:
        return self.selection is not None and self.experts_ids is not None and _same_ids(
            self.selection.indices, self.experts_ids
        )


class _ExpertsReached(Exception):
    def __init__(self, ids: torch.Tensor | None) -> None:
        self.ids = ids


class _RecordTopK(TorchFunctionMode):
    """Records each torch.topk / Tensor.topk call and whether the router was running."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[TopKCall] = []
        self.router_depth = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk):
            source = args[0]
            k = kwargs.get("k", args[1] if len(args) > 1 else None)
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            dim = dim % source.dim()
            self.calls.append(TopKCall(source.shape[dim], int(k), dim == source.dim() - 1, self.router_depth > 0, result[1]))
        return result


def _same_ids(selected: torch.Tensor, received: torch.Tensor) -> bool:
    return selected.numel() == received.numel() and torch.equal(
        selected.reshape(-1).long(), received.reshape(-1).long()
    )


def _experts_ids(args: tuple, kwargs: dict) -> torch.Tensor | None:
    ids = kwargs.get("top_k_index", args[1] if len(args) > 1 else None)
    return ids if isinstance(ids, torch.Tensor) else None


def _returned_ids(output, like: torch.Tensor | None) -> torch.Tensor | None:
    """Of a router's outputs, the integer tensor holding the selected ids."""
    tensors = [t for t in (output if isinstance(output, tuple) else (output,)) if isinstance(t, torch.Tensor)]
    integer = [t for t in tensors if not t.dtype.is_floating_point and t.dtype != torch.bool]
    if like is not None:
        same = [t for t in integer if _same_ids(like, t)]
        if same:
            return same[0]
    return integer[-1] if integer else None


def _run(module: nn.Module, x: torch.Tensor, recorder: _RecordTopK, experts: nn.Module):
    """Runs module(x) until the experts are entered; returns (experts ids or None, output or None)."""

    def stop_at_experts(_module, args, kwargs):
        raise _ExpertsReached(_experts_ids(args, kwargs))

    handle = experts.register_forward_pre_hook(stop_at_experts, with_kwargs=True)
    try:
        with recorder:
            return None, module(x)
    except _ExpertsReached as reached:
        return reached.ids, None
    finally:
        handle.remove()


def probe_selection(
    block: nn.Module, router: nn.Module | None, experts: nn.Module, *, hidden_dim: int, num_experts: int, top_k: int
) -> ProbeResult:
    """Runs the block (else the router) on [1, T, hidden] random states; see the module docstring.

    Raises ValueError with the last error where neither can run on hidden states alone.
    """
    weight = next(iter(experts.parameters()), None)
    dtype = weight.dtype if weight is not None and weight.dtype.is_floating_point else torch.float32
    device = weight.device if weight is not None else torch.device("cpu")
    devices = [device] if device.type == "cuda" else []
    attempts = [("block", block, (1, PROBE_TOKENS, hidden_dim))]
    if router is not None:
        attempts += [("router", router, (PROBE_TOKENS, hidden_dim)), ("router", router, (1, PROBE_TOKENS, hidden_dim))]
    errors = []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        generator = torch.Generator(device=device).manual_seed(0)
        for ran, module, shape in attempts:
            recorder = _RecordTopK()
            hooks = _count_router_depth(router, recorder)
            x = torch.randn(shape, generator=generator, device=device).to(dtype)
            try:
                ids, output = _run(module, x, recorder, experts)
            except Exception as error:  # a signature or shape the probe cannot feed: try the next form
                errors.append(f"{ran}{tuple(shape)}: {type(error).__name__}: {error}")
                continue
            finally:
                for hook in hooks:
                    hook.remove()
            selection = next(
                (c for c in reversed(recorder.calls) if c.candidates == num_experts and c.k == top_k and c.last_dim), None
            )
            if ids is None and output is not None and ran == "router":
                ids = _returned_ids(output, selection.indices if selection else None)
            return ProbeResult(recorder.calls, ran, ids, selection)
    raise ValueError("could not run the MoE block or its router on hidden states alone: " + "; ".join(errors))


def _count_router_depth(router: nn.Module | None, recorder: _RecordTopK) -> list:
    if router is None:
        return []

    def enter(*_):
        recorder.router_depth += 1

    def leave(*_):
        recorder.router_depth -= 1

    return [router.register_forward_pre_hook(enter), router.register_forward_hook(leave, always_call=True)]
