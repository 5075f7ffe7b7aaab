"""``eplb-graph join --store HOST:PORT``: a member started outside the coordinator's process tree.

What a second machine runs: it reads the run's spec from the coordinator's store, takes the
next member id, builds and warms up its share of the model, and offers itself as a spare.
From then on it is a member like any other: assigned to a resize, recovered from if it dies
or hangs (a fence reaches it through the store; on the coordinator's own host it is also
killed by its pid), and it reports through the store when it ends.
"""

from __future__ import annotations

import logging
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

from eplb_reference.elastic.processes import member_main
from eplb_reference.elastic.protocol import Board, RunSecret
from eplb_reference.elastic.protocol.proof import Unproven
from eplb_reference.elastic.spec import ElasticSpec

log = logging.getLogger("eplb_graph.elastic.join")


def parse_store(text: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port)."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--store takes HOST:PORT, e.g. 10.0.0.5:29500; got {text!r}")
    return host, int(port)


def join(store: str, secret: RunSecret, *, name: str = "ep", timeout_s: float = 60.0) -> int:
    """Joins the run whose store is at ``store`` as a spare, proving itself with the run's ``secret``;
    the member's exit code."""
    host, port = parse_store(store)
    try:
        client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError) as error:
        raise ValueError(f"--store {store}: no elastic run's store answers there ({error})") from None
    board = Board(client, name, secret)
    try:
        spec_text = board.spec_text(timeout_s)
    except Unproven:
        raise ValueError(f"--store {store}: run {name!r}'s spec there is not sealed with the secret given: a wrong "
                         f"secret (--secret-file or EPLB_GRAPH_RUN_SECRET)") from None
    spec = ElasticSpec.from_json(spec_text, store_host=host)
    member = board.new_member_id()
    print(f"eplb-graph join: member {member} of run {name!r} ({spec.cfg.ranks} founding ranks, up to "
          f"{spec.max_ranks}) from {socket.gethostname()}", file=sys.stderr)
    return member_main(member, spec, None, spec.connect(secret), offer=True)
