"""What the members of one elastic run share (``ElasticSpec``) and what each reports (``MemberResult``).

The coordinator hosts the run's TCP store and publishes the spec in it, so a member started
anywhere (``eplb-graph join --store HOST:PORT``) reads the same spec its own members get.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta

import torch.distributed as dist

from eplb_reference.runtime.config import RunConfig
from eplb_reference.elastic.liveness import BEHIND_HANG_BOUNDS
from eplb_reference.elastic.protocol import Board, RunSecret


@dataclass(frozen=True)
class ServeShape:
    rows: int = 4  # requests batched per member per step
    seq: int = 16  # prompt + generated tokens per request, at most

    def check(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1 or max_new_tokens < 1:
            raise ValueError(f"a request needs a prompt and at least one new token, got {prompt_len} and "
                             f"{max_new_tokens}")
        if prompt_len + max_new_tokens > self.seq:
            raise ValueError(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the server's "
                             f"{self.seq} tokens per request")


@dataclass(frozen=True)
class ElasticSpec:
    """What every member of one elastic run shares."""

    cfg: RunConfig  # cfg.ranks: the first generation's size
    max_ranks: int
    store_host: str
    store_port: int
    name: str = "ep"
    deadline_s: float = 30.0  # released -> switched, or the resize is given up
    timeout_s: float = 60.0  # any one collective or wait on the coordinator
    hang_s: float = 10.0  # a member silent (or its main thread still) this long is fenced
    beat_s: float = 0.25  # keep-alive period
    expert_source: str | None = None  # the experts on disk: a member that dies is recovered from it
    serve: ServeShape | None = None  # serving requests (``eplb-graph serve``); None: the scripted workload
    chaos: bool = False  # members take fault injection (``chaos.py``): tests and the chaos run only

    @property
    def detection_bound_s(self) -> float:
        """How long a loss may take to be known: the failure detector's longest rule ("behind",
        twice ``hang_s``), a keep-alive late by a beat, and the coordinator's look."""
        return BEHIND_HANG_BOUNDS * self.hang_s + 2 * self.beat_s + 2.0

    @property
    def group_name(self) -> str:
        """The EP group slot's name, as the graphs hold it: with the maximum size, which the EP ops'
        shapes are traced from, so a compiled graph cached for another maximum never matches."""
        return f"{self.name}-max{self.max_ranks}"

    def connect(self, secret: RunSecret) -> Board:
        """A new client of the run's store (one per thread that uses it), sealing with ``secret``."""
        store = dist.TCPStore(self.store_host, self.store_port, is_master=False,
                              timeout=timedelta(seconds=self.timeout_s))
        return Board(store, self.name, secret)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str, store_host: str | None = None) -> ElasticSpec:
        """The spec a coordinator published; ``store_host`` as the reader reaches the store."""
        fields = json.loads(text)
        cfg = fields.pop("cfg")
        cfg["capture_sizes"] = tuple(cfg["capture_sizes"])
        serve = fields.pop("serve")
        spec = ElasticSpec(RunConfig(**cfg), serve=None if serve is None else ServeShape(**serve), **fields)
        return spec if store_host is None else replace(spec, store_host=store_host)


@dataclass
class MemberResult:
    member: int
    step_end_s: list[float] = field(default_factory=list)  # monotonic, system-wide: comparable across processes
    step_size: list[int] = field(default_factory=list)  # the group's size at each step
    steps: list[int] = field(default_factory=list)
    control_ms: list[float] = field(default_factory=list)  # per step served: its store reads and control all-reduce
    control_ms_last: list[float] = field(default_factory=list)  # a server member: control_ms holds the first ones
    steps_served: int = 0
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
    abandoned_join: str | None = None  # a joiner whose resize was given up: why (it never served)
    store_values_dropped: dict[str, int] = field(default_factory=dict)  # by kind: unproven fences, stops, ...
