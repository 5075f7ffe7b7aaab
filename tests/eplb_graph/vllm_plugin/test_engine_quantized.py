"""vLLM's engine (CPU build 0.32.0) with the plugin on quantized checkpoints, end to end.

Online FP8 (``quantization="fp8_per_block"`` from a bf16 checkpoint, the routed experts only),
a pre-quantized block-FP8 checkpoint (``quant_method: fp8``, ``weight_block_size``) and an int4
one (compressed-tensors pack-quantized, run as W4A8 by vLLM's CPU experts), EPLB on and off,
compiled, window 4, interval 8, 4 redundant slots; the FP8 and int4 checkpoints at TP=2 too, where
the experts, their scales and zero points move between the two workers (compared with the same
TP=2 engine never rebalancing: TP=2 sums bfloat16 partial results across workers, which one
process does not, so greedy tokens part from one process's after a few dozen tokens, EPLB or not). vLLM's quantized CPU experts are admitted on
this AMX-less CPU by the test harness, on vLLM's kernels where its build has them and on the
stand-ins elsewhere (cpu_quantized_experts.py and cpu_kernel_stand_ins.py say what that does not prove);
at most 4 tokens per step keep the kernels exact across batches, so EPLB on must give the very
tokens of EPLB off: a scale left behind by a move changes them (the control run shows it). The
int4 checkpoint is symmetric, so its zero points are one constant created at load: that they
move is shown by the view (what the kernel reads is what upstream moves), not by the tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from eplb_reference.models.tiny_checkpoint import TINY_QWEN3_MOE
from tests.eplb_graph.vllm_plugin.test_engine import (
    check_slots_hold_committed_experts,
    expert_digests,
    filled,
    placements_of,
    run_two_at_a_time,
    slots_hold,
)

pytest.importorskip("vllm")

pytestmark = pytest.mark.launches  # engines: left out by make test-fast

COMPILED = ["--mode", "compiled"]
RUNS = {
    "online_off": ["--eplb", "off", "--weights", "fp8-online", *COMPILED],
    "online_on": ["--eplb", "on", "--weights", "fp8-online", *COMPILED],
    "checkpoint_off": ["--eplb", "off", "--weights", "fp8-checkpoint", *COMPILED],
    "checkpoint_on": ["--eplb", "on", "--weights", "fp8-checkpoint", *COMPILED],
    "int4_off": ["--eplb", "off", "--weights", "int4-checkpoint", *COMPILED],
    "int4_on": ["--eplb", "on", "--weights", "int4-checkpoint", *COMPILED],
    # expert parallel over two TP workers, each computing its own pairs on the quantized kernels
    "checkpoint_tp2_on": ["--eplb", "on", "--weights", "fp8-checkpoint", "--tp", "2", *COMPILED],
    "int4_tp2_on": ["--eplb", "on", "--weights", "int4-checkpoint", "--tp", "2", "--placement-file", "{placement}",
                    *COMPILED],
    # the same engine never rebalancing: TP=2 all-reduces bfloat16 partial sums, so its tokens are
    # TP=2's own, not one process's (in float32 they agree: test_engine.py); EPLB must not change them
    "checkpoint_tp2_static": ["--eplb", "on", "--weights", "fp8-checkpoint", "--tp", "2", "--interval", "1000000",
                              "--placement-file", "{static_placement}", *COMPILED],
    "checkpoint_on_scales_hidden": ["--eplb", "on", "--weights", "fp8-checkpoint", "--hide-scales-from-upstream",
                                    *COMPILED],
    "checkpoint_on_scales_left_behind": ["--eplb", "on", "--weights", "fp8-checkpoint", "--hide-scales-from-upstream",
                                         "--no-derived-moves", *COMPILED],
}
# started once int4_tp2_on has ended, from the placement it kept, never rebalancing: int4's TP=2
# twin whose experts stay where the moves left them
RESTARTS = {"int4_tp2_restored": [*RUNS["int4_tp2_on"], "--interval", "1000000"]}
STATIC_TWINS = {"checkpoint": "checkpoint_tp2_static", "int4": "int4_tp2_restored"}
BLOCK_SCALES = ["w13_weight_scale_inv", "w2_weight_scale_inv"]
FP8_READS = {"w13_weight": "w13_weight", "w2_weight": "w2_weight", "w1_scale": BLOCK_SCALES[0], "w2_scale": BLOCK_SCALES[1]}
# the blocked int4 weights, their scales and the zero points the method creates at load
INT4_READS = {"w13_weight": "w13_weight_packed", "w2_weight": "w2_weight_packed", "w1_scale": "w13_weight_scale",
              "w1_zp": "w13_weight_zero_point", "w2_scale": "w2_weight_scale", "w2_zp": "w2_weight_zero_point"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp("engine_fp8")
    placement, static_placement = workdir / "placement.json", workdir / "static_placement.json"
    kept = {}

    def keep(name: str) -> None:
        if name == "int4_tp2_on":  # what it left at its end, before the restart rewrites it
            kept["kept_placement"] = json.loads(placement.read_text())

    results = run_two_at_a_time(filled({**RUNS, **RESTARTS}, placement=str(placement),
                                       static_placement=str(static_placement)),
                                workdir, after=dict.fromkeys(RESTARTS, "int4_tp2_on"), when_done=keep)
    return {**results, **kept, "static_placement": json.loads(static_placement.read_text()),
            "placement_after_restart": json.loads(placement.read_text())}


@pytest.mark.parametrize("weights", ["online", "checkpoint", "int4"])
def test_greedy_tokens_are_identical_with_eplb_on_and_off(runs, weights):
    packing = "convert_weight_packed_scale_zp" if weights == "int4" else "convert_weight_packed"
    for name in (f"{weights}_off", f"{weights}_on"):  # the stand-ins only where vLLM's build lacks its kernels
        report = runs[name]["quantized_kernels"]
        assert report["kernels"] == ("vllm" if torch.cpu._is_avx512_bf16_supported() else "stand-ins"), name
        if report["kernels"] == "stand-ins":  # the engine computed its experts on them, packed once at load:
            # w13 and w2 of each MoE layer (moves copy packed storage, nothing is packed again)
            assert report["calls"].get("fused_experts_cpu", 0) > 0, name
            assert report["calls"].get(packing) == 2 * TINY_QWEN3_MOE["num_hidden_layers"], name
    off, on = runs[f"{weights}_off"]["tokens"], runs[f"{weights}_on"]["tokens"]
    assert on == off
    assert len({t for seq in off for t in seq}) >= 20  # the experts decide real, varied tokens


@pytest.mark.parametrize(("weights", "reads"), [("online", FP8_READS), ("checkpoint", FP8_READS), ("int4", INT4_READS)])
def test_experts_move_with_what_their_kernel_reads_while_eplb_rearranges(runs, weights, reads):
    eplb = runs[f"{weights}_on"]["eplb"]
    assert eplb["rearrangements_committed"] >= 3 and eplb["placement_changes"] >= 1
    assert eplb["worker_error"] is None and eplb["rejected_placements"] == []
    for key, view in eplb["expert_views"].items():
        # each tensor the kernel reads is one that upstream moves, nothing derived
        assert view["kernel_reads"] == reads and set(reads.values()) <= set(view["moved"]), key
        assert view["derived"] == [], key
    for key, layer in eplb["layers"].items():
        assert layer["mapped_by"] == "graph_pass" and layer["host_calls"] > 0, key


def test_scales_upstream_would_leave_behind_are_found_and_moved_by_the_view(runs):
    """Upstream moves what ``get_expert_weights`` lists; with the scales left out of it (a method
    whose kernel state is no parameter), the view finds them among the kernel's inputs and adds
    them to upstream's move lists: the tokens stay those of EPLB off."""
    run = runs["checkpoint_on_scales_hidden"]
    assert run["tokens"] == runs["checkpoint_off"]["tokens"]
    assert run["eplb"]["placement_changes"] >= 1
    for key, view in run["eplb"]["expert_views"].items():
        assert view["moved"] == ["w13_weight", "w2_weight"] and view["derived"] == ["w1_scale", "w2_scale"], key
    # the control: the same run with the view's additions left out of upstream's lists
    control = runs["checkpoint_on_scales_left_behind"]
    assert control["eplb"]["placement_changes"] >= 1 and control["tokens"] != runs["checkpoint_off"]["tokens"]


def test_zero_recompiles_after_warm_up_when_quantized(runs):
    for name in {**RUNS, **RESTARTS}:
        assert runs[name]["recompiles_after_warm_up"] == 0, name
        assert runs[name]["pass_runs_after_warm_up"] == 0, name
        if runs[name]["eplb"] is not None:  # the worker's own count (compile_watch.py)
            assert runs[name]["eplb"]["graphs_compiled_while_serving"] == 0, name


@pytest.mark.parametrize(("weights", "experts"), [("checkpoint", "CPUExpertsFp8"), ("int4", "CPUExpertsInt4")])
def test_two_tp_workers_move_quantized_experts_between_them(runs, weights, experts):
    run, static = runs[f"{weights}_tp2_on"], runs[STATIC_TWINS[weights]]
    assert all(w["after"]["rearrangements_committed"] == 0 for w in static["workers"])
    assert run["tokens"] == static["tokens"]  # the experts moved, the tokens did not change
    assert run["tokens"][0][:8] == runs[f"{weights}_off"]["tokens"][0][:8]  # and they are the model's
    workers = run["workers"]
    assert sorted(w["after"]["ep_rank"] for w in workers) == [0, 1]
    for worker in workers:
        after = worker["after"]
        assert after["rearrangements_committed"] >= 3 and after["bytes_sent"] > 0 and after["bytes_received"] > 0
        assert after["graphs_compiled_while_serving"] == 0 and after["worker_error"] is None
    assert sum(w["after"]["bytes_sent"] for w in workers) == sum(w["after"]["bytes_received"] for w in workers)
    check_slots_hold_committed_experts(workers)  # scales and zero points are in each slot's digest
    assert len(run["active_lines"]) == 2 and all(f"each layer's {experts} compute this rank's (token, k) pairs only"
                                                 in line for line in run["active_lines"])


def test_a_restarted_quantized_engine_starts_from_the_kept_placement_scales_and_zero_points_with_it(runs):
    kept, restored = runs["kept_placement"], runs["int4_tp2_restored"]
    assert kept["identity"]["quantization"] == "compressed-tensors"
    assert kept["physical_to_logical"] == placements_of(runs["int4_tp2_on"]["workers"][0]["after"])
    expert_digest = expert_digests(runs["int4_tp2_on"]["workers"])  # packed weights, scales, zero points
    for worker in restored["workers"]:
        before, after = worker["before"], worker["after"]
        assert before["placements_restored"] == 1 and placements_of(before) == kept["physical_to_logical"]
        assert slots_hold(before, expert_digest) and slots_hold(after, expert_digest)
        assert after["rearrangements_committed"] == 0 and placements_of(after) == kept["physical_to_logical"]
    assert restored["tokens"] == runs["int4_tp2_on"]["tokens"]
    assert runs["placement_after_restart"] == kept  # nothing moved since the restore: the file is not rewritten


def test_an_engine_that_never_rearranged_writes_its_placement_at_shutdown(runs):
    """No rearrangement committed, and no file at its start, so only the runner's shutdown can
    have written it."""
    static = runs["static_placement"]
    assert static["rearrangements"] == 0 and static["load_window"] is None
    assert static["identity"]["quantization"] == "fp8" and static["identity"]["ep_size"] == 2
    assert static["physical_to_logical"] == placements_of(runs["checkpoint_tp2_static"]["workers"][0]["after"])
