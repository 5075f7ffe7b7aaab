"""``eplb-graph doctor``: every adaptation ok on the pinned stack, and a target upstream changed
named by doctor (exit 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from eplb_graph.tools.doctor import adaptations_markdown, diagnose  # noqa: E402
from eplb_graph.tools.cli import main  # noqa: E402
from eplb_graph.upstream.adaptations import ADAPTATIONS  # noqa: E402

ARCHITECTURE = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"


def test_on_the_pinned_stack_every_adaptation_that_applies_holds():
    report = diagnose()
    assert report.platform == "cpu" and report.exit_code == 0 and report.broken == []
    assert [row["key"] for row in report.adaptations] == [a.key for a in ADAPTATIONS]
    applying = [row for row in report.adaptations if row["applies"]]
    assert applying and all(row["status"] == "ok" for row in applying)
    not_here = {row["key"] for row in report.adaptations if row["status"] == "not here"}
    assert not_here == {"runner.ascend_v1_load_model", "runner.ascend_v2_load_model"}  # no vllm-ascend here
    assert report.kernels["cpu_routing"] == "native (C++)" or report.kernels["cpu_routing"].startswith("composite")
    assert report.serves["parallel"]["TP and DP together"].startswith("no:")
    assert report.serves["modes"]["compiled, Inductor (graph pass)"] == "yes"
    text = report.format()
    assert "every adaptation that applies here holds" in text and "capability.commit_layer" in text


def test_doctor_prints_json_and_refuses_bad_arguments(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["broken"] == [] and len(report["adaptations"]) == len(ADAPTATIONS)
    with pytest.raises(SystemExit) as bad:
        main(["doctor", "--json", "--markdown"])
    assert bad.value.code == 2


def test_the_architecture_page_lists_the_registry_as_generated():
    """docs/architecture.md holds `eplb-graph doctor --markdown` verbatim."""
    assert adaptations_markdown() in ARCHITECTURE.read_text()


def test_a_changed_upstream_is_named_by_doctor_with_exit_1(monkeypatch, capsys):
    """A target upstream renamed and a signature it changed; the config gate refuses the same
    at engine start (``tests/eplb_graph/vllm_plugin/test_config_gate.py``)."""
    from vllm.distributed.eplb import eplb_state

    monkeypatch.delattr(eplb_state, "_commit_eplb_maps_for_layer")
    monkeypatch.setattr(eplb_state.EplbState, "_should_record_current_step", lambda self: False)
    assert main(["doctor", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["broken"] == ["vllm.distributed.eplb.eplb_state._commit_eplb_maps_for_layer",
                                "vllm.distributed.eplb.eplb_state.EplbState._should_record_current_step"]
    statuses = {row["key"]: row["status"] for row in report["adaptations"]}
    assert statuses["capability.commit_layer"] == statuses["probes.commit_layer"] == "target missing"
    assert statuses["capability.record_flag"] == "signature changed"
    assert [key for key, status in statuses.items() if status not in ("ok", "not here")] == [
        "capability.commit_layer", "capability.record_flag", "probes.commit_layer"]  # exactly those
    assert main(["doctor"]) == 1
    assert "BROKEN: vllm.distributed.eplb.eplb_state._commit_eplb_maps_for_layer" in capsys.readouterr().out
