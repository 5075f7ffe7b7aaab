"""docs/quickstart-hf.md, PyTorch path, executed verbatim: save_pretrained -> from_pretrained ->
enable -> compile (Inductor) -> greedy generate with rearrangement between calls."""

import pytest
import torch

from eplb_graph.pytorch.enable import EplbHandle

from .quickstart_blocks import quickstart_blocks


@pytest.fixture(scope="module")
def quickstart() -> dict:
    setup, loop = quickstart_blocks("PyTorch", "python")
    namespace: dict = {"__name__": "quickstart"}
    exec(compile(setup, "quickstart-hf.md[setup]", "exec"), namespace)
    handle: EplbHandle = namespace["handle"]
    graphs_at_rearrange = []
    rearrange = handle.rearrange

    def counting_rearrange():  # how many graphs were compiled by the time of each rearrangement
        graphs_at_rearrange.append(len(handle.compiled_graphs))
        return rearrange()

    handle.rearrange = counting_rearrange
    initial = handle.physical_to_logical()
    exec(compile(loop, "quickstart-hf.md[generate]", "exec"), namespace)  # asserts the tokens itself
    return {**namespace, "graphs_at_rearrange": graphs_at_rearrange, "initial_placement": initial}


def test_the_user_model_runs_the_default_grouped_mm_experts_under_eplb(quickstart):
    handle = quickstart["handle"]
    assert quickstart["model"].config._experts_implementation == "grouped_mm"
    assert [layer.spec.implementation for layer in handle.layers] == ["grouped_mm", "grouped_mm"]
    experts = quickstart["model"].model.layers[0].mlp.experts
    assert experts.num_experts == 12 and experts.gate_up_proj.shape[0] == 12  # histc bins and weights: physical


def test_generate_rearranges_between_calls_without_recompiling(quickstart):
    handle = quickstart["handle"]
    assert handle.rearrangements == 3
    assert not torch.equal(handle.physical_to_logical(), quickstart["initial_placement"])
    counts = quickstart["graphs_at_rearrange"]
    assert counts[0] > 0 and counts == [counts[0]] * 3  # every graph compiled in the first generate
    assert all(record.report.ok and record.result.routers_mapped == 2 for record in handle.compiled_graphs)
    # load of the last generate (12 tokens, 11 forwarded, 2 layers, top-2) was consumed by its rearrange
    assert int(handle.logical_load().sum()) == 0
