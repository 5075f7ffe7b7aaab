"""The support matrix: every transformers MoE family through graph-mode EPLB (markdown + JSON out).

Each family of the installed transformers whose experts use ``use_experts_implementation``
is built tiny in code and run by ``eplb_reference.models.hf_check.check_family`` in its own
process (a family that crashes or hangs costs its row, not the run): enable -> compile
(aot_eager and Inductor, fullgraph) -> outputs against the logical model -> skewed load ->
rearrange -> the same graph, no recompile.

    python benchmarks/support_matrix.py --out docs/support-matrix.md --json out/support_matrix.json
    python benchmarks/support_matrix.py --families qwen3_moe,mixtral --backends aot_eager
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROW_MARK = "MATRIX_ROW "
STATUSES = ("works", "refused", "cannot-build", "failed")

# The vLLM plugin's quantizations (eplb_graph/vllm_plugin/expert_views.py: VIEWED_MOE_METHODS);
# what moves is what the engine tests see (tests/eplb_graph/vllm_plugin/test_engine_quantized.py).
QUANTIZATION_NOTES = """\
## Quantized checkpoints in the vLLM plugin

With `enable_eplb=True` the plugin accepts the quantizations whose MoE kernel reads storage an
expert-weight view proves upstream moves (`eplb_graph/vllm_plugin/expert_views.py`, checked per
layer at start); any other is refused by name at start, a quantization named in the arguments or
found in the checkpoint alike: by the config gate, or, within a family such as compressed-tensors,
when the layer is built (upstream's `supports_eplb`) or bound (the view), before serving.

| quantization | vLLM builds | moves with each expert (vLLM's CPU backend) | on vLLM's CPU engine here |
| --- | --- | --- | --- |
| none | `UnquantizedFusedMoEMethod` | `w13_weight`, `w2_weight` | tested |
| `fp8` (pre-quantized checkpoint: `quant_method: fp8`) | `Fp8MoEMethod` | VNNI-packed `w13_weight`, `w2_weight`, block scales `w13_weight_scale_inv`, `w2_weight_scale_inv` | tested with `[128, 128]` blocks (DeepSeek-V3's format), the only scheme vLLM 0.32's CPU FP8 experts take (`CPUExpertsFp8._supports_quant_scheme`) |
| `fp8_per_block` (online, from bf16) | `Fp8PerBlockOnlineMoEMethod` | as `fp8` | tested |
| `fp8_per_tensor`, `fp8_per_channel` (online), `fp8` on a checkpoint without FP8 weights (vLLM quantizes it online per tensor), any online MoE spec in `quantization_config` that builds these | `Fp8PerTensorOnlineMoEMethod`, `Fp8PtpcOnlineMoEMethod` | — | refused by name at start, judged by the MoE method vLLM's config builds (with `ignore` or `targets` patterns, which choose it by layer name: when each layer is bound, before serving): no view was bound to them, since vLLM 0.32's CPU build cannot load them, EPLB on or off (their FP8 quant ops have no kernel there: `_C::static_scaled_fp8_quant() -> ()`, `_C::dynamic_per_token_scaled_fp8_quant() -> ()`; `tests/eplb_graph/vllm_plugin/test_config_gate.py` shows `fp8` on a bf16 checkpoint failing to load with EPLB off) |
| `compressed-tensors` int4 (`pack-quantized`, W4A16 as declared) | `CompressedTensorsWNA16MoEMethod` on the CPU backend, run as W4A8 (int8 activations) | blocked int4 `w13_weight_packed`, `w2_weight_packed`, scales, the zero points created at load, `weight_shape` | tested (group 128); upstream refuses EPLB for the method, the plugin serves it on the CPU backend (`quant_methods.py`) |

Not served: compressed-tensors W4A8-int8 (`CompressedTensorsW4A8Int8MoEMethod`: its CPU kernel,
`dynamic_4bit_int_moe`, runs only on AArch64 and upstream refuses EPLB for it), and every other
MoE quant method (refused by name). vLLM 0.32 runs its FP8 and int4 CPU MoE experts only where
the CPU has AMX tiles; the tests admit them on AMX-less hosts (`tests/eplb_graph/vllm_plugin/cpu_quantized_experts.py`):
on vLLM's own kernels where the CPU has AVX-512 and AVX-512 BF16, and where vLLM's kernel
library has none (CPUs without AVX-512 BF16), on torch stand-ins registered under the kernels'
names (`tests/eplb_graph/vllm_plugin/cpu_kernel_stand_ins.py`). Their packing keeps each expert in its own
slab of dim 0 and their kernel reads exactly the slots routed to, so vLLM's loading, its packing
calls, its experts classes, its EPLB and our views all run, on the stand-ins' layouts; they do
not prove vLLM's C++ kernels, their packed layouts or their AMX path.
"""

PARALLEL_NOTES = """\
## Parallel layouts in the vLLM plugin

With `enable_eplb=True` on vLLM's CPU engine, expert parallel runs over the tensor- and
data-parallel workers (EP size = TP x DP). vLLM 0.32's CPU experts drop the expert map they are
given (a worker's kernel indexes its experts with global ids); the plugin binds each layer's
experts *instance* to `eplb_graph::local_expert_pairs`, which hands vLLM's own kernel only the
(token, k) pairs routed to that rank's slots: a pair routed elsewhere costs the rank nothing
(`eplb_graph/vllm_plugin/local_experts.py`). Under DP, vLLM's all-gather / reduce-scatter token
dispatch calls two collectives vLLM's CPU communicator lacks; the plugin gives the DP group's
communicator instance `eplb_graph::ep_all_gatherv` / `ep_reduce_scatterv` over its gloo group
(`eplb_graph/vllm_plugin/dp_dispatch.py`). Each worker's `eplb-graph active` line names both.

| layout | how it is launched | on vLLM's CPU engine here |
| --- | --- | --- |
| one worker (EP 1, redundant slots) | `LLM(...)`, `api_server` | tested: engine, server (unquantized, FP8, int4) |
| TP=2 + EP | `LLM(tensor_parallel_size=2, ...)`, `api_server --tensor-parallel-size 2`; needs `VLLM_CPU_OMP_THREADS_BIND` (`0\\|1`) | tested: engine compiled and eager (unquantized, FP8 block, int4: on vLLM's quantized kernels or, where its build lacks them, their stand-ins, see above), server; experts move between the workers |
| DP=2 + EP | `api_server --data-parallel-size 2` (one engine core per DP rank); offline, vLLM's SPMD launch (one `LLM` per rank with `VLLM_DP_RANK`, `VLLM_DP_SIZE`, `VLLM_DP_MASTER_PORT`): `LLM(data_parallel_size=2)` is refused by vLLM itself | tested: server, offline engine, compiled |
| more than 2 ranks | as above | not tested: these machines have 2 cores, one per worker |
| TP > 1 with DP > 1 | - | refused by name at start (vLLM dispatches MoE tokens sequence-parallel over the EP group there) |
| prefill context parallel | - | refused by name at start |
| elastic EP, DP 2 -> 3 -> 2 at TP=1 | `api_server --data-parallel-size 2 --data-parallel-backend ray --enable-elastic-ep --elastic-ep-max-dp-size N` on a Ray head declaring `eplb_graph_dp` (docs/quickstart-hf.md), `POST /scale_elastic_ep` | tested: server under traffic, every answer equal to EPLB off, experts moved to the new engine, the compiled graphs kept (0 compiled while serving) |
| elastic EP, DP 2 -> 4 -> 2 | as above | run by hand on this 2-core machine (scale-up 61 s, scale-down 7 s, EPLB on all four); not in `make test`: four engines beside the reference server do not fit its time |
| elastic EP starting or shrinking to DP=1, TP > 1, an `mp` DP backend, Ray's executor, a kept placement file, off CPU | - | refused by name at start; a resize outside 2..`--elastic-ep-max-dp-size` is answered 400 at once, the group untouched; new engines not started within `EPLB_GRAPH_ELASTIC_START_TIMEOUT_S` (600 s) fail the resize (500) and the group serves on, every later resize refused (vLLM cannot undo a prepared one: restart to resize) |
"""

ROUTER_NOTES = """\
## How each kind of router is handled

- **Plain top-k** (softmax or sigmoid scores, `torch.topk` over the experts): the pass maps
  the ids of that top-k; routing weights are left as the router computed them.
- **Bias-corrected scores** (`e_score_correction_bias`, DeepSeek-V3 style): the top-k runs
  over biased scores and the router then gathers the *unbiased* weights with the logical
  ids. The gather stays inside the router and keeps logical ids; only the ids' users outside
  the router (the experts) are rewired to physical ids.
- **Grouped top-k** (`n_group` / `topk_group`): the router first takes a top-k over expert
  groups, which is not an expert selection (its input is not `num_experts` wide); the pass
  lists those top-k and maps only the last top-k over the experts with the layer's k.
- **Shared experts**: dense MLPs every token runs; not routed, not moved, untouched.
- **Dense layers** (dense-first schedules, `mlp_layer_types`, `decoder_sparse_step`): no
  router, nothing bound; only layers with routed experts get tables.
- **Top-k in the MoE block** (Jamba: the router is a plain `nn.Linear`, the block runs the
  top-k): the block is the router path, and the experts module inside it is excluded from
  the router, so the experts still get physical ids.
- **Router at the decoder layer** (Gemma 4: `.router` and `.experts` are children of the
  decoder layer): the router module is the router path as usual.
- **Two routed-expert sets in one block** (ERNIE-4.5-VL: text and vision experts, each
  with its router): both are bound. With text-only input the block never calls the vision
  experts, so the compiled graph holds one mapped router of the two (*mapped 1/2*); the
  vision layer records no load and `rearrange()` keeps its placement. Input with images
  traces the vision path, whose router the pass then maps.
- **Refused at `enable()`**: a router whose selection is not a `torch.topk` over the
  experts (Phi-MoE's sparsemixer uses `max`), a top-k over `num_experts + 1` classes (a
  "no expert" class, ZAYA), hash routing by token id (DeepSeek-V4's first layers), and any
  experts implementation other than `grouped_mm` / `batched_mm`. Each is found before the
  model is touched (``eplb_graph/pytorch/router_probe.py`` runs the block once on a probe input and
  checks that the experts receive exactly the ids of the top-k the pass will map).
"""


def run_one(family: str, backends: tuple[str, ...]) -> int:
    from eplb_reference.models.hf_check import check_family

    print(ROW_MARK + json.dumps(check_family(family, backends).as_dict()), flush=True)
    return 0


def run_in_child(family: str, backends: tuple[str, ...], timeout_s: int) -> dict:
    command = [sys.executable, __file__, "--one", family, "--backends", ",".join(backends)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return {"family": family, "status": "failed", "reason": f"timed out after {timeout_s} s", "backends": []}
    rows = [line for line in done.stdout.splitlines() if line.startswith(ROW_MARK)]
    if done.returncode != 0 or not rows:
        tail = " ".join((done.stderr or done.stdout).split()[-60:])
        return {"family": family, "status": "failed", "reason": f"exit {done.returncode}: {tail}", "backends": []}
    return json.loads(rows[-1][len(ROW_MARK):])


def diff_cell(row: dict, backend: str) -> str:
    result = next((b for b in row["backends"] if b["backend"] == backend), None)
    if result is None or result["max_abs_diff"] is None:
        return ""
    return f"{max(result['max_abs_diff'], result['max_abs_diff_after'] or 0.0):.1e}"


def mapped_cell(row: dict) -> str:
    if not row["backends"]:
        return ""
    verified = all(b["verified"] for b in row["backends"])
    mapped = min(b["routers_mapped"] for b in row["backends"])
    return f"{mapped}/{row['moe_layers']}{' verified' if verified else ' NOT verified'}"


def markdown(rows: list[dict], backends: tuple[str, ...], versions: dict[str, str]) -> str:
    counts = {status: sum(1 for r in rows if r["status"] == status) for status in STATUSES}
    lines = [
        "# Support matrix: transformers MoE families under graph-mode EPLB",
        "",
        f"Made with transformers {versions['transformers']}, torch {versions['torch']}, on CPU, by "
        f"`python benchmarks/support_matrix.py` (each family built tiny in code, "
        f"`reference/eplb_reference/models/hf_families.py`; checked by `reference/eplb_reference/models/hf_check.py`).",
        "",
        f"{len(rows)} families checked of the {versions['families']} that use `use_experts_implementation`: " + ", ".join(f"{counts[s]} {s}" for s in STATUSES) + ".",
        "",
        "Per family: `enable(num_redundant_experts=4, ep_size=2)` -> `torch.compile(fullgraph=True)` with "
        f"{' and '.join(backends)} -> output against the logical model in eager -> the load of that forward "
        "(skewed tokens) -> `rearrange()` -> the same graph again with recompiles an error. *mapped* is routers "
        "mapped / MoE layers and the verifier's verdict; *max abs diff* the larger of the two forwards "
        "(the default `grouped_mm` runs different kernels eager and compiled).",
        "",
        f"| family | model built | router | experts | mapped | {' | '.join(f'max abs diff {b}' for b in backends)} | result |",
        "| --- " * (6 + len(backends)) + "|",
    ]
    for row in rows:
        reason = row["reason"].replace("|", "\\|")
        result = row["status"] if not reason else f"{row['status']}: {reason}"
        cells = [row["family"], f"`{row.get('model_class', '')}`" if row.get("model_class") else "", row.get("router", ""),
                 row.get("implementation", ""), mapped_cell(row), *(diff_cell(row, b) for b in backends), result]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + ROUTER_NOTES + "\n" + QUANTIZATION_NOTES + "\n" + PARALLEL_NOTES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="", help="comma-separated subset (default: every MoE family)")
    parser.add_argument("--backends", default="aot_eager,inductor")
    parser.add_argument("--out", default="docs/support-matrix.md")
    parser.add_argument("--json", default="out/support_matrix.json")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per family")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # child mode: one family, one JSON line
    args = parser.parse_args()
    backends = tuple(b for b in args.backends.split(",") if b)
    if args.one:
        return run_one(args.one, backends)

    import torch
    import transformers

    from eplb_reference.models.hf_families import moe_families

    known = moe_families()
    families = [f for f in args.families.split(",") if f] or list(known)
    unknown = sorted(set(families) - set(known))
    if unknown:
        parser.error(f"not MoE families of this transformers: {', '.join(unknown)}")
    rows = []
    for family in families:
        rows.append(run_in_child(family, backends, args.timeout))
        print(f"{family}: {rows[-1]['status']}", file=sys.stderr, flush=True)
    versions = {"transformers": transformers.__version__, "torch": torch.__version__, "families": len(known)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(markdown(rows, backends, versions))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"versions": versions, "backends": backends, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
