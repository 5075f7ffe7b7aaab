"""``runtime/elastic/liveness.py``: which members the detector finds hung, from what it saw and when.

The rules run over hand-made observations (the coordinator's clock is an argument); the
keep-alive thread publishes through a real store. A member SIGSTOPped, or with its main
thread hung, is fenced and recovered from in ``test_scripted.py``.
"""

from eplb_reference.elastic.liveness import KeepAliveThread, Seen, hung_members, observe
from eplb_reference.elastic.protocol import KeepAlive, Phase

HANG_S, STARTUP_S = 10.0, 100.0


def alive(beat=1, progress=1, collectives=0, waiting=False, phase=Phase.SERVING, generation=1):
    return KeepAlive(beat, progress, collectives, waiting, phase, generation)


def seen_at(now: float, beat_s: float, moved_s: float, phase_s: float = 0.0, **fields) -> Seen:
    return Seen(since_s=0.0, alive=alive(**fields), beat_s=beat_s, moved_s=moved_s, phase_s=phase_s)


def test_what_changed_is_timed_on_the_coordinators_clock():
    seen = Seen(since_s=0.0)
    observe(seen, alive(beat=1, progress=5), now=1.0)
    observe(seen, alive(beat=2, progress=5), now=2.0)  # beating, its main thread still
    assert (seen.beat_s, seen.moved_s) == (2.0, 1.0)
    observe(seen, alive(beat=2, progress=5, collectives=1), now=3.0)  # a collective entered is a move
    assert (seen.beat_s, seen.moved_s) == (2.0, 3.0)


def test_a_member_that_stops_beating_is_hung_whatever_it_was_doing():
    seen = {1: seen_at(100, beat_s=89, moved_s=89, waiting=True), 2: seen_at(100, beat_s=99, moved_s=99)}
    assert hung_members(seen, (1, 2), 100.0, HANG_S, STARTUP_S) == {1: "silent for 11.0 s (stopped or hung)"}


def test_a_main_thread_still_outside_any_wait_is_hung_and_one_waiting_on_its_peers_is_not():
    seen = {1: seen_at(100, beat_s=99.9, moved_s=85), 2: seen_at(100, beat_s=99.9, moved_s=85, waiting=True, beat=2),
            3: seen_at(100, beat_s=99.9, moved_s=85, phase=Phase.STARTING)}  # compiling: its own bound
    assert hung_members(seen, (1, 2), 100.0, HANG_S, STARTUP_S) == {
        1: "main thread still for 15.0 s while serving"}


def test_where_every_member_waits_the_one_behind_the_others_collectives_is_hung():
    seen = {m: seen_at(100, beat_s=99.9, moved_s=85, waiting=True, collectives=c) for m, c in ((0, 41), (1, 40), (2, 41))}
    assert hung_members(seen, (0, 1, 2), 100.0, HANG_S, STARTUP_S) == {}  # merely slow, for all one can tell yet
    for s in seen.values():
        s.beat_s = 105.4  # their keep-alive threads beat on
    assert hung_members(seen, (0, 1, 2), 105.5, HANG_S, STARTUP_S) == {
        1: "behind its peers: entered 40 collectives of generation 1, a peer 41"}
    # nobody behind: a collective stuck everywhere is left to its own timeout
    even = {m: seen_at(100, beat_s=105.4, moved_s=85, waiting=True, collectives=41) for m in (0, 1, 2)}
    assert hung_members(even, (0, 1, 2), 105.5, HANG_S, STARTUP_S) == {}


def test_members_waiting_on_a_stopped_peer_are_not_blamed_for_it():
    # member 2 stopped at t=94 as the others entered the collective it never joined
    seen = {0: seen_at(0, beat_s=0, moved_s=94.1, waiting=True, collectives=41),
            1: seen_at(0, beat_s=0, moved_s=94.1, waiting=True, collectives=41),
            2: seen_at(0, beat_s=94.0, moved_s=94.0, waiting=False, collectives=40)}
    for now in (100.0, 103.9, 104.5):
        for member in (0, 1):
            seen[member].beat_s = now - 0.1  # their keep-alive threads beat on
        hung = hung_members(seen, (0, 1, 2), now, HANG_S, STARTUP_S)
        assert hung == ({} if now < 104 else {2: "silent for 10.5 s (stopped or hung)"})  # never 0 or 1


def test_a_member_still_waiting_where_its_peers_gave_the_generation_up_is_hung():
    # nobody behind by count: the others' collective timed out around it and they recover
    seen = {0: seen_at(0, beat_s=99.9, moved_s=99.8, phase_s=99.5, phase=Phase.RECOVERING, collectives=41),
            1: seen_at(0, beat_s=99.9, moved_s=75, waiting=True, collectives=41)}
    assert hung_members(seen, (0, 1), 100.0, HANG_S, STARTUP_S) == {}  # it may be failing next
    assert hung_members(seen, (0, 1), 109.6, HANG_S, STARTUP_S) == {}  # its keep-alive is late: silent soon
    seen[1].beat_s = seen[0].beat_s = 109.5
    assert hung_members(seen, (0, 1), 109.6, HANG_S, STARTUP_S) == {
        1: "still waiting in a collective of generation 1 its peers gave up"}


def test_members_still_waiting_beside_one_that_gave_up_are_not_blamed_yet():
    # the first peer's collective timed out; the others' may time out next: none of them is the one
    seen = {0: seen_at(0, beat_s=99.9, moved_s=99.8, phase=Phase.RECOVERING, collectives=41),
            1: seen_at(0, beat_s=99.9, moved_s=75, waiting=True, collectives=41),
            2: seen_at(0, beat_s=99.9, moved_s=75, waiting=True, collectives=41)}
    assert hung_members(seen, (0, 1, 2), 100.0, HANG_S, STARTUP_S) == {}


def test_collectives_are_compared_only_within_one_generation():
    seen = {0: seen_at(100, beat_s=99.9, moved_s=85, waiting=True, collectives=300, generation=1),
            1: seen_at(100, beat_s=99.9, moved_s=85, waiting=True, collectives=12, generation=2)}
    assert hung_members(seen, (0, 1), 100.0, HANG_S, STARTUP_S) == {}


def test_a_member_that_never_beats_or_never_finishes_starting_is_hung_after_its_start_up_bound():
    seen = {5: Seen(since_s=0.0)}
    assert hung_members(seen, (), 99.0, HANG_S, STARTUP_S) == {}
    assert hung_members(seen, (), 101.0, HANG_S, STARTUP_S) == {5: "no keep-alive within 100 s of its start"}
    compiling = {6: seen_at(0, beat_s=149.9, moved_s=60, phase=Phase.STARTING)}  # building, compiling: no marks
    assert hung_members(compiling, (), 150.0, HANG_S, STARTUP_S) == {}
    compiling[6].beat_s = 169.9
    assert hung_members(compiling, (), 170.0, HANG_S, STARTUP_S) == {6: "still starting after 110 s (bound 100 s)"}


def test_a_spare_whose_main_thread_stops_polling_is_hung():
    seen = {7: seen_at(0, beat_s=99.9, moved_s=85, phase=Phase.SPARE)}
    assert hung_members(seen, (), 100.0, HANG_S, STARTUP_S) == {7: "main thread still for 15.0 s while spare"}


def test_the_keep_alive_thread_publishes_the_main_threads_marks_and_waits(board):
    collectives = [0]
    keep_alive = KeepAliveThread(board, member=3, beat_s=0.01, collectives=lambda: (2, collectives[0]))
    keep_alive.set_phase(Phase.SERVING)
    keep_alive.mark()
    collectives[0] = 7
    with keep_alive.waiting():
        snapshot = keep_alive.snapshot()
    assert (snapshot.progress, snapshot.collectives, snapshot.waiting, snapshot.phase, snapshot.generation) == (
        2, 7, True, Phase.SERVING, 2)
    assert not keep_alive.snapshot().waiting and keep_alive.snapshot().progress == 3  # leaving a wait moves on
    keep_alive.start()
    try:
        published = None
        for _ in range(500):
            published = board.keep_alive(3)
            if published is not None and published.beat >= 2:
                break
            keep_alive._stop.wait(0.01)
        assert published.beat >= 2 and published.collectives == 7 and published.phase is Phase.SERVING
    finally:
        keep_alive.stop()
