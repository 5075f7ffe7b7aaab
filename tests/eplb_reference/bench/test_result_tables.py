"""reference/eplb_reference/bench/result_tables.py: the markdown each benchmark record is shown as."""

from __future__ import annotations

from eplb_reference.bench.result_tables import ratio_cell, render_gpu, table


def test_a_table_is_markdown_with_missing_figures_shown_as_na():
    assert table(["a", "b"], [[1, None], ["x", 2.5]]) == "| a | b |\n| --- | --- |\n| 1 | n/a |\n| x | 2.5 |"


def test_a_ratio_cell_carries_its_interval_when_the_record_has_one():
    ratios = {"r": 1.07, "r_ci": [0.98, 1.15]}
    assert ratio_cell(ratios, "r", "r_ci") == "1.07 [0.98, 1.15]"
    assert ratio_cell(ratios, "r") == "1.07"
    assert ratio_cell(ratios, "missing", "r_ci") == "n/a"


def test_the_gpu_record_names_its_device_and_each_stage():
    text = render_gpu({"device": "H200", "torch": "2.13.0", "cuda_kernel": True,
                       "stages": {"ops": {"status": "ok", "seconds": 1.5}, "bench": {"status": "skipped"}}})
    assert text.startswith("H200, torch 2.13.0, CUDA kernel True\n\n| stage | status | seconds |")
    assert "| ops | ok | 1.5 |" in text and "| bench | skipped | n/a |" in text
