"""The step's callable for a mode: the model itself, torch.compile with the EPLB pass, or captured graphs.

Graph mode on a device captures the compiled forward once per capture size
(``eplb_graph.graph.graph_capture.CapturedForward``); on the host the compiled mode is the graph
mode. ``--cpp-wrapper`` compiles with Inductor's C++ wrapper (a host option).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eplb_reference.runtime.config import RunConfig


def inductor_with_cpp_wrapper(graph_module, example_inputs):
    """Inductor with its wrapper generated in C++ rather than Python: the compiled forward calls
    its kernels, and the routing op through the dispatcher, with no Python between them. On the
    host that Python is a share of a small decode step, and the routing op's call through it
    most of the EPLB-on cost (``bench --data-plane`` with and without ``--cpp-wrapper``)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(graph_module, example_inputs, config_patches={"cpp_wrapper": True})


def prepare_forward(model, cfg: RunConfig, rank_layers, records: list):
    """The callable for the mode: the model itself (eager) or torch.compile with the EPLB pass."""
    from eplb_graph.pytorch.backend import make_eplb_backend
    from eplb_graph.passes.router_sites import RouterSpec

    if cfg.mode == "eager":
        return model
    routers = []
    for index, block in enumerate(model.layers):
        if block.mlp.layer_key is not None:
            block.mlp.route_in_module = False  # the pass inserts the routing op instead
            routers.append(RouterSpec(block.mlp.layer_key, f"layers.{index}.mlp.gate", cfg.num_experts, cfg.top_k,
                                          experts_path=f"layers.{index}.mlp.experts"))
    live = {layer.key: layer for layer in rank_layers}
    inner = inductor_with_cpp_wrapper if cfg.cpp_wrapper else cfg.backend
    backend = make_eplb_backend(routers, inner, records, live.__getitem__)
    return torch.compile(model, backend=backend, fullgraph=True, dynamic=False)


def graph_tensor_reader(model, rank_layers) -> Callable[[], list[torch.Tensor]]:
    """Reads, now, every tensor a captured graph of ``model`` holds by address: weights
    (expert weight views included), buffers, and each layer's routing tables, load buffer
    and batch flags. Called before every replay, so it reads the modules' parameter and
    buffer slots directly rather than walking the modules each time; a tensor assigned into a
    slot later is what it returns."""
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
    from eplb_graph.graph.graph_capture import CapturedForward

    captured = CapturedForward(
        forward, tuple(cfg.capture_sizes), device=cfg.device, flags=flags,
        graph_tensors=graph_tensor_reader(model, rank_layers),
        check_addresses_on_replay=False,  # timed_step's untimed ``after`` checks them between steps
    )
    captured.capture_all()
    return captured, captured


def unique_graphs() -> int:
    """Dynamo's count of graphs compiled in this process: a recompile adds one."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
