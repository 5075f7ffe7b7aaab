"""`pip install .` ships the product only; `pip install reference` the reference runtime and harness,
whose commands reach `eplb-graph` as entry points (the wheels as pip builds them, read back)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, zipfile.ZipFile]:
    out, source = tmp_path_factory.mktemp("wheels"), tmp_path_factory.mktemp("source") / "tree"
    # Built from a copy: setuptools writes build/ and egg-info beside the sources, which other tests import.
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "out", "*.egg-info",
                                                                 "__pycache__", ".gpu-carry", ".hypothesis"))
    for project in (source, source / "reference"):
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                        str(project)], check=True, capture_output=True, timeout=300)
    return {path.name.split("-")[0]: zipfile.ZipFile(path) for path in out.glob("*.whl")}


def _packages(wheel: zipfile.ZipFile) -> set[str]:
    return {name.split("/")[0] for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}


def _entry_points(wheel: zipfile.ZipFile) -> str:
    return wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))).decode()


def test_the_product_wheel_holds_the_product_only(wheels):
    product = wheels["eplb_graph"]
    assert _packages(product) == {"eplb_graph"}
    names = set(product.namelist())
    assert {"eplb_graph/custom_ops/routing.py", "eplb_graph/passes/insert_routing.py", "eplb_graph/tools/cli.py"} <= names
    assert any(name.startswith("eplb_graph/custom_ops/csrc/") and name.endswith(".cpp") for name in names)
    points = _entry_points(product)
    assert "eplb-graph = eplb_graph.tools.cli:main" in points and "eplb_graph.vllm_plugin:register" in points


def test_the_reference_wheel_holds_the_reference_and_adds_its_commands(wheels):
    reference = wheels["eplb_graph_reference"]
    assert _packages(reference) == {"eplb_reference"}
    names = set(reference.namelist())
    assert {"eplb_reference/runtime/rank.py", "eplb_reference/elastic/server.py", "eplb_reference/bench/harness.py",
            "eplb_reference/models/reference.py", "eplb_reference/elastic/protocol/board.py"} <= names
    points = _entry_points(reference)
    for command in ("run", "serve", "join", "bench", "demo"):
        assert f"{command} = eplb_reference.cli:main" in points
    assert "reference = eplb_reference.models.reference:inspect_example" in points
