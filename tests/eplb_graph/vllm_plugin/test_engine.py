"""vLLM's own engine (CPU build 0.32.0) with the plugin installed, end to end.

One process, compiled (vLLM's CPU Inductor path) and eager, EPLB on and off, a tiny
random-weight Qwen3-MoE with 8 experts, top-2, 4 redundant slots, window 4, interval 8; and
expert parallel over two worker processes: TP=2 (compiled and eager) and DP=2 (vLLM's offline
data parallel, one process per rank, compiled), where experts move between the workers and each
rank computes only the pairs routed to its own slots. Every multi-process run is compared with
a one-process EPLB-off run: compiled TP=2 in float32 token for token, eager TP=2 and DP=2 in
bfloat16 within its rounding (log-probabilities, and greedy tokens up to a near tie). The compiled TP=2 run keeps its placement in a file
(``EPLB_GRAPH_PLACEMENT_FILE``), and once it has ended, the same engine restarts from it; one
process (another EP size) is refused by the config gate, and a TP=2 engine with other slot counts
by its workers. vLLM's default layout, the engine core in a process of its own where the plugin loads
again, is what the OpenAI server runs (test_server.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.eplb_graph.vllm_plugin.engine_server import EngineServer
from tests.eplb_graph.vllm_plugin.test_server import NO_CACHES, repo_on_pythonpath

pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast

pytest.importorskip("vllm")

RUN_TIMEOUT_S = 600
RUNS = {
    "compiled_off": ["--eplb", "off", "--mode", "compiled"],
    "compiled_on": ["--eplb", "on", "--mode", "compiled"],
    # the eager runs and DP=2 in bfloat16: expert parallel's bf16 path against one process's
    "eager_off": ["--eplb", "off", "--mode", "eager", "--dtype", "bfloat16", "--logprobs"],
    "eager_on": ["--eplb", "on", "--mode", "eager", "--dtype", "bfloat16"],
    "tp2_compiled_on": ["--eplb", "on", "--mode", "compiled", "--tp", "2", "--placement-file", "{placement}"],
    "tp2_eager_on": ["--eplb", "on", "--mode", "eager", "--tp", "2", "--dtype", "bfloat16", "--logprobs"],
    # the two ranks of one DP=2 engine start together, their port chosen then (run_two_at_a_time)
    "dp2_rank0": ["--eplb", "on", "--mode", "compiled", "--dp", "0", "2", "{port}", "--dtype", "bfloat16", "--logprobs"],
    "dp2_rank1": ["--eplb", "on", "--mode", "compiled", "--dp", "1", "2", "{port}", "--dtype", "bfloat16", "--logprobs"],
}
# started once tp2_compiled_on has ended, from the placement it kept
RESTARTS = {
    "tp2_compiled_restored": RUNS["tp2_compiled_on"],
    # another EP size: refused by the config gate; other slot counts, which the built model owns: by the workers
    "other_ep_size": ["--eplb", "on", "--mode", "compiled", "--placement-file", "{placement}"],
    "tp2_other_layout": ["--eplb", "on", "--mode", "compiled", "--tp", "2", "--redundant", "2",
                         "--placement-file", "{placement}"],
}
REFUSED = {"other_ep_size", "tp2_other_layout"}  # the engine must fail to start
MULTI_PROCESS = {"tp2_compiled": ["tp2_compiled_on"], "tp2_eager": ["tp2_eager_on"], "dp2": ["dp2_rank0", "dp2_rank1"]}
INITIAL_PLACEMENT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # upstream's: logical ids, then round-robin


def engine_environment() -> dict[str, str]:
    # No compile caches: a cache hit serves the graph our pass built earlier without running
    # the pass again (correct, and caught by the runtime check), but here the pass must run.
    return {**os.environ, **NO_CACHES, "VLLM_CPU_KVCACHE_SPACE": "1", **repo_on_pythonpath()}


def result_of(returncode: int, output: str, name: str, refused: set[str] = frozenset()) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("ENGINE_RUN_RESULT ")]
    workers_started = output.count("Starting to load model")  # what each worker logs first
    if name in refused:
        return {"returncode": returncode, "output": output, "served": bool(lines), "workers_started": workers_started}
    assert returncode == 0 and lines, f"{name} failed:\n{output[-6000:]}"
    # upstream's own log line, from whichever process ran the worker
    return {**json.loads(lines[-1].split(" ", 1)[1]), "upstream_rearrangements_logged": output.count(
        "Rearranging experts (async mode) ..."),
        "active_lines": [line for line in output.splitlines() if "eplb-graph active on" in line],
        "workers_started": workers_started}


def run_two_at_a_time(runs: dict[str, list[str]], workdir: Path, refused: set[str] = frozenset(),
                      after: dict[str, str] | None = None,
                      when_done: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Two engines at a time, one per core of these machines, the next started as soon as one ends
    (a run named in ``after`` once the run it names, earlier in ``runs``, has ended; ``when_done``
    is called with each name as it ends, before what waits on it starts); the ranks of one DP
    engine together, alone, last. Every engine is a process of its own, forked from one that
    imported vLLM once (engine_server.py)."""
    after, runs = after or {}, dict(runs)  # the DP ranks' port is filled in here
    results, futures = {}, {}
    server = EngineServer(engine_environment(), workdir)

    def run(name: str) -> None:
        if name in after:
            futures[after[name]].result()  # submitted earlier: running or done (the pool is first in, first out)
        results[name] = result_of(*server.run(name, runs[name], RUN_TIMEOUT_S), name, refused)
        if when_done is not None:
            when_done(name)

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            for name in runs:
                if name not in MULTI_PROCESS["dp2"]:
                    assert name not in after or after[name] in futures, f"{name} waits on a later run"
                    futures[name] = pool.submit(run, name)
        for future in futures.values():
            future.result()  # the first failure, named
        # the DP master port chosen as the ranks start: one chosen at the fixture's start may be
        # taken by another process in the minutes before
        from eplb_reference.runtime.launch import free_port

        runs.update(filled({name: runs[name] for name in MULTI_PROCESS["dp2"] if name in runs}, port=str(free_port())))
        with ThreadPoolExecutor(max_workers=2) as pool:
            for future in [pool.submit(run, name) for name in MULTI_PROCESS["dp2"] if name in runs]:
                future.result()
    finally:
        server.close()
    return results


def filled(runs: dict[str, list[str]], **values: str) -> dict[str, list[str]]:
    """Each run's arguments with its ``{name}`` placeholders filled in."""
    fill = {f"{{{name}}}": value for name, value in values.items()}
    return {name: [fill.get(arg, arg) for arg in args] for name, args in runs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    workdir = tmp_path_factory.mktemp("engine")
    placement = workdir / "placement.json"
    kept = {}

    def keep(name: str) -> None:
        if name == "tp2_compiled_on":  # what it left at its end, before a restart rewrites it
            kept["kept_placement"] = json.loads(placement.read_text())

    results = run_two_at_a_time(filled({**RUNS, **RESTARTS}, placement=str(placement)),
                                workdir, REFUSED, dict.fromkeys(RESTARTS, "tp2_compiled_on"), keep)
    return {**results, **kept, "placement_after_restart": json.loads(placement.read_text())}


def test_greedy_tokens_are_identical_with_eplb_on_and_off(runs):
    off, on = runs["compiled_off"]["tokens"], runs["compiled_on"]["tokens"]
    assert on == off
    assert len({t for seq in off for t in seq}) >= 20  # the experts decide real, varied tokens


def test_compiled_eplb_rearranges_during_generation_with_the_graph_pass(runs):
    eplb = runs["compiled_on"]["eplb"]
    assert runs["compiled_on"]["enable_eplb"] and eplb["built_upstream_state"]
    assert eplb["rearrangements_committed"] >= 3
    # upstream's own log: every rearrangement committed is one it started
    assert runs["compiled_on"]["upstream_rearrangements_logged"] >= eplb["rearrangements_committed"]
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


@pytest.mark.parametrize("name", ["compiled_on", "tp2_compiled_on"])
def test_an_offline_llm_reads_each_workers_eplb_metrics(runs, name):
    """``metrics.worker_metrics(llm)``: the values the server's /metrics serves, equal to what each worker counted."""
    run = runs[name]
    metrics = {snapshot["labels"]["ep_rank"]: snapshot for snapshot in run["metrics"]}
    workers = {str(worker["after"]["ep_rank"]): worker["after"] for worker in run["workers"]}
    assert sorted(metrics) == sorted(workers) and len(workers) == (2 if name.startswith("tp2") else 1)
    for rank, worker in workers.items():
        counters = metrics[rank]["counters"]
        assert counters["rearrangements_finished"] == worker["rearrangements_committed"] >= 1
        assert counters["rearrangements_started"] >= counters["rearrangements_finished"]
        assert counters["layers_committed"] == worker["layers_committed"]
        assert counters["expert_bytes_sent"] == worker["bytes_sent"]
        assert counters["expert_bytes_received"] == worker["bytes_received"]
        assert counters["graphs_compiled_while_serving"] == 0 and metrics[rank]["gauges"]["async_worker_alive"] == {"": 1.0}
    assert 0 < metrics["0"]["gauges"]["balancedness_committed"]["all"] <= 1


def test_eager_mode_routes_through_the_router_hook(runs):
    on, off = runs["eager_on"], runs["eager_off"]
    assert on["tokens"] == off["tokens"]
    assert on["eplb"]["rearrangements_committed"] >= 3 and on["eplb"]["placement_changes"] >= 1
    for key, layer in on["eplb"]["layers"].items():
        assert layer["mapped_by"] == "router_hook", key
        assert layer["graph_mappings"] == 0 and layer["host_calls"] > 0, key


def workers_of(runs, layout: str) -> list[dict]:
    """Every worker of a multi-process run: {"before": summary after start, "after": after generation}."""
    return [worker for name in MULTI_PROCESS[layout] for worker in runs[name]["workers"]]


def test_expert_parallel_in_float32_gives_the_tokens_of_one_process_without_eplb(runs):
    assert runs["tp2_compiled_on"]["tokens"] == runs["compiled_off"]["tokens"]
    workers = workers_of(runs, "tp2_compiled")
    assert sorted(w["after"]["ep_rank"] for w in workers) == [0, 1] and {w["after"]["ep_size"] for w in workers} == {2}


# bfloat16 keeps 8 bits of mantissa (logits of magnitude 4 to 8 lie 1/32 to 1/16 apart), and each
# rank rounds its own expert rows before the ranks' sum where one process rounds once: a token's
# log-probability may move by a few such steps, and two tokens closer than twice that may swap
BF16_LOGPROB_TOLERANCE = 0.3


def agreeing_steps(reference: dict, got: dict, tolerance: float) -> int:
    """Checks ``got`` against ``reference``, sequence by sequence: greedy tokens equal up to, at
    most, a step where the reference's best two log-probabilities lie within twice ``tolerance``
    (each may move by it: a near tie rounding may flip; the tokens after it follow another
    context), the chosen token's log-probability within ``tolerance`` at every equal step.
    Returns the steps compared."""
    compared = 0
    for ref_tokens, got_tokens, ref_steps, got_steps in zip(reference["tokens"], got["tokens"], reference["logprobs"],
                                                            got["logprobs"]):
        assert len(ref_tokens) == len(got_tokens)
        for step, (expected, token) in enumerate(zip(ref_tokens, got_tokens)):
            chosen, runner_up = ref_steps[step]
            if token != expected:
                assert chosen - runner_up <= 2 * tolerance, f"step {step}: {token} for {expected}, no near tie"
                break
            assert abs(got_steps[step][0] - chosen) <= tolerance, (step, got_steps[step][0], chosen)
            compared += 1
    return compared


@pytest.mark.parametrize("layout", ["tp2_eager", "dp2"])
def test_expert_parallel_in_bfloat16_agrees_with_one_process_within_rounding(runs, layout):
    reference = runs["eager_off"]
    if layout == "dp2":  # each DP rank served every second prompt
        got = {key: [None] * len(reference[key]) for key in ("tokens", "logprobs")}
        for rank in (0, 1):
            for key in got:
                got[key][rank::2] = runs[f"dp2_rank{rank}"][key]
    else:
        got = runs["tp2_eager_on"]
    steps = sum(len(tokens) for tokens in reference["tokens"])
    assert agreeing_steps(reference, got, BF16_LOGPROB_TOLERANCE) >= steps // 2  # most tokens compared
    workers = workers_of(runs, layout)
    assert sorted(w["after"]["ep_rank"] for w in workers) == [0, 1] and {w["after"]["ep_size"] for w in workers} == {2}


def test_the_bfloat16_comparison_fails_on_a_real_difference():
    reference = {"tokens": [[5, 6, 7]], "logprobs": [[[-0.1, -3.0], [-0.2, -2.5], [-0.3, -0.45]]]}
    assert agreeing_steps(reference, {"tokens": [[5, 6, 9]], "logprobs": [[[-0.12, -3], [-0.25, -2], [-1, -2]]]},
                          0.1) == 2  # a flip at a near tie ends the comparison
    with pytest.raises(AssertionError, match="no near tie"):
        agreeing_steps(reference, {"tokens": [[5, 8, 7]], "logprobs": [[[-0.1, -3], [-1, -2], [-1, -2]]]}, 0.1)
    with pytest.raises(AssertionError):  # the same tokens, a log-probability off by more than rounding
        agreeing_steps(reference, {"tokens": [[5, 6, 7]], "logprobs": [[[-0.5, -3], [-0.2, -2], [-0.3, -2]]]}, 0.1)


@pytest.mark.parametrize("layout", list(MULTI_PROCESS))
def test_experts_move_between_the_workers(runs, layout):
    workers = [w["after"] for w in workers_of(runs, layout)]
    for worker in workers:
        assert worker["rearrangements_committed"] >= 3 and worker["worker_error"] is None
        assert worker["bytes_sent"] > 0 and worker["bytes_received"] > 0  # through GlooStagedCommunicator
    assert sum(w["bytes_sent"] for w in workers) == sum(w["bytes_received"] for w in workers)


def expert_digests(workers: list[dict], num_experts: int = 8) -> dict[str, dict[int, str]]:
    """Digests of each slot's expert bytes at start (upstream's initial placement, which puts every
    logical expert on some rank) name each expert: {layer: {logical expert: digest}}."""
    expert_digest: dict[str, dict[int, str]] = {}
    for worker in workers:
        before = worker["before"]
        assert before["rearrangements_committed"] == 0
        local = len(next(iter(before["slot_digests"].values())))
        for key, digests in before["slot_digests"].items():
            placement = before["layers"][key]["placement"]
            for slot, digest in enumerate(digests):
                expert = placement[before["ep_rank"] * local + slot]
                assert expert_digest.setdefault(key, {}).setdefault(expert, digest) == digest, (key, expert)
    assert all(len(set(experts.values())) == num_experts for experts in expert_digest.values())  # distinct bytes
    return expert_digest


def slots_hold(summary: dict, expert_digest: dict[str, dict[int, str]]) -> bool:
    """Every local slot of one worker's summary holds the expert its placement names."""
    local = len(next(iter(summary["slot_digests"].values())))
    mine = slice(summary["ep_rank"] * local, (summary["ep_rank"] + 1) * local)
    return all(digests == [expert_digest[key][expert] for expert in summary["layers"][key]["placement"][mine]]
               for key, digests in summary["slot_digests"].items())


def check_slots_hold_committed_experts(workers: list[dict], num_experts: int = 8) -> None:
    """After generation every slot of every rank holds the expert the committed placement names,
    and some rank's slots hold other experts than at start."""
    expert_digest = expert_digests(workers, num_experts)
    moved = 0
    for worker in workers:
        after = worker["after"]
        assert slots_hold(after, expert_digest)
        local = len(next(iter(after["slot_digests"].values())))
        mine = slice(after["ep_rank"] * local, (after["ep_rank"] + 1) * local)
        moved += sum(after["layers"][key]["placement"][mine] != worker["before"]["layers"][key]["placement"][mine]
                     for key in after["layers"])
    assert moved >= 1


@pytest.mark.parametrize("layout", list(MULTI_PROCESS))
def test_every_slot_holds_the_expert_its_committed_placement_names(runs, layout):
    check_slots_hold_committed_experts(workers_of(runs, layout))


@pytest.mark.parametrize("layout", list(MULTI_PROCESS))
def test_each_rank_computes_only_the_pairs_routed_to_its_slots(runs, layout):
    """Both ranks see every (token, k) pair of a batch (TP: replicated tokens; DP: gathered ones);
    each computes only its own, and together they compute each pair exactly once."""
    workers = [w["after"] for w in workers_of(runs, layout)]
    for worker in workers:  # every MoE layer of each rank is bound, so the loop below checks each
        assert set(worker["local_pairs_computed"]) == set(worker["layers"]) != set(), worker["layers"]
    for key in workers[0]["local_pairs_computed"]:
        seen = {w["pairs_seen"][key] for w in workers}
        assert len(seen) == 1, key
        computed = [w["local_pairs_computed"][key] for w in workers]
        assert sum(computed) == seen.pop() and min(computed) > 0, key


@pytest.mark.parametrize("layout", list(MULTI_PROCESS))
def test_no_model_graph_is_compiled_while_the_workers_serve(runs, layout):
    for name in MULTI_PROCESS[layout]:
        # eager: no model graph (vLLM's own small compiled helpers may still compile); DP=2 asks for
        # log-probabilities, whose rank helper vLLM's sampler compiles at the first request: the
        # model's graphs are counted by the pass's mappings and the compile watch below
        if layout == "tp2_compiled":
            assert runs[name]["recompiles_after_warm_up"] == 0, name
        assert runs[name]["pass_runs_after_warm_up"] == 0, name
        for worker in runs[name]["workers"]:
            expected = None if layout == "tp2_eager" else 0  # eager: nothing the pass maps, nothing to watch
            assert worker["after"]["graphs_compiled_while_serving"] == expected, name
            mechanism = "router_hook" if layout == "tp2_eager" else "graph_pass"
            assert set(worker["after"]["mapping"].values()) == {mechanism}, name


@pytest.mark.parametrize("layout", list(MULTI_PROCESS))
def test_each_worker_names_what_it_adapts_in_its_active_line(runs, layout):
    lines = [line for name in MULTI_PROCESS[layout] for line in runs[name]["active_lines"]]
    assert len(lines) == 2, lines
    for line in lines:
        assert "expert parallel rank" in line and "of 2: each layer's CPUUnquantizedExperts compute this rank's " \
               "(token, k) pairs only (eplb_graph::local_expert_pairs)" in line
        assert ("DP tokens dispatched over 2 ranks by eplb_graph::ep_all_gatherv / ep_reduce_scatterv" in line) == \
               (layout == "dp2")


def placements_of(summary: dict) -> list[list[int]]:
    return [layer["placement"] for layer in summary["layers"].values()]  # upstream's layer order


def test_a_rearranging_engine_keeps_its_committed_placement_in_the_file(runs):
    kept, saving = runs["kept_placement"], runs["tp2_compiled_on"]["workers"]
    assert kept["format"] == "eplb-graph placement" and kept["written_by"] == "vllm"
    assert kept["identity"]["architecture"] == "Qwen3MoeForCausalLM" and kept["identity"]["ep_size"] == 2
    assert kept["identity"]["num_physical_experts"] == 12 and kept["identity"]["quantization"] == "none"
    assert kept["physical_to_logical"] == placements_of(saving[0]["after"])  # the last committed, at shutdown
    assert kept["rearrangements"] == saving[0]["after"]["rearrangements_committed"] >= 3
    assert kept["physical_to_logical"] != [INITIAL_PLACEMENT] * 2


def test_a_restarted_engine_serves_from_the_kept_placement_with_every_slot_holding_its_expert(runs):
    kept, restored = runs["kept_placement"], runs["tp2_compiled_restored"]
    expert_digest = expert_digests(runs["tp2_compiled_on"]["workers"])  # the first run's experts at start
    for worker in restored["workers"]:
        before = worker["before"]  # after start, before any request: the first forward already routes by it
        assert before["placements_restored"] == 1 and before["rearrangements_committed"] == 0
        assert placements_of(before) == kept["physical_to_logical"]
        assert slots_hold(before, expert_digest)
        assert worker["after"]["worker_error"] is None and slots_hold(worker["after"], expert_digest)
    assert restored["tokens"] == runs["compiled_off"]["tokens"]
    assert restored["recompiles_after_warm_up"] == 0
    after = runs["placement_after_restart"]  # kept current by the restarted engine too
    assert after["rearrangements"] == kept["rearrangements"] + restored["eplb"]["rearrangements_committed"]


def test_an_engine_of_another_layout_refuses_the_file_at_start_by_name(runs):
    """Another EP size: by the config gate, before any worker starts. Other slot counts, which
    only the built model knows: by every worker, before anything moves."""
    assert runs["tp2_compiled_restored"]["workers_started"] == 2  # the counts below are of real log lines
    refused = runs["other_ep_size"]
    assert refused["returncode"] != 0 and not refused["served"] and refused["workers_started"] == 0
    assert "eplb-graph cannot serve this EPLB request:\n  placement file" in refused["output"]
    assert "ep_size is 2 in the file, 1 here" in refused["output"]
    refused = runs["tp2_other_layout"]
    assert refused["returncode"] != 0 and not refused["served"] and refused["workers_started"] == 2
    # the error both ranks agreed on (EP rank 0 read the file; every rank raises it, though vLLM
    # may stop the second worker before it logs: tests/eplb_reference/runtime/test_controller.py holds each rank to it)
    assert ("PlacementFileError: EP rank 0: placement file" in refused["output"]
            and "does not fit this model and layout: num_physical_experts is 12 in the file, 10 here" in refused["output"])
