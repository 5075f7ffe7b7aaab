"""``runtime/elastic/protocol/values.py``: every value a key holds round-trips through its codec."""

import pytest

from eplb_reference.elastic.protocol import Abandoned, KeepAlive, Phase, Switched, decode_outcome, encode_outcome


@pytest.mark.parametrize("outcome", [Switched(40, 2), Abandoned("member 3 died"), Abandoned("a: b: c", broken=True)])
def test_outcomes_round_trip(outcome):
    assert decode_outcome(encode_outcome(outcome)) == outcome


def test_a_keep_alive_round_trips():
    alive = KeepAlive(beat=7, progress=30, collectives=12, waiting=True, phase=Phase.PREPARING, generation=2)
    assert KeepAlive.decode(alive.encode()) == alive
