"""The injected-work yardstick: the op it inserts only waits, so the model computes the same."""

import time

import torch

from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.stack import build_rank_models
from eplb_reference.runtime.workload import make_batch
from tests.benchmarks.scripts import load_benchmark


def test_injected_work_waits_and_changes_nothing_else():
    bench = load_benchmark("bench_injected_work")
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
