"""`eplb-graph bench --data-plane`: the routing op's cost without vLLM, with the checks that make it mean something."""

import json
import subprocess
import sys

import pytest
import torch

from eplb_reference.bench import data_plane as bench_data_plane
from eplb_reference.bench.table import format_table
from eplb_reference.bench.data_plane import failed_checks, run_data_plane_bench
from eplb_reference.cli import main
from eplb_graph.custom_ops import CPU_LAYER_KERNEL
from eplb_reference.runtime.config import RunConfig
from tests.markers import requires_cuda

QUICK = dict(ranks=1, steps=20, backend="aot_eager")
MODES = ("eager", "compiled", "graph")  # on the host, graph is compiled again: the harness is what is run  # Inductor is not the subject here


def test_data_plane_bench_times_a_routing_op_that_routes_and_records():
    threads_before = torch.get_num_threads()
    threads = threads_before + 1  # not this process's count: the bench must set it, then give it back
    # all three modes in one process, as the GPU call runs them: the layer keys and the compiled
    # frame of one mode must not leak into the next (a duplicate key, Dynamo's recompile limit)
    report = run_data_plane_bench(RunConfig(**QUICK, threads=threads), MODES)
    assert report["intra_op_threads"] == [threads] and torch.get_num_threads() == threads_before
    assert report["failed_checks"] == [] and report["data_plane_only"] is True and report["ranks"] == 1
    assert report["cpp_wrapper"] is False and report["cpu_layer_kernel"] == CPU_LAYER_KERNEL  # what was timed
    assert {(r["mode"], r["eplb"]) for r in report["results"]} == {
        (mode, setting) for mode in MODES for setting in ("off", "on_idle")}
    for result in report["results"]:
        assert result["p99_ms"] >= result["p50_ms"] > 0 and result["recompiles"] == 0 and result["decode_steps"] == 20
    for mode in MODES:
        checks = report["checks"][mode]
        # identity placement: every id reaches a copy of its own expert, so on_idle computes what off computes
        assert checks["on_idle_vs_off_mismatches"] == 0 and checks["on_idle_vs_off_steps_checked"] == 20
        if mode == "eager":
            assert checks["output_tolerance"] == 0 and checks["on_idle_vs_off_max_abs_diff"] == 0
        # 20 decode steps of 16 tokens, top-4: every routed pair counted once, per layer
        assert checks["load_recorded_per_layer"] == [20 * 16 * 4] * 2 == [checks["load_expected_per_layer"]] * 2
        ratios = report["ratios"][mode]
        assert ratios["on_idle_over_off"] > 0 and "rearranging_p99_over_steady_p50" not in ratios
        low, high = ratios["off_twin_over_off_ci95"]
        assert 0 < low <= high
    assert report["ratios"]["graph_speedup_over_eager_decode"] > 0
    table = format_table(report)
    assert "on_idle / off (p50)" in table and "rearranging" not in table  # no row for what was not measured
    assert f"torch intra-op threads per rank: {threads}" in table


def test_a_routing_op_that_records_nothing_fails_the_bench(monkeypatch):
    """The flags say 'record' but are switched off: the op still maps, the load check catches it."""

    class RecordingOff(bench_data_plane.FlagsOnly):
        def begin_batch(self, *, num_unpadded_tokens: int, is_prefill: bool) -> bool:
            self.flags.set_(record=False, num_unpadded_tokens=num_unpadded_tokens)
            return False

    monkeypatch.setattr(bench_data_plane, "FlagsOnly", RecordingOff)
    report = run_data_plane_bench(RunConfig(**QUICK), ("eager",))
    assert report["failed_checks"] == ["eager: the routing op recorded [0, 0] tokens per layer, expected 1280 each"]


def test_tables_that_route_to_the_wrong_slots_fail_the_bench(monkeypatch):
    """Tables that disagree with the weights (slots 0 and 1 swapped): on_idle no longer computes off."""
    build = bench_data_plane.build_rank_models

    def build_with_swapped_tables(cfg, rank, ep_size, group):
        built = build(cfg, rank, ep_size, group)
        for layer in built[2]:
            placement = layer.tables.physical_to_logical.clone()
            placement[[0, 1]] = placement[[1, 0]]
            layer.tables.refresh_(placement)
        return built

    monkeypatch.setattr(bench_data_plane, "build_rank_models", build_with_swapped_tables)
    report = run_data_plane_bench(RunConfig(**QUICK), ("eager",))
    [problem] = report["failed_checks"]
    assert problem.startswith("eager: 20 on_idle step(s) differ from off beyond 0.0")


def test_failed_checks_name_outputs_that_differ():
    checks = {"output_tolerance": 0.0, "on_idle_vs_off_mismatches": 3, "on_idle_vs_off_max_abs_diff": 0.25,
              "load_recorded_per_layer": [64, 64], "load_expected_per_layer": 64}
    assert failed_checks("graph", checks) == ["graph: 3 on_idle step(s) differ from off beyond 0.0 (max |diff| 2.50e-01)"]


@pytest.mark.launches
def test_the_cli_writes_the_report_and_needs_no_vllm(tmp_path):
    """In a fresh interpreter: the whole data-plane bench runs without importing vLLM."""
    code = (
        "import sys; from eplb_reference.cli import main; "
        f"code = main(['bench', '--data-plane', '--mode', 'eager', '--steps', '20', '--json', '--out', {str(tmp_path)!r}]); "
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')], 'vllm imported'; sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["checks"]["eager"]["on_idle_vs_off_mismatches"] == 0 and report["failed_checks"] == []
    assert "bench eager (data plane): off, on_idle and the A/A twin, 20 steps each" in done.stderr
    assert json.loads((tmp_path / "bench.json").read_text()) == report and (tmp_path / "bench.png").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ranks", "2"], "(--data-plane) runs one process (EP size 1, no collective), got 2 ranks"),
        (["--policy-process"], "(--data-plane) runs no control plane: --policy-process does not apply"),
        (["--steps", "5"], "bench needs --steps >= 20"),
        (["--mode", "graph"], "on the host the compiled mode is the graph mode"),
    ],
)
def test_data_plane_bench_refuses_what_it_cannot_run(args, message, capsys, tmp_path):
    assert main(["bench", "--data-plane", "--out", str(tmp_path / "out"), *args]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before the output directory is made


@requires_cuda
def test_data_plane_bench_on_cuda_replays_graphs_that_route_and_record():
    report = run_data_plane_bench(RunConfig(device="cuda", **QUICK), ("eager", "compiled", "graph"))
    assert report["failed_checks"] == []
    graph = {r["eplb"]: r for r in report["results"] if r["mode"] == "graph"}
    assert graph["off"]["recaptures"] == graph["on_idle"]["recaptures"] == 0
    # the captured graph's routing op wrote the live load buffer at every replay
    assert report["checks"]["graph"]["load_recorded_per_layer"] == [20 * 16 * 4] * 2
    assert report["ratios"]["graph_speedup_over_eager_decode"] > 0
