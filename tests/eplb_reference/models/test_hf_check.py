"""The support matrix, fast subset: one family per router kind through the matrix's own check
(aot_eager only; ``benchmarks/support_matrix.py`` runs every family with Inductor too)."""

import re
from pathlib import Path

import pytest
import transformers

from eplb_reference.models.hf_check import check_family
from eplb_reference.models.hf_families import moe_families
from tests.benchmarks.scripts import load_benchmark

MATRIX = Path(__file__).resolve().parents[3] / "docs" / "support-matrix.md"

WORKING = {
    "qwen3_moe": "Qwen3MoeTopKRouter",  # plain softmax top-k
    "deepseek_v3": "bias-corrected scores, grouped top-k (2 groups, 1 kept), shared experts, 1 dense layer(s)",
    "jamba": "top-k in the MoE block",  # router is an nn.Linear, the block runs the top-k
    "gemma4": "Gemma4TextRouter",  # router beside the experts in the decoder layer
}
REFUSED = {
    "phimoe": "no torch.topk over the 8 experts with k=2 selects them",  # sparsemixer: max(), not top-k
    "zaya": r"no torch.topk over the 8 experts with k=1 selects them \(top-k calls seen: k=1 over 9\)",
    "deepseek_v4": "DeepseekV4HashRouter routes by token ids",
}


@pytest.mark.parametrize("family", WORKING)
def test_family_works_through_enable_compile_rearrange(family):
    row = check_family(family, ("aot_eager",))
    assert row.status == "works", row.reason
    assert WORKING[family] in row.router
    (result,) = row.backends
    assert result.verified and result.routers_mapped == row.moe_layers >= 1
    assert result.placement_changed and not result.recompiled
    assert result.load_recorded > 0 and result.max_abs_diff < 1e-4
    if family == "deepseek_v3":
        assert "2 group-level top-k per router listed, not mapped" in row.router  # DeepSeek-V3's group selection


@pytest.mark.parametrize("family", REFUSED)
def test_family_is_refused_at_enable_with_the_reason(family):
    row = check_family(family, ("aot_eager",))
    assert row.status == "refused" and row.backends == []
    assert re.search(REFUSED[family], row.reason), row.reason


def test_the_markdown_counts_rows_and_names_the_versions():
    matrix = load_benchmark("support_matrix")
    rows = [check_family("phimoe", ("aot_eager",)).as_dict(),
            {"family": "x", "status": "cannot-build", "reason": "a | b", "backends": []}]
    text = matrix.markdown(rows, ("aot_eager",), {"transformers": "9.9", "torch": "2.x", "families": 55})
    assert "transformers 9.9, torch 2.x" in text
    assert "2 families checked of the 55 that use `use_experts_implementation`: 0 works, 1 refused, 1 cannot-build, 0 failed" in text
    assert "| x |" in text and "cannot-build: a \\| b |" in text
    assert "## How each kind of router is handled" in text and "## Quantized checkpoints in the vLLM plugin" in text


def test_the_committed_matrix_lists_every_quantization_the_plugin_serves():
    from eplb_graph.vllm_plugin.expert_views import SUPPORTED_QUANTIZATIONS, VIEWED_MOE_METHODS

    section = MATRIX.read_text().split("## Quantized checkpoints in the vLLM plugin", 1)[1]
    for name in [q for q in SUPPORTED_QUANTIZATIONS if q] + list(VIEWED_MOE_METHODS):
        assert f"`{name}`" in section, name


def test_the_committed_matrix_covers_every_family_of_the_installed_transformers():
    text = MATRIX.read_text()
    assert f"transformers {transformers.__version__}" in text
    families = moe_families()
    families_table = text.split("## How each kind of router is handled", 1)[0]
    listed = re.findall(r"^\| (\w+) \|", families_table, re.MULTILINE)
    assert sorted(set(listed) - {"family"}) == sorted(families)
    assert re.search(rf"{len(families)} families checked of the {len(families)} ", text)
