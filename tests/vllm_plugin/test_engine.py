"""vLLM's own engine (CPU build 0.32.0) with the plugin installed, end to end.

One process, compiled (vLLM's CPU Inductor path) and eager, EPLB on and off, a tiny
random-weight Qwen3-MoE with 8 experts, top-2, 4 redundant slots, window 4, interval 8.
Expert parallel over 2 processes is not used: vLLM's CPU fused-MoE kernel ignores the
expert map and crashes under EP > 1 (the config gate refuses it, see test_config_gate.py),
so placement changes here move experts between slots of one process; cross-process
movement is proven by our own runtime's tests (tests/runtime/test_controller.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast

pytest.importorskip("vllm")

ENGINE_RUN = Path(__file__).with_name("engine_run.py")
REPO_ROOT = Path(__file__).parents[2]
RUNS = {
    "compiled_off": ["--eplb", "off", "--mode", "compiled"],
    "compiled_on": ["--eplb", "on", "--mode", "compiled"],
    "eager_off": ["--eplb", "off", "--mode", "eager"],
    "eager_on": ["--eplb", "on", "--mode", "eager"],
    "engine_process_on": ["--eplb", "on", "--mode", "compiled", "--engine-process"],
}
INITIAL_PLACEMENT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # upstream's: logical ids, then round-robin


def launch(args: list[str], workdir: Path) -> subprocess.Popen:
    # No compile caches: a cache hit serves the graph our pass built earlier without running
    # the pass again (correct, and caught by the runtime check), but here the pass must run.
    env = {**os.environ, "VLLM_DISABLE_COMPILE_CACHE": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
           "TORCHINDUCTOR_AUTOGRAD_CACHE": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, str(ENGINE_RUN), *args], cwd=workdir, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )


def result_of(process: subprocess.Popen, name: str) -> dict:
    output, _ = process.communicate(timeout=600)
    lines = [line for line in output.splitlines() if line.startswith("ENGINE_RUN_RESULT ")]
    assert process.returncode == 0 and lines, f"{name} failed:\n{output[-6000:]}"
    # upstream's own log line, from whichever process ran the worker
    return {**json.loads(lines[-1].split(" ", 1)[1]), "upstream_rearrangements_logged": output.count(
        "Rearranging experts (async mode) ...")}


def run_in_pairs(runs: dict[str, list[str]], workdir: Path) -> dict[str, dict]:
    """Two engines at a time, one per core of these machines."""
    results = {}
    names = list(runs)
    for start in range(0, len(names), 2):
        processes = {name: launch(runs[name], workdir) for name in names[start : start + 2]}
        results.update({name: result_of(process, name) for name, process in processes.items()})
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    return run_in_pairs(RUNS, tmp_path_factory.mktemp("engine"))


def test_greedy_tokens_are_identical_with_eplb_on_and_off(runs):
    off, on = runs["compiled_off"]["tokens"], runs["compiled_on"]["tokens"]
    assert on == off
    assert len({t for seq in off for t in seq}) >= 20  # the experts decide real, varied tokens


def test_compiled_eplb_rearranges_during_generation_with_the_graph_pass(runs):
    eplb = runs["compiled_on"]["eplb"]
    assert runs["compiled_on"]["enable_eplb"] and eplb["built_upstream_state"]
    assert eplb["rearrangements_committed"] >= 3
    # 2 layers per rearrangement, and those of one still in flight when generation ended
    assert eplb["layers_committed"] == 2 * eplb["rearrangements_committed"] + eplb["layers_committed_in_flight"]
    assert eplb["worker_error"] is None and eplb["rejected_placements"] == []
    for key, layer in eplb["layers"].items():
        assert layer["mapped_by"] == "graph_pass", key
        assert layer["graph_mappings"] == 1, key  # the pass mapped its top-k once, in the one graph
        assert layer["host_calls"] > 0, key


def test_the_plugin_really_acted_load_was_recorded_and_placement_changed(runs):
    """Fails if the plugin were not loaded or EPLB silently did nothing."""
    eplb = runs["compiled_on"]["eplb"]
    assert eplb["load_window_total"] > 0
    assert eplb["placement_changes"] >= 1
    assert any(layer["placement"] != INITIAL_PLACEMENT for layer in eplb["layers"].values())
    assert runs["compiled_on"]["pass_installed"] == "VllmEplbPass"
    assert runs["compiled_off"]["eplb"] is None and runs["compiled_off"]["pass_installed"] == "NoneType"


def test_zero_recompiles_after_warm_up(runs):
    for name in ("compiled_on", "compiled_off"):
        assert runs[name]["recompiles_after_warm_up"] == 0, name
        assert runs[name]["pass_runs_after_warm_up"] == 0, name
    assert runs["compiled_on"]["dynamo_graphs"] == runs["compiled_off"]["dynamo_graphs"]
    # the worker's own count, from the end of its warm-up (what it would log: compile_watch.py)
    assert runs["compiled_on"]["eplb"]["graphs_compiled_while_serving"] == 0


def test_eager_mode_routes_through_the_router_adapter(runs):
    on, off = runs["eager_on"], runs["eager_off"]
    assert on["tokens"] == off["tokens"]
    assert on["eplb"]["rearrangements_committed"] >= 3 and on["eplb"]["placement_changes"] >= 1
    for key, layer in on["eplb"]["layers"].items():
        assert layer["mapped_by"] == "router_adapter", key
        assert layer["graph_mappings"] == 0 and layer["host_calls"] > 0, key


def test_the_default_separate_engine_process_works_the_same(runs):
    """vLLM's default layout: the plugin loads again in the engine-core process and works there."""
    run = runs["engine_process_on"]
    assert run["tokens"] == runs["compiled_off"]["tokens"]
    assert run["upstream_rearrangements_logged"] >= 3
