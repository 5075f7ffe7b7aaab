"""``runtime/elastic/protocol/values.py``: every value a key holds round-trips through its codec."""

import pytest

from eplb_reference.elastic.protocol import Abandoned, KeepAlive, Phase, Release, Switched, decode_outcome, encode_outcome
from eplb_reference.elastic.protocol.values import MalformedValue, decode_index, decode_members, decode_release


@pytest.mark.parametrize("outcome", [Switched(40, 2), Abandoned("member 3 died"), Abandoned("a: b: c", broken=True)])
def test_outcomes_round_trip(outcome):
    assert decode_outcome(encode_outcome(outcome)) == outcome


def test_a_keep_alive_round_trips():
    alive = KeepAlive(beat=7, progress=30, collectives=12, waiting=True, phase=Phase.PREPARING, generation=2)
    assert KeepAlive.decode(alive.encode()) == alive


@pytest.mark.parametrize("decode, text", [
    (decode_outcome, "switched:4"), (decode_outcome, "switched:x:2"), (decode_outcome, "abandoned:2:why"),
    (decode_outcome, "moved:1:2"), (decode_members, "[]"), (decode_members, "[1, 1]"), (decode_members, '["a"]'),
    (decode_members, "{"), (decode_members, "[-1]"), (decode_index, "-3"), (decode_index, "3.5"), (decode_index, ""),
    (decode_index, "\u0663"), (decode_release, "later"),
])
def test_what_the_coordinator_writes_is_refused_malformed(decode, text):
    with pytest.raises(MalformedValue):
        decode(text)


def test_what_the_coordinator_writes_decodes():
    assert decode_members("[3, 1]") == (3, 1) and decode_index("12") == 12 and decode_release("go") is Release.GO
