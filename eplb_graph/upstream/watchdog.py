"""A rearrangement that stopped progressing, surfaced instead of leaving EPLB quietly off.

Upstream's async worker can block with a rearrangement in flight while the engine keeps
stepping: no layer commits, no error, no metric (vllm#57883). The caller of upstream's
``step()`` tells the watchdog after every step whether a rearrangement is in flight and how
many layers have committed so far; a rearrangement in flight for more than ``max_steps``
steps or ``max_seconds`` seconds without a layer committing is a stall. Serving goes on with
the last committed placement either way (routing only reads committed placements); the
watchdog counts the stall, warns once per stall, or raises where the caller asked for that.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass


class EplbStallWarning(RuntimeWarning):
    """A rearrangement is in flight with no layer committed for longer than the watchdog's bound."""


class EplbStallError(RuntimeError):
    """The same, where the caller asked for an error (``on_stall="error"``)."""


ON_STALL = ("warn", "error")
logger = logging.getLogger(__name__)  # a server's log shows every stall; a warning may be shown once


@dataclass(frozen=True)
class StallBound:
    """How long a rearrangement may go without a layer committing."""

    max_steps: int = 1000
    max_seconds: float = 300.0
    on_stall: str = "warn"

    def validate(self, names: tuple[str, str, str] = ("stall steps", "stall seconds", "on_stall")) -> None:
        """ValueError naming the option (``names``: how the caller spells the three), before anything starts."""
        steps, seconds, on_stall = names
        if not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"{steps} must be an int >= 1, got {self.max_steps!r}")
        if not self.max_seconds > 0:
            raise ValueError(f"{seconds} must be > 0, got {self.max_seconds!r}")
        if self.on_stall not in ON_STALL:
            raise ValueError(f"{on_stall} must be one of {', '.join(ON_STALL)}, got {self.on_stall!r}")


ENV = ("EPLB_GRAPH_STALL_STEPS", "EPLB_GRAPH_STALL_SECONDS", "EPLB_GRAPH_ON_STALL")


def stall_bound_from_env(environ: Mapping[str, str]) -> StallBound:
    """The bound a process without flags (a vLLM worker) takes from its environment, checked."""
    steps, seconds, on_stall = ENV
    default = StallBound()
    try:
        bound = StallBound(int(environ.get(steps, default.max_steps)), float(environ.get(seconds, default.max_seconds)),
                           environ.get(on_stall, default.on_stall))
    except ValueError as error:
        raise ValueError(f"{steps} / {seconds} must be numbers: {error}") from None
    bound.validate(ENV)
    return bound


class StallWatchdog:
    """Watches one process's rearrangements, step by step (see the module docstring)."""

    def __init__(self, bound: StallBound, *, clock: Callable[[], float] = time.monotonic) -> None:
        bound.validate()
        self.bound = bound
        self.clock = clock
        self.stalls = 0  # stalls seen, each counted once
        self._since: tuple[int, float] | None = None  # (step count, time) since the last progress
        self._committed = 0
        self._steps = 0
        self._reported = False

    def observe(self, *, in_flight: bool, layers_committed: int, where: str) -> None:
        """After each upstream step: whether a rearrangement is in flight and the commits so far."""
        self._steps += 1
        if not in_flight or layers_committed != self._committed:
            self._committed, self._reported = layers_committed, False
            self._since = (self._steps, self.clock()) if in_flight else None
            return
        if self._since is None:
            self._since = (self._steps, self.clock())
            return
        steps, seconds = self._steps - self._since[0], self.clock() - self._since[1]
        if self._reported or (steps <= self.bound.max_steps and seconds <= self.bound.max_seconds):
            return
        self._reported = True
        self.stalls += 1
        message = (f"EPLB rearrangement {where} stalled: in flight for {steps} steps and {seconds:.0f} s with no layer "
                   f"committed (bound: {self.bound.max_steps} steps or {self.bound.max_seconds:g} s); the last "
                   f"committed placement keeps serving")
        logger.warning(message)
        if self.bound.on_stall == "error":
            raise EplbStallError(message)
        warnings.warn(message, EplbStallWarning, stacklevel=3)
