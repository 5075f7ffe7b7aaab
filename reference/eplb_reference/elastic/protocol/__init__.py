"""The elastic EP protocol: every key the coordinator and the members meet under, and its value.

One key format, ``<run>/<scope>/<id>/<field>``, one codec per value (``values.py``), and one
client class (``board.py``: ``Board``) that reads and writes them typed; nothing else spells a key.

    gen/<g>/members       json [member, ...] in rank order       the coordinator announces a generation
    gen/<g>/hold          "1"                                     a drain holds the resize until released
    gen/<g>/release       Release                                 the coordinator: go, or give it up
    gen/<g>/ready/<m>     "1"                                     a joiner: built, state received, warm
    gen/<g>/outcome       Switched | Abandoned (compare-and-set)  the commit point: the first writer wins
    gen/<g>/recovery      int                                     the recovery generation announced for g broken
    gen/<g>/gloo/<kind>/  gloo's own rendezvous keys              one prefix per group built
    member/<m>/assign     int | "stop"                            a spare's generation to join
    member/<m>/alive      KeepAlive                               the keep-alive thread, every beat
    member/<m>/fence      why                                     fenced: the member exits at its next beat
    member/<m>/report     json                                    the member's last word (MemberResult)
    member/<m>/served     "step:rank:size;" appended              the scripted run's batches completed
    member/<m>/inbox      queue of request json                   the server's requests for m
    member/<m>/returned   json [rid, ...]                         a leaver's unfinished requests
    run/results           queue of result json                    every finished request, once
    run/step, run/step_ms, run/rearrangements, run/balancedness   what rank 0 publishes
    run/stop, run/next_member, run/spec, run/offers (queue)       the run's life; members joining from outside

Every value is sealed with the run's secret over its key (``proof.py``: ``RunSecret``) and
opened before it is read (``sealed.py``); gloo's keys and the two counters are the exceptions.

Any writer may give a pending resize up (``abandon``): a joiner that timed out, rank 0, the
coordinator, the server; rank 0's ``commit`` is a compare-and-set against all of them, so a
generation switches with exactly the members that confirmed, or not at all.
"""

from eplb_reference.elastic.protocol.board import STOP, Board, ProtocolTimeout
from eplb_reference.elastic.protocol.proof import SECRET_ENV, RunSecret
from eplb_reference.elastic.protocol.values import (
    Abandoned, Generation, KeepAlive, Outcome, Phase, Release, Switched, decode_outcome, encode_outcome,
)

__all__ = ["SECRET_ENV", "STOP", "Abandoned", "Board", "Generation", "KeepAlive", "Outcome", "Phase", "ProtocolTimeout",
           "Release", "RunSecret", "Switched", "decode_outcome", "encode_outcome"]
