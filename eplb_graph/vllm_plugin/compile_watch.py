"""Model graphs compiled while serving: made visible in vLLM's log, and counted.

Graph-mode EPLB must never recompile on the serving path: a rearrangement updates the lookup
tables in place, so the graphs compiled at warm-up keep serving. Every compiled graph of the
model that holds a MoE layer goes through our pass, which counts the layers it maps
(``VllmMoELayer.graph_mappings``); a count that moves after warm-up means such a graph was
compiled again while requests were waiting (a shape or a value froze into it). Other compiled
functions in the worker (vLLM compiles some sampler ops at their first use) hold no MoE layer
and are not counted.

The watch starts at the end of warm-up (the CPU runner's ``warming_up_model``) or, where a
runner has no such hook or skips it, after its first real (non-dummy) step; from then on it reads
the count once per step and logs a warning when it moved.
"""

from __future__ import annotations

import logging
from collections.abc import Callable


class CompileWatch:
    """Counts, from the end of warm-up, layer mappings our pass made; warns at each new compile."""

    def __init__(self, count: Callable[[], int], logger: logging.Logger) -> None:
        self.count = count  # MoE layers our pass mapped in compiled graphs so far (a graph with two counts two)
        self.logger = logger
        self.at_start: int | None = None  # None: warming up, compiles expected
        self.seen: int | None = None

    def start(self, after: str) -> None:
        """Compiles from now on are unexpected. Idempotent."""
        if self.at_start is not None:
            return
        self.at_start = self.seen = self.count()
        self.logger.info("eplb-graph: watching for compiles from %s on (the EPLB pass made %d layer mappings "
                         "before)", after, self.at_start)

    def since_start(self) -> int | None:
        """Layer mappings since the watch started; None before it started."""
        return None if self.at_start is None else self.count() - self.at_start

    def check(self) -> int | None:
        """After an engine step: the count since the start if it moved in this step (and a warning), else None."""
        if self.at_start is None:
            return None
        now = self.count()
        if now == self.seen:
            return None
        self.seen = now
        self.logger.warning("eplb-graph: a model graph was compiled while serving: %d layer mappings by the EPLB "
                            "pass since warm-up (a shape or value froze into a compiled graph)", now - self.at_start)
        return now - self.at_start
