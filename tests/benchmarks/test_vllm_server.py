"""vllm_server.py's readings of /metrics (the server itself runs in the benchmarks, `make bench`)."""

from __future__ import annotations

from tests.benchmarks.scripts import load_benchmark
from tests.benchmarks.test_eplb_arms import exposition

vllm_server = load_benchmark("vllm_server")


def test_a_counter_is_read_per_rank_and_what_it_grew_by_counts_a_new_rank_from_zero():
    before = vllm_server.parse_metrics(exposition({"rearrangements_finished": (1.0, 2.0)}))
    after = vllm_server.parse_metrics(exposition({"rearrangements_finished": (3.0, 2.0, 4.0)}))
    assert vllm_server.per_rank(after, "eplb_graph:rearrangements_finished") == {"0": 3.0, "1": 2.0, "2": 4.0}
    assert vllm_server.counted_since(before, after, "eplb_graph:rearrangements_finished") == 2.0 + 0.0 + 4.0
    assert vllm_server.sample(after, "eplb_graph:rearrangements_finished", ep_rank="2") == 4.0
    assert vllm_server.sample(after, "eplb_graph:rearrangements_finished", ep_rank="7") is None
    assert vllm_server.sample(after, "eplb_graph:no_such_family") is None
