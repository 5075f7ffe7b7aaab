"""An elastic EP group: this member's gloo groups, one generation at a time, the next built beside.

Generation ``g``'s members are announced in the run's TCP store (``protocol.Board``); a
member that is in it builds the generation's gloo groups from the same store (as upstream's
stateless ``init_gloo_process_group``: no default process group, so groups of different
sizes can be built while one serves), each listening on ``gloo_host`` alone
(``gloo_process_group``). The next generation is built on a thread
(``StandbyBuild``) while the current one serves; ``switch_`` makes it current between two
steps. ``ElasticEpGroup`` is also the slot the EP collective ops resolve by name
(``custom_ops/ep_collectives.py``), so every graph follows the switch; it counts the
collectives entered through it, which the keep-alive reports (``liveness.py``).

Each build owns what it built: a build given up releases its own groups when it ends, and
nothing a later build does can see it. The group holds the only reference to its current
process groups, so dropping them (``abort``) closes their connections at once, and a peer
waiting inside one of their collectives fails instead of waiting out its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from eplb_graph.custom_ops import EP_GROUPS
from eplb_reference.elastic.protocol import Board, Generation

log = logging.getLogger("eplb_graph.elastic.group")


class GenerationGroups(NamedTuple):
    """One generation's gloo groups: ``ep`` for the forwards and the members' control, ``eplb`` for
    upstream's async EPLB worker, whose collectives run on another thread (one group shared
    by two threads would interleave their collectives differently on each rank)."""

    ep: dist.ProcessGroup
    eplb: dist.ProcessGroup | None


class ElasticGroupError(RuntimeError):
    """A generation could not be built in time; the current one keeps serving."""


class StandbyBuild:
    """One generation's groups, built on a thread; ``after_build(ep_group)`` runs there once built."""

    def __init__(self, build: Callable[[], GenerationGroups | None], generation: Generation,
                 after_build: Callable[[dist.ProcessGroup], None] | None, name: str) -> None:
        self.generation = generation
        self._lock = threading.Lock()
        self._groups: GenerationGroups | None = None
        self.error: BaseException | None = None
        self._given_up = False
        self._thread = threading.Thread(target=self._run, args=(build, after_build), name=f"{name}-standby", daemon=True)
        self._thread.start()

    def _run(self, build, after_build) -> None:
        try:
            groups = build()
            with self._lock:
                if self._given_up:
                    return  # dropped here: nobody else ever saw them
                self._groups = groups
            if after_build is not None and groups is not None:
                after_build(groups.ep)
        except BaseException as error:  # reported by ``failed`` / ``take``
            with self._lock:
                self.error, self._groups = error, None

    def done(self, timeout_s: float = 0.0) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def take(self) -> GenerationGroups | None:
        """The built groups, handed over; ElasticGroupError where the build failed."""
        if not self.done():
            raise ElasticGroupError(f"generation {self.generation.index} is still being built")
        if self.error is not None:
            raise ElasticGroupError(f"building generation {self.generation.index}'s group failed: "
                                    f"{self.error}") from self.error
        groups, self._groups = self._groups, None
        return groups

    def give_up(self) -> None:
        """Whatever it built, or builds after this, is dropped (a build blocked on a member that
        never came ends by its own timeout)."""
        with self._lock:
            self._given_up, self._groups = True, None


def gloo_process_group(store: dist.Store, rank: int, size: int, timeout: timedelta, host: str) -> dist.ProcessGroup:
    """A stateless gloo group (no default process group) whose listener is on ``host``: gloo's default
    device listens on the address the machine's hostname resolves to, whatever the store's."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    backend = dist.ProcessGroupGloo(store, rank, size, options)
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return group


class ElasticEpGroup:
    """This member's EP group now, and the next generation while it is being built."""

    def __init__(self, name: str, board: Board, member: int, max_size: int, *, timeout_s: float = 60.0,
                 eplb_group: bool = False, gloo_host: str = "127.0.0.1") -> None:
        """``board``: this member's client of the run's store (each build gets a clone of its own).
        ``eplb_group``: every generation of two or more members also builds a group for the EPLB worker.
        ``gloo_host``: where its groups listen (``store.address_towards`` the run's store)."""
        self.name, self.board, self.member, self.max_size = name, board, member, max_size
        self.gloo_host = gloo_host
        self.with_eplb_group = eplb_group
        self.timeout = timedelta(seconds=timeout_s)
        self.generation: Generation | None = None
        self._groups: GenerationGroups | None = None
        self.standby: StandbyBuild | None = None
        self._solo = False
        self.collectives = 0  # entered through ``current`` in this generation (the keep-alive reports it)
        EP_GROUPS.register(name, self)

    # -- what the ops read --------------------------------------------------------------

    def current(self) -> tuple[dist.ProcessGroup | None, int, int]:
        if self._solo:
            return None, 0, 1
        if self.generation is None:
            raise ElasticGroupError(f"member {self.member} has not joined EP group {self.name!r} yet")
        self.collectives += 1
        return self.process_group, self.rank, self.size

    def counted(self) -> tuple[int | None, int]:
        """(the generation serving, the collectives entered through ``current`` in it)."""
        return (None if self.generation is None else self.generation.index), self.collectives

    @property
    def rank(self) -> int:
        return self.generation.rank_of(self.member)

    @property
    def size(self) -> int:
        return self.generation.size

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self._groups.ep if self._groups is not None else None

    @property
    def eplb_process_group(self) -> dist.ProcessGroup | None:
        """The EPLB worker's group of this generation (None for one member, or without ``eplb_group``)."""
        return self._groups.eplb if self._groups is not None else None

    # -- building and switching generations ---------------------------------------------

    def _build(self, generation: Generation, board: Board) -> GenerationGroups | None:
        if generation.size > self.max_size:
            raise ValueError(f"generation {generation.index} has {generation.size} members, more than "
                             f"the group's maximum {self.max_size}")
        if generation.size == 1:
            return None
        rank = generation.rank_of(self.member)
        ep = gloo_process_group(board.gloo_store(generation.index, "pg"), rank, generation.size, self.timeout,
                                self.gloo_host)
        eplb = None
        if self.with_eplb_group:
            eplb = gloo_process_group(board.gloo_store(generation.index, "eplb"), rank, generation.size,
                                      self.timeout, self.gloo_host)
        return GenerationGroups(ep, eplb)

    def build_standby(self, generation: Generation, after_build: Callable[[dist.ProcessGroup], None] | None = None) -> None:
        """Starts building ``generation``'s groups on a thread; the current group keeps serving."""
        if self.standby is not None:
            raise ElasticGroupError(f"a standby generation of EP group {self.name!r} is already being built")
        board = self.board.clone()  # a store client is not safe to share between threads
        self.standby = StandbyBuild(lambda: self._build(generation, board), generation, after_build, self.name)

    def switch_when_built(self, generation: Generation, given_up: Callable[[], bool],
                          after_build: Callable[[dist.ProcessGroup], None] | None = None,
                          poll: Callable[[], None] = lambda: None) -> bool:
        """Builds ``generation``'s groups on a thread and makes them current; False, the build given
        up, where ``given_up()`` turns true first (polled: a build blocked on a member that died
        before its rendezvous would otherwise wait out the whole timeout). ``poll`` runs at each
        look (the keep-alive's progress). A failed build raises ``ElasticGroupError``."""
        self.build_standby(generation, after_build)
        while not self.standby.done(0.05):
            poll()
            if given_up():
                self.abandon_standby()
                return False
        self.switch_()
        return True

    def switch_(self) -> Generation:
        """The standby generation becomes current (between two steps); the old groups are dropped."""
        if self.standby is None or not self.standby.done():
            raise ElasticGroupError(f"EP group {self.name!r} has no standby generation built to switch to")
        standby, self.standby = self.standby, None
        self._replace(standby.generation, standby.take())
        return standby.generation

    def abandon_standby(self) -> None:
        """Gives the standby generation up without waiting for it."""
        standby, self.standby = self.standby, None
        if standby is not None:
            standby.give_up()

    @contextlib.contextmanager
    def solo(self) -> Iterator[None]:
        """Within: the ops see a group of one with this member as rank 0 (a joining member's
        warm-up compiles its graphs before it serves; shapes do not depend on the size)."""
        saved, self._solo = self._solo, True
        try:
            yield
        finally:
            self._solo = saved

    def _replace(self, generation: Generation, groups: GenerationGroups | None) -> None:
        self._drop_groups()
        self._groups, self.generation = groups, generation
        self.collectives = 0  # every member of a generation enters its collectives in the same order

    def _drop_groups(self) -> None:
        """Drops the current groups; their connections close as the last reference goes."""
        if self._groups is None:
            return
        refs = [weakref.ref(pg) for pg in self._groups if pg is not None]
        self._groups = None
        held = sum(ref() is not None for ref in refs)
        if held:  # something still holds a group: its peers fail at their timeout, not at once
            log.warning("member %d: %d process groups of EP group %r outlive their generation", self.member,
                        held, self.name)

    def abort(self) -> None:
        """The current group lost a member: drop its groups, keeping the generation, so a peer still
        waiting inside one of their collectives fails at once."""
        self._drop_groups()

    def leave(self) -> None:
        """This member is not in the next generation, or the run ends: its groups go."""
        self.abandon_standby()
        self._drop_groups()
        self.generation = None
        EP_GROUPS.unregister(self.name)
