"""What a kept placement buys at a restart: balancedness over the first windows, cold start against
a start restored from the placement file the previous run kept, inside vLLM.

vLLM's engine at TP=2 + EP (one core per worker, compiled), on the worst-case skewed checkpoint of
``skewed_router.py`` (two hot experts that the initial placement puts, unreplicated, on rank 0).
Each round, two engines one after the other, each serving the same ``--requests`` prefill-heavy
requests with EPLB rearranging every ``--interval`` steps:

* **cold**: ``EPLB_GRAPH_PLACEMENT_FILE`` names a file that does not exist yet: serving starts from
  upstream's initial placement, and the run keeps its placement in the file as it rearranges;
* **restored**: the same setting, the file now there: the experts start where the cold run left them.

Balancedness is from upstream's own ``log_balancedness`` lines (each step's mean and max per-rank
load of the experts actually executed), summed over consecutive windows of ``--interval`` steps that
carried load. The restored start is balanced from its first window if that window's balancedness
matches the cold run's converged one (its last windows), well above the cold run's first. Each
round writes a fresh file; the rounds' spread is the noise the first-window figures read against.

    python benchmarks/bench_kept_placement.py --out out/bench/bench_kept_placement.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_vllm_eplb import add_request_arguments, write_report
from eplb_arms import BALANCEDNESS, prompt
from skewed_router import add_skewed_checkpoint_arguments, skewed_checkpoint

MEASURE_START = "BENCH_MEASURE_START"


def run_arm(args: argparse.Namespace) -> int:
    """One engine, in this process, serving the requests; upstream logs each step's balancedness."""
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      EPLB_GRAPH_PLACEMENT_FILE=args.placement_file)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype="float32", tensor_parallel_size=2, seed=0,
              max_model_len=args.prompt_tokens + args.max_tokens + 8, max_num_seqs=args.batch,
              max_num_batched_tokens=args.batch_tokens, enable_expert_parallel=True, enable_eplb=True,
              eplb_config={"window_size": args.interval, "step_interval": args.interval,
                           "num_redundant_experts": args.redundant, "use_async": True, "log_balancedness": True})
    prompts = [TokensPrompt(prompt_token_ids=prompt(i, args.prompt_tokens)) for i in range(args.requests)]
    print(MEASURE_START, flush=True)
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return 0


def window_balancedness(output: str, interval: int) -> list[float]:
    """Upstream's per-step (mean, max) per-rank loads after the marker, the steps that carried
    load grouped into windows of ``interval``: sum of means over sum of maxes, per full window."""
    measured = output.split(MEASURE_START, 1)[-1]
    loads = [(float(mean), float(most)) for mean, most in BALANCEDNESS.findall(measured) if float(most) > 0]
    windows = [loads[start : start + interval] for start in range(0, len(loads) - interval + 1, interval)]
    return [round(sum(m for m, _ in w) / sum(x for _, x in w), 4) for w in windows]


def launch_arm(arm: str, model: Path, placement_file: Path, args: argparse.Namespace) -> dict:
    existed = placement_file.exists()
    argv = [sys.executable, __file__, "--arm", arm, "--model", str(model), "--placement-file", str(placement_file)]
    for name in ("interval", "redundant", "requests", "prompt_tokens", "max_tokens", "batch", "batch_tokens"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    output = done.stdout + done.stderr
    if done.returncode != 0 or MEASURE_START not in output:
        raise SystemExit(f"arm {arm} failed ({done.returncode}):\n{output[-5000:]}")
    windows = window_balancedness(output, args.interval)
    if len(windows) < args.windows:
        raise SystemExit(f"arm {arm}: {len(windows)} windows of {args.interval} loaded steps, --windows "
                         f"{args.windows} asked for: serve more --requests")
    restored = "experts moved to the placement kept in" in output
    if restored != (arm == "restored") or existed != (arm == "restored"):
        raise SystemExit(f"arm {arm}: the file existed before: {existed}, the engine restored from it: {restored}")
    return {"arm": arm, "windows": windows, "first_windows": windows[: args.windows],
            "upstream_rearrangements_logged": output.count("Rearranging experts (async mode) ..."),
            "kept_rearrangements": json.loads(placement_file.read_text())["rearrangements"]}


def summarize(runs: list[dict], windows: int) -> dict:
    arms = {arm: [r for r in runs if r["arm"] == arm] for arm in ("cold", "restored")}
    first = {arm: [r["windows"][0] for r in arms[arm]] for arm in arms}
    converged = [statistics.mean(r["windows"][-2:]) for r in arms["cold"]]  # the cold run's last two windows
    return {
        "first_window_cold": round(statistics.median(first["cold"]), 4),
        "first_window_restored": round(statistics.median(first["restored"]), 4),
        "converged_cold": round(statistics.median(converged), 4),
        "restored_first_over_converged": round(statistics.median(first["restored"]) / statistics.median(converged), 3),
        "first_window_spread": {arm: round(max(v) - min(v), 4) for arm, v in first.items()},
        "mean_first_windows": {arm: round(statistics.median(statistics.mean(r["first_windows"]) for r in arms[arm]), 4)
                               for arm in arms},
        "windows_compared": windows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rounds", type=int, default=2, help="cold / restored pairs, each with a fresh file (>= 2)")
    parser.add_argument("--arm", choices=["cold", "restored"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--placement-file", help=argparse.SUPPRESS)
    add_skewed_checkpoint_arguments(parser, intermediate=512)
    parser.add_argument("--interval", type=int, default=8, help="EPLB window and step interval, in steps")
    parser.add_argument("--windows", type=int, default=3, help="first windows compared")
    add_request_arguments(parser, requests=64, batch=8, batch_tokens=512)
    args = parser.parse_args(argv)
    if args.arm:
        return run_arm(args)
    if args.out is None:
        parser.error("--out FILE is required")
    if args.rounds < 2:
        parser.error(f"--rounds must be >= 2 (the spread of the first windows), got {args.rounds}")
    workdir = Path(tempfile.mkdtemp(prefix="eplb-graph-kept-"))
    model = skewed_checkpoint(parser, args, workdir / "model")
    runs = []
    for round_ in range(args.rounds):
        placement_file = workdir / f"placement-{round_}.json"
        for arm in ("cold", "restored"):
            runs.append({"round": round_, **launch_arm(arm, model, placement_file, args)})
            print(f"round {round_} {arm}: window balancedness {runs[-1]['windows']}", flush=True)
    write_report(args, "bench_kept_placement", "tp2", summarize(runs, args.windows), runs,
                 ("out", "arm", "model", "placement_file"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
