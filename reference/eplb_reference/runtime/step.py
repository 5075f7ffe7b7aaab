"""One timed step of the runtime, as a server runs it, and what every rank process sets up first.

``timed_step`` counts EPLB's host work before and after the forward (``begin_batch`` /
``end_batch``, where upstream steps and layers commit) in the step's time; bookkeeping the
harness needs runs untimed beside it. ``check_output`` is the per-step comparison with the
no-EPLB reference.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.workload import Batch


@dataclass(frozen=True)
class OutputCheck:
    ok: bool
    max_abs_diff: float  # over the entries finite in both outputs
    nonfinite: bool  # the EPLB output has NaN/Inf where the reference is finite


def check_output(out: torch.Tensor, expected: torch.Tensor, tolerance: float) -> OutputCheck:
    """One step's output against the no-EPLB reference. At tolerance 0 this is exact equality
    (0.0 and -0.0 compare equal); NaN where the reference has NaN too counts as equal (the
    model's, not EPLB's), and a NaN or Inf only in ``out`` is a mismatch that ``max_abs_diff``
    alone would hide (NaN compares false), so it is flagged on its own."""
    finite_out, finite_expected = torch.isfinite(out), torch.isfinite(expected)
    both = finite_out & finite_expected
    diff = (out - expected).abs()[both]
    return OutputCheck(
        ok=torch.allclose(out, expected, rtol=tolerance, atol=tolerance, equal_nan=True),
        max_abs_diff=float(diff.max()) if diff.numel() else 0.0,
        nonfinite=bool((finite_expected & ~finite_out).any()),
    )


def rank_device(cfg: RunConfig) -> torch.device:
    """This rank's device with its index: threads started later (upstream's async worker)
    default to device 0 unless told which device their rank owns."""
    if cfg.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())  # set by rank_session
    if cfg.device == "npu":
        return torch.device("npu", torch.npu.current_device())  # set by rank_session
    return torch.device(cfg.device)


def synchronize(device: torch.device) -> None:
    """Before reading a step's time: device work is asynchronous."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


@dataclass
class TimedStep:
    out: torch.Tensor
    seconds: float  # begin_batch + forward (synchronized) + end_batch
    eplb_host_s: float  # of which begin_batch + end_batch: upstream's step, rearrange, layer commits


def timed_step(forward, batch: Batch, device: torch.device, controller=None, between=None,
               after=None) -> TimedStep:
    """One step as a server runs it: EPLB's host work before and after the forward counts;
    ``between`` (bookkeeping that must read the pass's load before ``end_batch`` folds it into
    upstream's window) and ``after`` (a captured forward's address check, once the step's
    commits are done) run untimed."""
    start = time.perf_counter()
    if controller is not None:
        controller.begin_batch(num_unpadded_tokens=batch.num_tokens, is_prefill=batch.is_prefill)
    forward_start = time.perf_counter()
    out = forward(batch.tokens)
    synchronize(device)
    forward_end = time.perf_counter()
    if between is not None:
        between()
    end_start = time.perf_counter()
    if controller is not None:
        controller.end_batch()
        synchronize(device)
    end = time.perf_counter()
    if after is not None:
        after()
    return TimedStep(out, forward_end - start + end - end_start, forward_start - start + end - end_start)


def rank_threads(cfg: RunConfig, local_world: int) -> int:
    """torch intra-op threads for one rank's process: ``cfg.threads`` if given. Otherwise, on
    the host, where the forward computes, this machine's cores (torch's default count, which
    OMP_NUM_THREADS sets) shared among its ranks; on a device, one, as vLLM's GPU worker serves
    (``set_torch_threads_for_runtime``): the device computes, and idle OpenMP workers spin after
    each host op, taking cycles from the step's Python and from EPLB's worker thread."""
    if cfg.threads is not None:
        return cfg.threads
    if cfg.device != "cpu":
        return 1
    return max(1, torch.get_num_threads() // local_world)


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op thread count for a block, restored after it: for a process that is the
    one rank only for a while (the data-plane bench runs in the CLI's process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
