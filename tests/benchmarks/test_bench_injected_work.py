"""The injected-work yardstick: the op it inserts only waits, so the model computes the same."""

import importlib.util
import sys
import time
from pathlib import Path

import torch

from eplb_graph.runner import RunConfig, build_rank_models
from eplb_graph.workload import make_batch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_injected_work.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_injected_work", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_injected_work", module)
    spec.loader.exec_module(sys.modules["bench_injected_work"])
    return sys.modules["bench_injected_work"]


def test_injected_work_waits_and_changes_nothing_else():
    bench = _load_script()
    library = bench.register_spin_op()
    try:
        cfg = RunConfig(ranks=1, eplb=False, mode="eager")
        plain, _, _, _ = build_rank_models(cfg, 0, 1, None)
        injected, _, _, _ = build_rank_models(cfg, 0, 1, None)
        bench.inject_after_routers(injected, 2000.0)  # 2 ms per router: measurable against the noise
        batch = make_batch(cfg.workload(), 1, 0)
        with torch.no_grad():
            expected = plain(batch.tokens)
            start = time.perf_counter()
            out = injected(batch.tokens)
            elapsed = time.perf_counter() - start
        assert torch.equal(out, expected)
        assert elapsed >= 2 * 2000e-6  # both layers waited
    finally:
        del library
