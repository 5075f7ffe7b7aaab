"""``runtime/elastic_spec.py``: the store keys members meet under, and a client per caller."""

from datetime import timedelta

import torch.distributed as dist

from eplb_graph.runtime.config import RunConfig
from eplb_graph.runtime.elastic_spec import ElasticSpec
from eplb_graph.runtime.launch import free_port


def test_keys_are_named_under_the_run_and_each_connect_is_a_client_of_its_own():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    spec = ElasticSpec(RunConfig(ranks=2), 4, "127.0.0.1", port, name="ep-test", timeout_s=10)
    assert spec.key("gen", 3, "switch") == "ep-test/gen/3/switch"
    first, second = spec.connect(), spec.connect()
    first.set(spec.key("step"), "7")
    assert first is not second and second.get(spec.key("step")) == b"7" and master.check([spec.key("step")])

