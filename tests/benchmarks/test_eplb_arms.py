"""eplb_arms.py's pieces that need no engine: the warm-up held until the rebalanced arm's
rearrangement committed, a rearrangement in the timed phase refused, the server's counters read
from /metrics (the engines run in `make bench`)."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmarks.scripts import load_benchmark

arms = load_benchmark("eplb_arms")
vllm_server = load_benchmark("vllm_server")


def arguments(arm: str) -> argparse.Namespace:
    return argparse.Namespace(arm=arm, warm_requests=8, batch=4, requests=6, prompt_tokens=10, max_tokens=2,
                              window=4, interval=64, redundant=2)


class FakeEngine:
    """Serves requests, rearranging (on both ranks) once ``commit_after`` requests were served."""

    def __init__(self, commit_after: int, rearrange_again_after: int | None = None) -> None:
        self.served, self.commit_after, self.again = 0, commit_after, rearrange_again_after
        self.marks: list[str] = []

    def serve(self, count: int, first_id: int) -> tuple[list[float], float]:
        assert first_id == self.served  # request ids never repeat
        self.served += count
        return [0.1] * count, 2.0

    def counters(self) -> dict[int, dict]:
        committed = int(self.served >= self.commit_after) + int(self.again is not None and self.served >= self.again)
        return {rank: {"ep_rank": rank, "expert_seconds": self.served * (rank + 1), "pairs": 10 * self.served,
                       "rearrangements": committed, "in_flight": False} for rank in (0, 1)}


def test_the_rebalanced_arm_warms_until_its_rearrangement_committed_then_times_the_placement():
    engine = FakeEngine(commit_after=14)
    result = arms.timed(arguments("rebalanced"), engine.counters, engine.serve, engine.marks.append)
    assert engine.served == 8 + 2 * 4 + 6  # two more warm batches, then the timed requests
    assert engine.marks == [arms.MEASURE_START, arms.MEASURE_END]
    assert [r["pairs"] for r in result["ranks"]] == [60, 60] and [r["expert_seconds"] for r in result["ranks"]] == [6, 12]
    assert result["tokens"] == 6 * 12 and result["elapsed_s"] == 2.0


def test_the_static_arm_times_right_after_its_warm_up():
    engine = FakeEngine(commit_after=10**6)
    arms.timed(arguments("static"), engine.counters, engine.serve, engine.marks.append)
    assert engine.served == 8 + 6


def test_a_rearrangement_never_committed_or_started_in_the_timed_phase_is_refused():
    with pytest.raises(SystemExit, match="no rearrangement committed in the warm-up"):
        engine = FakeEngine(commit_after=10**6)
        arms.timed(arguments("rebalanced"), engine.counters, engine.serve, engine.marks.append)
    with pytest.raises(SystemExit, match="a rearrangement started in the timed phase on EP ranks \\[0, 1\\]"):
        engine = FakeEngine(commit_after=8, rearrange_again_after=10)
        arms.timed(arguments("rebalanced"), engine.counters, engine.serve, engine.marks.append)


def exposition(counters: dict[str, tuple[float, float]]) -> str:
    """/metrics' text of two workers' counters (EP ranks 0 and 1, one per DP engine), as
    prometheus_client writes it."""
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry, CounterMetricFamily

    class Collector:
        def collect(self):
            for name, values in counters.items():
                family = CounterMetricFamily(f"eplb_graph:{name}", name, labels=["model_name", "engine", "ep_rank"])
                for rank, value in enumerate(values):
                    family.add_metric(["m", str(rank), str(rank)], value)
                yield family

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry).decode()


def test_the_servers_counters_are_read_per_ep_rank_with_a_rearrangement_in_flight():
    text = exposition({"local_pairs_computed": (120.0, 80.0), "local_expert_seconds": (1.5, 0.5),
                       "rearrangements_started": (2.0, 1.0), "rearrangements_finished": (1.0, 1.0)})
    counters = arms.server_counters(vllm_server.parse_metrics(text))
    assert counters == {0: {"ep_rank": 0, "expert_seconds": 1.5, "pairs": 120, "rearrangements": 1, "in_flight": True},
                        1: {"ep_rank": 1, "expert_seconds": 0.5, "pairs": 80, "rearrangements": 1, "in_flight": False}}
    assert not arms.settled(counters.values())
