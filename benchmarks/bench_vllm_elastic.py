"""vLLM's elastic EP through the plugin, resized while serving: what each resize costs.

The OpenAI server of docs/quickstart-hf.md's elastic section (a private Ray head on 127.0.0.1,
DP=2, ``--elastic-ep-max-dp-size`` the largest size asked), on skewed_router.py's worst-case
checkpoint (its hot experts start unreplicated on rank 0), resized ``--sizes`` (2 -> 3 -> 2 by
default) while one client streams completions back to back. For each resize:

* ``request_to_serving_s``: from the ``POST /scale_elastic_ep`` to the first token after its answer;
* ``pause_s``: the longest gap between two streamed tokens from the POST to that first token;
* ``recompiles``: graphs compiled while serving over the resize (``eplb_graph:graphs_compiled_while_serving``,
  each compiled graph maps every MoE layer once: the counter over the layer count);
* ``balancedness_before`` / ``_after``: ``eplb_graph:balancedness_committed`` (all layers, EP rank 0)
  before the POST, and after the first rearrangement that finished after it;
* ``tokens_per_s_before`` / ``_after``: streamed tokens per second over ``--window-s`` before the
  POST and after that rearrangement.

Arms: ``kept`` is the plugin's default: the compiled graphs serve on through each switch (they hold
no value of the group's size: ``vllm_plugin/elastic_follow.py``), upstream's reset skipped.
``reset`` is what vLLM 0.32 does at every switch (``_release_cuda_graphs``: Dynamo reset, every
graph recompiled by the re-warm while the scheduler waits), asked for with
``EPLB_GRAPH_ELASTIC_KEEP_GRAPHS=0``. ``--rounds`` runs of each arm, interleaved, each its own
server. ``kept_over_reset_pause``: the kept arm's median pause over the reset arm's (target <= 0.5,
with 0 recompiles in the kept arm); ``aa_ratio``: the reset arm's second round's median pause over
its first.

    python benchmarks/bench_vllm_elastic.py --out out/bench/bench_vllm_elastic.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from skewed_router import add_skewed_checkpoint_arguments, skewed_checkpoint  # noqa: E402
from vllm_server import counted_since, post, sample, scrape, served  # noqa: E402

from eplb_graph.vllm_plugin.elastic_follow import KEEP_GRAPHS  # noqa: E402  (1 kept, 0 upstream's reset)
from eplb_reference.bench.ray_head import PrivateRayHead  # noqa: E402
from eplb_reference.models.tiny_tokenizer import write_tiny_tokenizer  # noqa: E402

ARMS = ("reset", "kept")


class Stream(threading.Thread):
    """Streams completions back to back, keeping each token's arrival time; retries a 503 (the switch)."""

    def __init__(self, port: int, model: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.port, self.model, self.max_tokens = port, model, max_tokens
        self.stopping = threading.Event()
        self.token_times: list[float] = []
        self.errors: list[str] = []

    def run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "expert parallel load balancing " * 8, "stream": True,
                           "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}).encode()
        while not self.stopping.is_set():
            request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    for line in response:
                        if line.startswith(b"data: {"):
                            self.token_times.append(time.monotonic())
            except urllib.error.HTTPError as error:
                if error.code != 503:
                    self.errors.append(f"{error.code}: {error.read().decode()[:200]}")
                self.stopping.wait(0.2)
            except OSError as error:
                self.errors.append(repr(error))
                self.stopping.wait(0.2)

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.token_times) / (end - start)


def resize(port: int, stream: Stream, size: int, args: argparse.Namespace, layers: int) -> dict:
    """One resize under the stream, measured as the module docstring says."""
    before = scrape(port)
    window_end = time.monotonic()
    tokens_before = stream.rate(window_end - args.window_s, window_end)
    started = time.monotonic()
    status, answer = post(port, "/scale_elastic_ep", {"new_data_parallel_size": size}, timeout=900)
    if status != 200:
        raise SystemExit(f"resize to {size} answered {status}: {answer}")
    answered = time.monotonic()
    while not [t for t in stream.token_times if t > answered]:
        stream.stopping.wait(0.05)
    first = min(t for t in stream.token_times if t > answered)
    times = [started] + [t for t in stream.token_times if started <= t <= first]
    finished_before = sample(before, "eplb_graph:rearrangements_finished", ep_rank="0") or 0
    deadline = time.monotonic() + args.rebalance_timeout_s
    after = scrape(port)
    while (sample(after, "eplb_graph:rearrangements_finished", ep_rank="0") or 0) <= finished_before \
            and time.monotonic() < deadline:
        stream.stopping.wait(1.0)
        after = scrape(port)
    stream.stopping.wait(args.window_s)
    window_end = time.monotonic()
    return {"from": None, "to": size, "request_to_serving_s": round(first - started, 3),
            "pause_s": round(max(b - a for a, b in zip(times, times[1:])), 3),
            "recompiles": counted_since(before, scrape(port), "eplb_graph:graphs_compiled_while_serving") / layers,
            "balancedness_before": sample(before, "eplb_graph:balancedness_committed", layer="all"),
            "balancedness_after": sample(after, "eplb_graph:balancedness_committed", layer="all"),
            "tokens_per_s_before": round(tokens_before, 2),
            "tokens_per_s_after": round(stream.rate(window_end - args.window_s, window_end), 2)}


def run_arm(arm: str, model: Path, args: argparse.Namespace, workdir: Path) -> list[dict]:
    port = int(args.port)
    log = workdir / f"{arm}-{time.monotonic_ns()}.log"
    most = max(args.sizes)
    server_args = ["--model", str(model), "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4",
                   "--data-parallel-size", str(args.sizes[0]), "--data-parallel-backend", "ray",
                   "--data-parallel-address", "127.0.0.1", "--enable-expert-parallel", "--enable-eplb",
                   "--enable-elastic-ep", "--elastic-ep-max-dp-size", str(most),
                   "--eplb-config", json.dumps({"window_size": args.window, "step_interval": args.interval,
                                                "num_redundant_experts": args.redundant})]
    with PrivateRayHead(num_cpus=most + 1, resources={"eplb_graph_dp": most}) as head:
        env = {**head.client_env, "VLLM_CPU_KVCACHE_SPACE": "1", KEEP_GRAPHS: "1" if arm == "kept" else "0",
               "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "TORCHINDUCTOR_",  # Ray copies vLLM's variables only
               "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(rank % os.cpu_count()) for rank in range(most))}
        with served(server_args, env, log, port):
            stream = Stream(port, str(model), args.max_tokens)
            try:
                stream.start()
                stream.stopping.wait(args.window_s + args.warm_s)
                results, current = [], args.sizes[0]
                for size in args.sizes[1:]:
                    result = resize(port, stream, size, args, args.layers)
                    results.append({**result, "arm": arm, "from": current})
                    current = size
                if stream.errors:
                    raise SystemExit(f"requests failed: {stream.errors[:3]}")
                return results
            finally:
                stream.stopping.set()
                if stream.is_alive():
                    stream.join(timeout=60)  # its request in flight would hold the server's shutdown open


def pause_ratios(runs: list[list[dict]]) -> dict:
    """``kept_over_reset_pause``, ``aa_ratio`` and whether the target holds, from each run's resizes."""
    medians = {arm: [statistics.median(r["pause_s"] for r in run) for run in runs if run and run[0]["arm"] == arm]
               for arm in ARMS}
    kept, reset = (statistics.median(medians[arm]) if medians[arm] else None for arm in ("kept", "reset"))
    ratio = round(kept / reset, 3) if kept is not None and reset else None
    recompiles_kept = [r["recompiles"] for run in runs for r in run if r["arm"] == "kept"]
    aa = medians["reset"]
    return {"kept_over_reset_pause": ratio,
            "aa_ratio": round(aa[1] / aa[0], 3) if len(aa) > 1 and aa[0] else None,
            "target_met": None if ratio is None else ratio <= 0.5 and not any(recompiles_kept)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--rounds", type=int, default=2, help="runs of each arm (>= 2: the A/A ratio)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 2], help="the DP sizes, the start first")
    parser.add_argument("--port", type=int, default=18231)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--interval", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--window-s", type=float, default=10.0, help="the throughput windows")
    parser.add_argument("--warm-s", type=float, default=20.0, help="served before the first window")
    parser.add_argument("--rebalance-timeout-s", type=float, default=120.0)
    add_skewed_checkpoint_arguments(parser, intermediate=256)
    args = parser.parse_args(argv)
    if args.rounds < 2 or len(args.sizes) < 2 or min(args.sizes) < 2:
        parser.error("--rounds >= 2, and at least two --sizes, each >= 2")
    with tempfile.TemporaryDirectory(prefix="bench_vllm_elastic_") as tmp:
        workdir = Path(tmp)
        model = skewed_checkpoint(parser, args, workdir / "model")
        write_tiny_tokenizer(model, 512)  # the server tokenizes (the checkpoint's vocabulary)
        runs = [run_arm(arm, model, args, workdir) for _ in range(args.rounds) for arm in args.arms]
    resizes = [resize for run in runs for resize in run]
    report = {"resizes": resizes, **pause_ratios(runs),
              "config": {k: v for k, v in vars(args).items() if k != "out"} | {"out": None}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
