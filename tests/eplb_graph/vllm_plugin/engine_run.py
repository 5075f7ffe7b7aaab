"""One vLLM engine run with the plugin installed; prints one JSON line (run as a script).

Used by test_engine.py: each engine start gets its own process (vLLM keeps global state), forked
by engine_server.py from one that imported vLLM once; run as a script it works alone too.
The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the worker's EPLB
state can be read directly after generation (vLLM's default separate engine-core process is the
OpenAI server's: test_server.py).

``--weights`` picks the checkpoint: float32 (the default), online FP8 from a bf16 checkpoint
(``quantization="fp8_per_block"``, the routed experts only), a pre-quantized block-FP8
checkpoint or an int4 (compressed-tensors pack-quantized) one; the quantized runs use bfloat16
activations and at most ``EXACT_TOKENS_PER_EXPERT`` tokens per step, under which vLLM's CPU
kernels give every token the same row in any batch (cpu_quantized_experts.py).
``--hide-scales-from-upstream`` drops the FP8 scales from what upstream's EPLB collects to move,
as a quant method whose kernel state is no parameter would: the plugin's view must find them and
move them itself (``--no-derived-moves``: the control, where it does not)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from tests.eplb_graph.vllm_plugin.cpu_quantized_experts import (
    EXACT_TOKENS_PER_EXPERT,
    LIFT_ENV,
    kernels_report,
    lift_if_asked,
)

lift_if_asked()  # at import: the workers vLLM spawns (TP=2) import this script too

# the routed experts only: vLLM's CPU FP8 linear kernels are a separate matter
FP8_ONLINE_IGNORE = ["*mlp.gate", "*self_attn.*"]
CHECKPOINTS = {  # --weights -> the checkpoint writer (tiny_checkpoint's)
    "fp8-online": "write_tiny_qwen3_moe_checkpoint",
    "fp8-checkpoint": "write_tiny_qwen3_moe_fp8_checkpoint",
    "int4-checkpoint": "write_tiny_qwen3_moe_int4_checkpoint",
}

def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--eplb", choices=["on", "off"], required=True)
    parser.add_argument("--mode", choices=["compiled", "eager"], default="compiled")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--interval", type=int, default=8)
    parser.add_argument("--redundant", type=int, default=4)
    parser.add_argument("--weights", choices=["float32", *CHECKPOINTS], default="float32")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="of an unquantized checkpoint's run (a quantized one runs bfloat16 activations)")
    parser.add_argument("--logprobs", action="store_true",
                        help="keep each token's log-probability and its runner-up's (vLLM's sampler then compiles "
                             "its rank helper at the first request: a graph that is not the model's)")
    parser.add_argument("--hide-scales-from-upstream", action="store_true")
    parser.add_argument("--no-derived-moves", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (expert parallel over as many workers)")
    parser.add_argument("--placement-file", help="EPLB_GRAPH_PLACEMENT_FILE: start from it where it exists, keep it current")
    parser.add_argument("--dp", nargs=3, type=int, metavar=("RANK", "SIZE", "PORT"),
                        help="one rank of vLLM's offline data parallel (one process per rank): its share of the prompts")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of worker_state, a function
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(core) for core in range(args.tp)))
    if args.dp:  # vLLM's offline data parallel: ranks from the environment
        rank, size, port = args.dp
        os.environ.update(VLLM_DP_RANK=str(rank), VLLM_DP_RANK_LOCAL=str(rank), VLLM_DP_SIZE=str(size),
                          VLLM_DP_MASTER_IP="127.0.0.1", VLLM_DP_MASTER_PORT=str(port))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(core) for core in range(size)))
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.placement_file:  # vLLM's processes (the TP workers) inherit it
        os.environ["EPLB_GRAPH_PLACEMENT_FILE"] = args.placement_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eplb_graph.vllm_plugin.metrics import worker_metrics

    from eplb_reference.models import tiny_checkpoint

    quantized = args.weights != "float32"
    if quantized:
        os.environ[LIFT_ENV] = "1"
        lift_if_asked()
    if args.hide_scales_from_upstream:
        hide_scales_from_upstream()
    if args.no_derived_moves:
        from eplb_graph.vllm_plugin import worker

        worker.complete_move_list = lambda views, model_state: None
    write = getattr(tiny_checkpoint, CHECKPOINTS.get(args.weights, "write_tiny_qwen3_moe_checkpoint"))
    model_dir = write(tempfile.mkdtemp(prefix="eplb-graph-qwen3moe-"))
    kwargs = dict(
        model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16" if quantized else args.dtype,
        max_model_len=128, max_num_seqs=args.prompts, seed=0, enforce_eager=args.mode == "eager",
        tensor_parallel_size=args.tp,
    )
    if quantized:
        kwargs.update(max_num_batched_tokens=EXACT_TOKENS_PER_EXPERT)
    if args.weights == "fp8-online":
        kwargs.update(quantization="fp8_per_block", quantization_config={"ignore": FP8_ONLINE_IGNORE})
    if args.eplb == "on":
        kwargs.update(
            enable_expert_parallel=True, enable_eplb=True,
            eplb_config={"window_size": args.window, "step_interval": args.interval,
                         "num_redundant_experts": args.redundant, "use_async": True},
        )
    llm = LLM(**kwargs)
    prompts = [TokensPrompt(prompt_token_ids=[5 + i, 17 * i % 500 + 3, 40 + 3 * i, 7]) for i in range(args.prompts)]
    if args.dp:
        prompts = prompts[args.dp[0] :: args.dp[1]]
    sampling = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True,
                              logprobs=2 if args.logprobs else None)
    before = llm.collective_rpc(worker_state)  # every worker, in this process or its own (--tp)
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    after = llm.collective_rpc(worker_state, kwargs={"digests": args.eplb == "on"})
    first = after[0]
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        # per generated token: the log-probability of the (greedy) chosen token and of the runner-up
        "logprobs": [chosen_and_runner_up(o.outputs[0]) for o in outputs] if args.logprobs else None,
        "quantized_kernels": first["quantized_kernels"] if quantized else None,
        "enable_eplb": first["enable_eplb"],
        # Dynamo graphs compiled during generation, and graphs our pass rewrote during it, over the workers
        "recompiles_after_warm_up": sum(a["dynamo_graphs"] - b["dynamo_graphs"] for a, b in zip(after, before)),
        "pass_runs_after_warm_up": sum(a["graph_mappings"] - b["graph_mappings"] for a, b in zip(after, before)),
        "dynamo_graphs": first["dynamo_graphs"],
        "eplb": first["eplb"],
        # per worker: its EPLB summary before generation (slot digests at load) and after it
        "workers": [{"before": b["eplb"], "after": a["eplb"]} for b, a in zip(before, after)],
        "pass_installed": type(llm.llm_engine.vllm_config.compilation_config.inductor_compile_config.get(
            "post_grad_custom_post_pass")).__name__,
        "metrics": worker_metrics(llm),  # the documented accessor of an offline LLM's EPLB metrics
    }
    print("ENGINE_RUN_RESULT " + json.dumps(result), flush=True)
    return 0


def chosen_and_runner_up(completion) -> list[list[float]]:
    """[chosen, runner-up] log-probabilities of each generated token (``logprobs=2``: the top two)."""
    steps = []
    for token, top in zip(completion.token_ids, completion.logprobs):
        others = [entry.logprob for other, entry in top.items() if other != token]
        steps.append([top[token].logprob, max(others)])
    return steps


def worker_state(worker, digests: bool = True) -> dict:
    """One worker's EPLB state (run in the worker by ``collective_rpc``)."""
    from torch._dynamo.utils import counters

    runner = worker.model_runner
    eplb = getattr(runner, "eplb_graph", None)
    summary = None
    if eplb is not None:
        summary = {**eplb.summary(), "mapping": eplb.verify_mapping(require_calls=True)}
        if digests:
            summary["slot_digests"] = eplb.slot_digests()
    return {
        "eplb": summary,
        "enable_eplb": runner.parallel_config.enable_eplb,
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "graph_mappings": sum(layer.graph_mappings for layer in eplb.layers) if eplb else 0,
        "quantized_kernels": kernels_report() if os.environ.get(LIFT_ENV) == "1" else None,
    }


def hide_scales_from_upstream() -> None:
    """Upstream collects what it moves from ``get_expert_weights``: leave the scales out of it."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    from eplb_graph.movement.weight_views import shares_storage

    collect = RoutedExperts.get_expert_weights

    def without_scales(self):
        scales = [p for name, p in self.named_parameters() if "scale" in name]
        return [w for w in collect(self) if not any(shares_storage(w, s) for s in scales)]

    RoutedExperts.get_expert_weights = without_scales


if __name__ == "__main__":
    sys.exit(main())
