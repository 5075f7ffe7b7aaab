"""The bench's statistics: percentiles, ratios of medians, and their paired bootstrap intervals."""

from __future__ import annotations

import statistics

import torch

PAIRED_SETTINGS = ("off", "on_idle", "off_twin")
BLOCK_STEPS = 10  # the bootstrap's block: consecutive paired steps drawn together
MIN_BENCH_STEPS = 2 * BLOCK_STEPS




def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def rearrangement_lengths(rebalancing: list[bool]) -> list[int]:
    """Steps each finished rearrangement was in flight, from a rank's per-step flags: every run
    of True followed by a False (one still in flight at the end is not counted)."""
    lengths, run = [], 0
    for busy in rebalancing:
        if busy:
            run += 1
        elif run:
            lengths.append(run)
            run = 0
    return lengths


def over_median(numerator: list[float], denominator: list[float], q: float = 50) -> float | None:
    """The numerator steps' q-th percentile (their median at 50) over the denominator steps'
    median, to 3 places; None where either has no step."""
    if not numerator or not denominator:
        return None
    top = statistics.median(numerator) if q == 50 else percentile(numerator, q)
    return round(top / statistics.median(denominator), 3)


def paired_ratio_interval(numerator: list[float], denominator: list[float], *, block: int = BLOCK_STEPS,
                          resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of median(numerator) / median(denominator) for paired step times
    (numerator[i] and denominator[i] timed back to back), by a moving-block bootstrap:
    blocks of consecutive pairs are drawn together, keeping the steps' correlation in time
    (the workload's batches cycle, the machine's load drifts). Says how far the measured
    ratio can be trusted on a noisy machine; seeded, so a report reproduces from its steps."""
    if len(numerator) != len(denominator) or len(numerator) < block:
        raise ValueError(f"need two paired series of at least {block} steps, got {len(numerator)} and {len(denominator)}")
    pairs = torch.tensor([numerator, denominator], dtype=torch.float64)  # [2, N]
    n = pairs.shape[1]
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n - block + 1, (resamples, -(-n // block)), generator=generator)  # [R, ceil(N / block)]
    picks = (starts.unsqueeze(-1) + torch.arange(block)).flatten(1)[:, :n]  # [R, N]
    medians = pairs[:, picks].quantile(0.5, dim=-1)  # [2, R]
    ratios = medians[0] / medians[1]  # [R]
    low, high = ratios.quantile(torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def check_bench_steps(steps: int) -> None:
    if steps < MIN_BENCH_STEPS:
        raise ValueError(f"bench needs --steps >= {MIN_BENCH_STEPS} (p99 and the 95 % intervals need at least two "
                         f"{BLOCK_STEPS}-step blocks per rank), got {steps}")


def idle_ratios(idle: list[float], off: list[float], twin: list[float], idle_host: list[float]) -> dict:
    """on_idle / off beside the A/A off_twin / off, with their paired 95 % intervals (the three
    models rotate step by step in the same processes), and on_idle's EPLB host time."""
    return {
        "on_idle_over_off": over_median(idle, off),
        "on_idle_over_off_ci95": [round(x, 3) for x in paired_ratio_interval(idle, off)],
        # the A/A yardstick: two identical EPLB-off models, what the harness reads when nothing differs
        "off_twin_over_off": over_median(twin, off),
        "off_twin_over_off_ci95": [round(x, 3) for x in paired_ratio_interval(twin, off)],
        "on_idle_eplb_host_p50_ms": round(statistics.median(idle_host), 3),  # begin_batch + end_batch
    }
