import json

import pytest

from eplb_graph.tools.cli import main


def test_inspect_json_reports_every_router(capsys):
    assert main(["inspect", "--model", "mixtral", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["routers_found"] == report["routers_mapped"] == 2
    assert report["verifier_ok"] is True
    assert report["unattributed"] == []
    assert [layer["name"] for layer in report["layers"]] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert all(layer["routing_node"].startswith("map_and_record_layer") for layer in report["layers"])


def test_inspect_text_marks_the_inserted_op_and_writes_graphs(tmp_path, capsys):
    assert main(["inspect", "--model", "deepseek_v3", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    marked = [line for line in text.splitlines() if line.startswith(">>")]
    assert len(marked) == 2 and all("map_and_record_layer" in line for line in marked)
    assert text.count("not mapped: ") == 4  # DeepSeek-V3's group top-k, two per router
    assert "map_and_record_layer" not in (tmp_path / "graph_before.txt").read_text()
    assert (tmp_path / "graph_after.txt").read_text().count("map_and_record_layer.default(") == 2
    assert (tmp_path / "graph.html").read_text().count('class="eplb"') == 2
    assert json.loads((tmp_path / "report.json").read_text())["verifier_ok"] is True


def test_inspect_rejects_an_unknown_model():
    with pytest.raises(SystemExit):
        main(["inspect", "--model", "llama"])
