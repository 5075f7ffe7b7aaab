"""``runtime/elastic_member.py`` alone: a joining member whose resize is given up under it.

The member's whole life in a group (join, serve, switch, leave) runs with its peers in
``test_elastic_run.py`` and ``test_elastic_server.py``.
"""

from datetime import timedelta

import pytest

from eplb_graph.runtime.config import RunConfig
from eplb_graph.runtime.elastic_group import Generation, announce_generation
from eplb_graph.runtime.elastic_run import ElasticRun
from eplb_graph.runtime.elastic_spec import ABANDONED, ElasticSpec
from eplb_graph.runtime.launch import free_port


@pytest.mark.launches  # a member process
def test_a_joiner_blocked_on_a_peer_that_never_comes_leaves_once_its_resize_is_given_up():
    # member 6 never starts: member 5's group build would wait for it the whole collective
    # timeout (600 s here); the give-up written meanwhile must end the join long before
    spec = ElasticSpec(RunConfig(mode="eager", ranks=2), 2, "127.0.0.1", free_port(), timeout_s=600.0)
    run = ElasticRun(spec, (2,))
    try:
        run.start(5, 1)
        announce_generation(run.store, spec.name, Generation(1, (5, 6)))
        # gloo's rendezvous key of rank 0 (member 5) under the group's prefix: it is inside the build
        run.store.wait([f"{spec.name}/gen1/pg//0/0"], timedelta(seconds=300))
        run.store.set(spec.key("gen", 1, "switch"), ABANDONED)
        member, ok, result = run.results.get(timeout=120)
        assert (member, ok) == (5, True)
        assert result == {"member": 5, "abandoned_join": "member 5: the resize to generation 1 was given up"}
        run.processes[5].join(60)
        assert run.processes[5].exitcode == 0
    finally:
        if run.processes[5].is_alive():
            run.processes[5].kill()
