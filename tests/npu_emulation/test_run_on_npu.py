"""``eplb-graph run --device npu --mode graph`` on the emulated device: two rank processes, the
compiled forward captured into NPU graphs once per size, upstream's async EPLB rearranging
between replays, every step's output checked against the no-EPLB model."""

import json

import pytest

from eplb_reference.cli import main
from tests.npu_emulation import ACTIVATE_MODULE, MODULE_ENV


@pytest.mark.launches
def test_graph_mode_on_npu_rearranges_between_replays_without_recapture(npu_emulation, monkeypatch, tmp_path,
                                                                       capsys):
    monkeypatch.setenv(MODULE_ENV, ACTIVATE_MODULE)  # the rank processes load the same device
    code = main(["run", "--device", "npu", "--mode", "graph", "--ranks", "2", "--steps", "50",
                 "--out", str(tmp_path)])
    summary = capsys.readouterr().out
    assert code == 0, summary
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["device"] == "npu" and report["mode"] == "graph"
    assert report["rearrangements"] >= 2 and report["layers_committed"] >= 2 * report["num_layers"]
    assert report["output_mismatches"] == 0 and report["nonfinite_output_steps"] == 0
    assert report["recaptures"] == 0 and report["recompiles"] == 0 and report["verifier_ok"]
    assert report["failed_invariants"] == []
    assert "recaptures 0" in summary


def test_inductor_is_refused_on_npu_before_any_process_starts(npu_emulation, monkeypatch):
    from eplb_reference.runtime.config import RunConfig

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # vLLM's CPU platform sets it in-process

    with pytest.raises(ValueError, match="Inductor has no NPU code generation"):
        RunConfig(device="npu", mode="graph", backend="inductor").validate()
    with pytest.raises(ValueError, match="9 ranks need 9 NPUs"):
        RunConfig(device="npu", mode="graph", backend="aot_eager", ranks=9, num_experts=18, num_redundant_experts=0,
                  ).validate()
