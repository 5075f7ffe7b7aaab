"""The bench harness: several models stepped side by side in one process, so noise hits all alike.

``prepare_models`` compiles (graph mode: captures) each model and runs its first, compiling
step untimed; ``rotating_steps`` then runs every model once per step on the same batch, the
order rotating so each leads as often as the others. Used by ``capture_vs_eager`` (EPLB
off / on_idle / the A/A twin in each rank process), the data-plane bench and
``bench_injected_work.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from eplb_reference.runtime.compile import prepare_step
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.launch import Heartbeat
from eplb_reference.runtime.step import TimedStep, timed_step
from eplb_reference.runtime.workload import Batch, make_batch

if TYPE_CHECKING:
    from eplb_reference.runtime.controller import EplbController


def decode_batches(cfg: RunConfig, rank: int, device: torch.device) -> list[Batch]:
    """This rank's decode batches of the workload (its steps 1..7), on the device."""
    workload = cfg.workload()
    return [make_batch(workload, step, rank).to(device) for step in range(1, 8)]


class StepHooks(Protocol):
    """What a timed step calls around a forward: ``EplbController``, or a stand-in without a control plane."""

    def begin_batch(self, *, num_unpadded_tokens: int, is_prefill: bool) -> object: ...

    def end_batch(self) -> None: ...


def rotating_steps(forwards: dict[str, Callable], controllers: dict[str, EplbController | StepHooks | None],
                   batches: list[Batch], steps: int, device: torch.device,
                   heartbeat: Heartbeat | None = None,
                   after_step: Callable[[dict[str, torch.Tensor]], None] | None = None,
                   address_checks: dict[str, Callable[[], object]] | None = None) -> dict[str, list[TimedStep]]:
    """Every forward once per step on the same batch, the order rotating so each leads a step as
    often as the others: side by side in one process, the machine's noise hits all alike.
    ``heartbeat`` beats after each step (see ``eplb_reference.runtime.launch``); ``after_step`` gets the
    step's outputs by name, untimed, before the next step (a replayed graph overwrites its
    output buffer). ``address_checks``: name -> its captured forward's ``check_addresses``,
    run untimed after each of its steps."""
    names = list(forwards)
    address_checks = address_checks or {}
    timed: dict[str, list[TimedStep]] = {name: [] for name in names}
    for step in range(steps):
        batch = batches[step % len(batches)]
        first = step % len(names)
        for name in names[first:] + names[:first]:
            timed[name].append(timed_step(forwards[name], batch, device, controllers.get(name),
                                          after=address_checks.get(name)))
        if after_step is not None:
            after_step({name: timed[name][-1].out for name in names})
        if heartbeat is not None:
            heartbeat.beat()
    return timed


@dataclasses.dataclass
class PreparedModels:
    forwards: dict[str, Callable]  # name -> the step's callable (model, compiled, or captured)
    captured: dict[str, object | None]  # name -> its CapturedForward, None where nothing is captured
    compile_s: dict[str, float]  # name -> compile or capture time, its first (compiling) step included
    decode: list[Batch]  # the decode batches every model steps through

    @property
    def address_checks(self) -> dict[str, Callable[[], int]]:
        """name -> its CapturedForward's check between steps (where a graph was captured)."""
        return {name: c.check_addresses for name, c in self.captured.items() if c is not None}

    @property
    def recaptures(self) -> dict[str, int | None]:
        return {name: None if c is None else c.stats.recaptures for name, c in self.captured.items()}


def prepare_models(models: dict[str, tuple], controllers: dict[str, StepHooks], cfg: RunConfig, rank: int,
                   device: torch.device) -> PreparedModels:
    """Compiles (graph mode: captures) each model in order and runs its first step, untimed.
    ``models``: name -> (model, its RunConfig, its RankLayers, its flags)."""
    compile_s, captured, forwards = {}, {}, {}
    for name, (model, run_cfg, rank_layers, flags) in models.items():
        start = time.perf_counter()
        forwards[name], captured[name] = prepare_step(model, run_cfg, rank_layers, flags, [])
        compile_s[name] = time.perf_counter() - start
    decode = decode_batches(cfg, rank, device)
    for name, forward in forwards.items():  # first call: compiles (graph mode captured already)
        compile_s[name] += timed_step(forward, decode[0], device, controllers.get(name)).seconds
    return PreparedModels(forwards, captured, compile_s, decode)


def paired_models(on: tuple, off: tuple, twin: tuple, on_cfg: RunConfig, off_cfg: RunConfig) -> dict[str, tuple]:
    """The three models of a paired run, each ``build_rank_models``' (model, reference,
    RankLayers, flags), as ``prepare_models`` takes them, in compile order: the twin compiles
    first, since the process's first compile pays the cold caches, which would otherwise make
    "off" look several times costlier to compile than "on_idle"."""
    on_model, _, on_layers, on_flags = on
    off_model, _, _, off_flags = off
    twin_model, _, _, twin_flags = twin
    return {"off_twin": (twin_model, off_cfg, [], twin_flags), "off": (off_model, off_cfg, [], off_flags),
            "on_idle": (on_model, on_cfg, on_layers, on_flags)}


def paired_times(timed: dict[str, list[TimedStep]]) -> dict[str, list[float]]:
    """Step times in ms by model, and on_idle's EPLB host part (begin_batch + end_batch)."""
    times = {name: [t.seconds * 1e3 for t in steps] for name, steps in timed.items()}
    times["on_idle_eplb_host"] = [t.eplb_host_s * 1e3 for t in timed["on_idle"]]
    return times
