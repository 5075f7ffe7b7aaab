"""Upstream's rebalancing policy in a helper process, off the serving process's GIL.

Upstream's async worker runs the policy (``EplbState.policy.rebalance_experts``: numpy and
Python loops) on a thread of the serving process. At DeepSeek-V3 size (58 MoE layers,
256 + 32 experts, 4 nodes, 32 ranks) one call is long next to a decode step, and meanwhile
the main thread -- the one that launches every graph replay -- waits for the GIL at each
switch interval (``benchmarks/bench_policy_stall.py`` measures both). ``PolicyProcess`` has the policy's call signature
and replaces ``EplbState.policy`` after upstream chose it: the worker thread hands the same
call to a helper process and blocks in a pipe read, GIL released, until the placement comes
back. Upstream's worker, its call site and its policy are unchanged.

The helper is a plain subprocess (rank processes are often daemonic, and multiprocessing
refuses them children) speaking length-prefixed pickles over its stdin / stdout: a request
is ``("rebalance", policy class, arguments as numpy arrays and ints)``, a reply ``("ok",
value)`` or ``("error", traceback text)`` -- a request that fails to unpickle included. Its own
output goes to stderr, so a log line can never corrupt a reply.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import threading
import traceback

import numpy as np
import torch


def send_frame(pipe, message: object) -> None:
    data = pickle.dumps(message)
    pipe.write(len(data).to_bytes(8, "little") + data)
    pipe.flush()


def read_frame(pipe) -> bytes:
    """One whole frame; EOFError if the pipe closes first."""
    def exactly(count: int) -> bytes:
        chunks = []
        while count:
            chunk = pipe.read(count)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    return exactly(int.from_bytes(exactly(8), "little"))


class PolicyProcessError(RuntimeError):
    """The helper failed, died or did not answer in time; no placement was produced."""


class PolicyProcess:
    """``policy.rebalance_experts`` computed in a helper process; one per EP rank."""

    def __init__(self, policy: type, *, timeout_s: float = 60.0, start_timeout_s: float = 120.0) -> None:
        if not callable(getattr(policy, "rebalance_experts", None)):
            raise TypeError(f"{policy!r} has no rebalance_experts; expected an upstream EPLB policy class")
        if not (timeout_s > 0 and start_timeout_s > 0):
            raise ValueError(f"timeouts must be > 0 seconds, got timeout_s={timeout_s}, start_timeout_s={start_timeout_s}")
        self.policy = policy
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one request in flight: the pipe carries no request ids
        self._process = subprocess.Popen(
            [sys.executable, "-m", "eplb_reference.runtime.policy_process"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            bufsize=0,
        )
        try:
            # the helper imports the policy's module now, not inside the first rearrangement
            self._call(("import", policy), start_timeout_s)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._process.pid

    def rebalance_experts(
        self,
        weight: torch.Tensor,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_global_expert_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Upstream's signature: weight [L, num_logical] load, old placement [L, num_physical];
        returns the new placement [L, num_physical] (CPU), as the policy computed it."""
        old = None if old_global_expert_indices is None else old_global_expert_indices.cpu().numpy()
        request = ("rebalance", self.policy, weight.cpu().numpy(), num_replicas, num_groups, num_nodes, num_ranks, old)
        return torch.from_numpy(self._call(request, self.timeout_s))

    def _call(self, request: tuple, timeout_s: float):
        with self._lock:
            if self._process.poll() is not None:
                raise PolicyProcessError(f"policy helper (pid {self.pid}) has exited with code {self._process.returncode}")
            try:
                send_frame(self._process.stdin, request)
            except BrokenPipeError:
                raise PolicyProcessError(f"policy helper (pid {self.pid}) is gone") from None
            ready, _, _ = select.select([self._process.stdout], [], [], timeout_s)  # GIL released while waiting
            if not ready:
                # its late reply would answer the next request: a helper that timed out is ended
                self._process.kill()
                self._process.wait()
                raise PolicyProcessError(
                    f"policy helper (pid {self.pid}) did not answer {request[0]!r} within {timeout_s} s; stopped it"
                )
            try:
                status, value = pickle.loads(read_frame(self._process.stdout))
            except EOFError:
                code = self._process.wait(timeout=5)
                raise PolicyProcessError(f"policy helper (pid {self.pid}) exited with code {code} during {request[0]!r}") from None
        if status != "ok":
            what = "rebalance_experts" if request[0] == "rebalance" else "loading"
            raise PolicyProcessError(f"{self.policy.__name__} {what} failed in the policy helper:\n{value}")
        return value

    def close(self) -> None:
        """Ends the helper (it exits when its stdin closes) and closes its pipes; idempotent."""
        try:
            self._process.stdin.close()
        except BrokenPipeError:  # it is gone already
            pass
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()


def _rebalance(policy: type, weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
               num_ranks: int, old: np.ndarray | None) -> np.ndarray:
    placement = policy.rebalance_experts(
        torch.from_numpy(weight), num_replicas, num_groups, num_nodes, num_ranks,
        None if old is None else torch.from_numpy(old),
    )
    return placement.cpu().numpy()


def serve(requests, replies) -> None:
    """The helper's loop: one reply per request, until stdin closes."""
    torch.set_num_threads(1)  # the policy is small and the ranks' cores are the serving process's
    while True:
        try:
            frame = read_frame(requests)
        except EOFError:
            return
        try:
            kind, *args = pickle.loads(frame)  # imports the policy's module on first use
            value = _rebalance(*args) if kind == "rebalance" else None  # "import": loading did it
            reply = ("ok", value)
        except Exception:
            reply = ("error", traceback.format_exc())
        send_frame(replies, reply)


if __name__ == "__main__":
    replies = os.fdopen(os.dup(1), "wb", buffering=0)  # the protocol keeps the real stdout ...
    os.dup2(2, 1)  # ... and anything the policy's imports print goes to stderr
    serve(os.fdopen(sys.stdin.fileno(), "rb", buffering=0, closefd=False), replies)
