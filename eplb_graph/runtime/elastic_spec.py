"""What the members of one elastic run share (``ElasticSpec``) and what each reports (``MemberResult``).

The coordinator (``elastic_run``, ``elastic_server``) hands every member process the same
spec; members meet in its TCP store, under keys it names. A resize given up writes
``ABANDONED`` as its generation's switch value, which a joining member waiting for that
switch reads as ``ResizeAbandoned``, and a member of the serving group (``settle_switch``)
as ``LostPeer``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from eplb_graph.runtime.config import RunConfig


@dataclass(frozen=True)
class ElasticSpec:
    """What every member of one elastic run shares."""

    cfg: RunConfig  # cfg.ranks: the first generation's size
    max_ranks: int
    store_host: str
    store_port: int
    name: str = "ep"
    deadline_s: float = 30.0  # announced -> switched, or the resize is given up
    timeout_s: float = 60.0  # any one collective or store wait
    expert_source: str | None = None  # the experts on disk: a member that dies is recovered from it

    def connect(self) -> dist.TCPStore:
        """A new client of the run's store (one per thread that uses it)."""
        return dist.TCPStore(self.store_host, self.store_port, is_master=False,
                             timeout=timedelta(seconds=self.timeout_s))

    def key(self, *parts: object) -> str:
        return "/".join([self.name, *map(str, parts)])


@dataclass
class MemberResult:
    member: int
    step_end_s: list[float] = field(default_factory=list)  # monotonic, system-wide: comparable across processes
    step_size: list[int] = field(default_factory=list)  # the group's size at each step
    steps: list[int] = field(default_factory=list)
    output_mismatches: int = 0
    max_abs_diff: float = 0.0
    recompiles: int = 0  # after warm-up: on the serving path
    tokens: int = 0
    resizes: list[dict] = field(default_factory=list)  # per switch this member took part in
    abandoned: list[int] = field(default_factory=list)  # generations given up
    state_bytes_sent: int = 0
    join_prepare_s: float | None = None  # a joiner: assigned -> ready (group built, state received)
    left_at_step: int | None = None
    recoveries: list[dict] = field(default_factory=list)
    eplb: dict = field(default_factory=dict)  # upstream's EPLB between resizes, per generation (ElasticEplb.summary)


ABANDONED = "abandoned"  # the value of a generation's switch key when its resize was given up


class ResizeAbandoned(RuntimeError):
    """A joining member's resize was given up before it switched: it leaves without serving."""


class LostPeer(RuntimeError):
    """A member learned from the coordinator, not from a collective, that its group lost a peer."""


def given_up(store: dist.Store, key: str) -> bool:
    """The generation whose switch ``key`` names was given up (its switch holds ``ABANDONED``)."""
    return store.check([key]) and store.get(key).decode() == ABANDONED


def settle_switch(store: dist.Store, key: str, value: str, *, commit: bool, timeout_s: float) -> None:
    """A resize's commit point, with one outcome for every member of the serving group: rank 0
    (``commit``) writes its switch ``value`` unless the coordinator wrote ``ABANDONED`` first (a
    member died), and the others wait to read which of the two won, so no member switches while
    another recovers. Raises ``LostPeer`` where the resize was given up or nothing was written."""
    if commit:
        won = store.compare_set(key, "", value).decode()
    else:
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError:  # DistStoreError: rank 0 neither switched nor died where the coordinator saw it
            raise LostPeer(f"no switch was written under {key} within {timeout_s:.0f} s") from None
        won = store.get(key).decode()
    if won == ABANDONED:
        raise LostPeer(f"the resize was given up ({key}): a member of the serving group died")
