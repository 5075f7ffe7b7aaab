"""An elastic EP group: its members and gloo groups kept in a TCP store, one generation at a time.

Every process of an elastic run is a *member* with a fixed id. Generation ``g`` of the
group is the list of member ids in rank order, written once under ``<name>/gen<g>/members``
in a ``torch.distributed.TCPStore`` that another launcher (torchrun, Ray) could host as
well as ours; a member that is in it builds the generation's gloo group from the same store
(upstream's stateless ``init_gloo_process_group``: no default process group, so groups of
different sizes can be built while one serves). The old generation keeps serving while the
next one is built (``build_standby`` runs in a thread); ``switch_`` makes it current between
two steps. ``ElasticEpGroup`` is also the slot the EP collective ops resolve by name
(``custom_ops/ep_collectives.py``), so every graph follows the switch.
"""

from __future__ import annotations

import contextlib
import gc
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch.distributed as dist

from eplb_graph.custom_ops import EP_GROUPS


class GenerationGroups(NamedTuple):
    """One generation's gloo groups: ``ep`` for the forwards and the members' control, ``eplb`` for
    upstream's async EPLB worker, whose collectives run on another thread (one group shared
    by two threads would interleave their collectives differently on each rank)."""

    ep: dist.ProcessGroup
    eplb: dist.ProcessGroup | None

    def shutdown(self) -> None:
        for pg in self:
            if pg is not None:
                pg.shutdown()


class ElasticGroupError(RuntimeError):
    """A generation could not be built or joined in time; the current one keeps serving."""


@dataclass(frozen=True)
class Generation:
    index: int
    members: tuple[int, ...]  # member ids in rank order

    @property
    def size(self) -> int:
        return len(self.members)

    def rank_of(self, member: int) -> int:
        return self.members.index(member)


def members_key(name: str, generation: int) -> str:
    return f"{name}/gen{generation}/members"


def announce_generation(store: dist.Store, name: str, generation: Generation) -> None:
    """What the coordinator writes: the members of a new generation, in rank order."""
    if len(set(generation.members)) != generation.size or generation.size < 1:
        raise ValueError(f"a generation needs distinct members, got {list(generation.members)}")
    store.set(members_key(name, generation.index), json.dumps(list(generation.members)))


def read_generation(store: dist.Store, name: str, index: int, timeout_s: float) -> Generation:
    key = members_key(name, index)
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError as error:  # DistStoreError: the wait timed out
        raise ElasticGroupError(f"generation {index} of EP group {name!r} was not announced within "
                                f"{timeout_s:.0f} s") from error
    return Generation(index, tuple(json.loads(store.get(key))))


def generation_announced(store: dist.Store, name: str, index: int) -> bool:
    return store.check([members_key(name, index)])


class ElasticEpGroup:
    """This member's EP group now, and the next generation while it is being built."""

    def __init__(self, name: str, store: dist.Store, member: int, max_size: int, *, timeout_s: float = 60.0,
                 connect: Callable[[], dist.Store] | None = None, eplb_group: bool = False) -> None:
        """``connect``: a new client of the same store, for the standby thread (a store client is
        not safe to share between threads); None: ``store`` itself (standbys built one at a time
        with nothing else using the store meanwhile, as in tests). ``eplb_group``: every
        generation of two or more members also builds a group for the EPLB worker."""
        self.name, self.store, self.member, self.max_size = name, store, member, max_size
        self.connect = connect
        self.with_eplb_group = eplb_group
        self.timeout = timedelta(seconds=timeout_s)
        self.generation: Generation | None = None
        self._groups: GenerationGroups | None = None
        self._standby: tuple[Generation, GenerationGroups | None] | None = None
        self._standby_error: BaseException | None = None
        self._standby_thread: threading.Thread | None = None
        self._solo = False
        EP_GROUPS.register(name, self)

    # -- what the ops read --------------------------------------------------------------

    def current(self) -> tuple[dist.ProcessGroup | None, int, int]:
        if self._solo:
            return None, 0, 1
        if self.generation is None:
            raise ElasticGroupError(f"member {self.member} has not joined EP group {self.name!r} yet")
        return self.process_group, self.rank, self.size

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

    def _build(self, generation: Generation, store: dist.Store | None = None) -> GenerationGroups | None:
        if generation.size > self.max_size:
            raise ValueError(f"generation {generation.index} has {generation.size} members, more than "
                             f"the group's maximum {self.max_size}")
        if generation.size == 1:
            return None
        from vllm.distributed.utils import init_gloo_process_group

        def build(kind: str) -> dist.ProcessGroup:
            prefix = dist.PrefixStore(f"{self.name}/gen{generation.index}/{kind}/", store or self.store)
            return init_gloo_process_group(prefix, generation.rank_of(self.member), generation.size, self.timeout)

        ep = build("pg")
        try:
            return GenerationGroups(ep, build("eplb") if self.with_eplb_group else None)
        except BaseException:
            ep.shutdown()
            raise

    def join(self, index: int) -> Generation:
        """Blocks until generation ``index`` is announced and its group is built; makes it current."""
        generation = read_generation(self.store, self.name, index, self.timeout.total_seconds())
        self._replace(generation, self._build(generation))
        return generation

    def build_standby(self, generation: Generation, after_build: Callable[[dist.ProcessGroup], None] | None = None) -> None:
        """Starts building ``generation``'s group in a thread; the current group keeps serving.
        ``after_build(group)`` runs on that thread once it is built (rank 0 sends joiners their state)."""
        if self._standby_thread is not None:
            raise ElasticGroupError(f"a standby generation of EP group {self.name!r} is already being built")
        self._standby, self._standby_error = None, None

        def build() -> None:
            try:
                groups = self._build(generation, self.connect() if self.connect is not None else None)
                threading.current_thread().built = groups  # for an abandoned build to release
                self._standby = (generation, groups)
                if after_build is not None and groups is not None:
                    after_build(groups.ep)
            except BaseException as error:  # reported by standby_failed / switch_
                self._standby_error = error

        self._standby_thread = threading.Thread(target=build, name=f"{self.name}-standby", daemon=True)
        self._standby_thread.start()

    def standby_ready(self) -> bool:
        """The standby group is built (or its build failed: ``switch_`` raises that)."""
        return self._standby_thread is not None and not self._standby_thread.is_alive()

    def standby_failed(self) -> BaseException | None:
        return self._standby_error if self.standby_ready() else None

    def wait_standby(self, timeout_s: float) -> bool:
        """Blocks up to ``timeout_s`` for the standby build (and its ``after_build``); True once it ended."""
        if self._standby_thread is None:
            raise ElasticGroupError(f"EP group {self.name!r} has no standby generation being built")
        self._standby_thread.join(timeout_s)
        return self.standby_ready()

    def switch_when_built(self, generation: Generation, given_up: Callable[[], bool],
                          after_build: Callable[[dist.ProcessGroup], None] | None = None) -> bool:
        """Builds ``generation``'s group on a thread and makes it current; False, with the build
        abandoned, where ``given_up()`` turns true first (polled: a build blocked on a member that
        died before its rendezvous would otherwise wait out the whole timeout). A failed build
        raises ``ElasticGroupError``."""
        self.build_standby(generation, after_build)
        while not self.wait_standby(0.05):
            if given_up():
                self.abandon_standby()
                return False
        self.switch_()
        return True

    def switch_(self) -> Generation:
        """The standby generation becomes current (between two steps); the old group is shut down."""
        if not self.standby_ready():
            raise ElasticGroupError(f"EP group {self.name!r} has no standby generation built to switch to")
        self._standby_thread = None
        if self._standby_error is not None:
            if self._standby is not None and self._standby[1] is not None:  # built, then its after_build failed
                self._standby[1].shutdown()
            self._standby = None
            raise ElasticGroupError(f"building the standby EP group failed: {self._standby_error}") from self._standby_error
        generation, groups = self._standby
        self._standby = None
        self._replace(generation, groups)
        return generation

    def abandon_standby(self) -> None:
        """Gives the standby generation up without waiting for it: a build still blocked on a
        member that never came ends by its own timeout, and its group is then shut down."""
        thread, self._standby_thread = self._standby_thread, None
        standby, self._standby, self._standby_error = self._standby, None, None
        if thread is not None and thread.is_alive():
            def release() -> None:
                thread.join()
                built = getattr(thread, "built", None)
                if built is not None:
                    built.shutdown()
            threading.Thread(target=release, name=f"{self.name}-abandon", daemon=True).start()
        elif standby is not None and standby[1] is not None:
            standby[1].shutdown()

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
        old, self._groups, self.generation = self._groups, groups, generation
        if old is not None:
            old.shutdown()

    def abort(self) -> None:
        """The current group lost a member: destroy it, keeping the generation. Only destroying the
        last reference closes its connections (``shutdown`` does not), so a peer still waiting
        inside one of its collectives fails at once instead of at the group's timeout."""
        if self._groups is not None:
            self._groups.shutdown()
            self._groups = None
            gc.collect()

    def leave(self) -> None:
        """This member is not in the next generation, or the run ends: its group goes."""
        self.abandon_standby()
        if self._groups is not None:
            self._groups.shutdown()
        self._groups, self.generation = None, None
        EP_GROUPS.unregister(self.name)
