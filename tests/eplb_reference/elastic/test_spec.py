"""``runtime/elastic/spec.py``: the spec every member gets, the same read from the store, and the
serving shape's refusals."""

from datetime import timedelta

import pytest

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.spec import ElasticSpec, ServeShape


def test_the_spec_a_coordinator_publishes_is_the_spec_a_member_started_elsewhere_reads(board):
    cfg = RunConfig(mode="eager", ranks=2, capture_sizes=(8, 64), window_size=7)
    spec = ElasticSpec(cfg, 4, "127.0.0.1", board.store.port, hang_s=3.5, serve=ServeShape(rows=2, seq=12))
    board.publish_spec(spec.to_json())
    read = ElasticSpec.from_json(board.clone().spec_text(timeout_s=1), store_host="10.0.0.5")
    assert read == ElasticSpec(cfg, 4, "10.0.0.5", board.store.port, hang_s=3.5, serve=ServeShape(rows=2, seq=12))
    assert ElasticSpec.from_json(spec.to_json()) == spec


def test_each_connect_is_a_client_of_its_own(board):
    spec = ElasticSpec(RunConfig(ranks=2), 4, "127.0.0.1", board.store.port, name=board.run, timeout_s=10)
    first, second = spec.connect(board.secret), spec.connect(board.secret)
    first.publish_step(7)
    # a store's set is not acknowledged: another client's read can reach the store before it
    second.store.wait([second.key("run", None, "step")], timedelta(seconds=10))
    assert first.store is not second.store and second.step() == 7 and board.step() == 7


def test_a_request_that_cannot_fit_or_names_no_token_is_refused_before_it_is_queued():
    shape = ServeShape(rows=4, seq=16)
    with pytest.raises(ValueError, match="exceeds the server's 16 tokens per request"):
        shape.check(10, 7)
    with pytest.raises(ValueError, match="needs a prompt and at least one new token"):
        shape.check(0, 3)
