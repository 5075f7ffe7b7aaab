"""``handle.save_placement`` and ``enable(model, placement=...)``: a Hugging Face model starts from
the placement an earlier run kept, and a file that does not fit is refused with the model as it was."""

import copy
import json

import pytest
import torch

import eplb_graph
from eplb_graph.pytorch.adapter_base import ENABLED_MARK
from eplb_graph.tools.inspect_models import build_tiny_hf_model
from eplb_graph.core.placement_file import PlacementFileError, config_hash, load

TOKENS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """A rearranged model's placement, saved; and the untouched logical model it came from."""
    logical = build_tiny_hf_model("qwen3_moe")
    model = copy.deepcopy(logical)
    handle = eplb_graph.enable(model, num_redundant_experts=2)
    with torch.no_grad():  # the compiled graph records the load (the pass inserts the op)
        torch.compile(model, backend=handle.backend("aot_eager"), fullgraph=True)(TOKENS)
    handle.rearrange()
    path = tmp_path_factory.mktemp("placement") / "placement.json"
    handle.save_placement(path)
    return logical, handle, path


@torch.no_grad()
def test_a_model_enabled_from_a_kept_placement_routes_by_it_with_every_slot_holding_its_expert(kept):
    logical, first, path = kept
    saved = first.physical_to_logical()
    assert not torch.equal(saved, torch.stack([layer.tables.physical_to_logical for layer in
                                               eplb_graph.enable(copy.deepcopy(logical), num_redundant_experts=2).layers]))
    model = copy.deepcopy(logical)
    handle = eplb_graph.enable(model, num_redundant_experts=2, placement=path)
    assert torch.equal(handle.physical_to_logical(), saved)
    assert handle.rearrangements == first.rearrangements == 1
    assert torch.equal(handle.last_load, first.last_load)  # the window the placement came from
    for layer, logical_layer in zip(handle.layers, logical.model.layers):
        placement = layer.tables.physical_to_logical
        for name in layer.spec.expert_param_names:
            assert torch.equal(getattr(layer.spec.experts, name), getattr(logical_layer.mlp.experts, name)[placement])
    compiled = torch.compile(model, backend=handle.backend("aot_eager"), fullgraph=True)
    torch.testing.assert_close(compiled(TOKENS).logits, logical(TOKENS).logits)


def test_the_file_holds_the_documented_fields(kept):
    _, handle, path = kept
    document = json.loads(path.read_text())
    assert document["format"] == "eplb-graph placement" and document["version"] == 1
    assert document["identity"] == {"architecture": "Qwen3MoeForCausalLM", "config_hash": config_hash(handle.model.config),
                                    "num_layers": 2, "num_logical_experts": 8, "num_physical_experts": 10, "ep_size": 1,
                                    "quantization": "none"}
    assert document["written_by"] == "enable" and document["rearrangements"] == 1
    assert load(path).physical_to_logical.tolist() == handle.physical_to_logical().tolist()


@pytest.mark.parametrize(("options", "family", "message"), [
    ({"num_redundant_experts": 4}, "qwen3_moe", "num_physical_experts is 10 in the file, 12 here"),
    ({"num_redundant_experts": 2, "ep_size": 2}, "qwen3_moe", "ep_size is 1 in the file, 2 here"),
    ({"num_redundant_experts": 2}, "mixtral", "architecture is 'Qwen3MoeForCausalLM' in the file, 'MixtralForCausalLM' here"),
])
def test_a_file_kept_for_another_model_or_layout_is_refused_naming_the_field(kept, options, family, message):
    _, _, path = kept
    model = build_tiny_hf_model(family)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(PlacementFileError, match=message):
        eplb_graph.enable(model, placement=path, **options)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[name], after[name]) for name in before)
    assert not any(hasattr(module, ENABLED_MARK) for module in model.modules())


def test_a_corrupted_file_is_refused_by_its_checksum(kept, tmp_path):
    logical, _, path = kept
    document = json.loads(path.read_text())
    document["physical_to_logical"][0][0] = (document["physical_to_logical"][0][0] + 1) % 8
    corrupted = tmp_path / "corrupted.json"
    corrupted.write_text(json.dumps(document))
    with pytest.raises(PlacementFileError, match="is corrupt: its checksum does not match"):
        eplb_graph.enable(copy.deepcopy(logical), num_redundant_experts=2, placement=corrupted)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(path.read_text()[:100])
    with pytest.raises(PlacementFileError, match="cannot be read"):
        eplb_graph.enable(copy.deepcopy(logical), num_redundant_experts=2, placement=truncated)
