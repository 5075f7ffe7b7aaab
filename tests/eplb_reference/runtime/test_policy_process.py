"""Upstream's policy in a helper process: same placements, errors that name the cause, no hang."""

import os
import signal

import pytest
import torch

from eplb_reference.runtime.policy_process import PolicyProcess, PolicyProcessError
from tests.eplb_reference.runtime.policy_cases import FailingPolicy, PidPolicy, SlowPolicy

pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast


@pytest.fixture(scope="module")
def pid_helper():
    helper = PolicyProcess(PidPolicy)
    yield helper
    helper.close()


def test_the_policy_runs_in_the_helper_and_its_stdout_cannot_corrupt_the_reply(pid_helper):
    placement = pid_helper.rebalance_experts(torch.zeros(3, 4), 6, 1, 1, 2)
    assert placement.shape == (3, 6) and placement.dtype == torch.int64
    assert set(placement.flatten().tolist()) == {pid_helper.pid}
    assert pid_helper.pid != os.getpid()
    assert pid_helper.rebalance_experts(torch.zeros(1, 2), 2, 1, 1, 1).tolist() == [[pid_helper.pid] * 2]  # reusable


def test_placements_equal_upstream_default_policy_in_process():
    DefaultEplbPolicy = pytest.importorskip("vllm.distributed.eplb.policy.default").DefaultEplbPolicy
    helper = PolicyProcess(DefaultEplbPolicy)
    try:
        gen = torch.Generator().manual_seed(3)
        for layers, logical, redundant, groups, nodes, ranks in [(2, 16, 4, 1, 1, 2), (3, 32, 8, 4, 2, 4)]:
            load = torch.randint(0, 1000, (layers, logical), generator=gen)  # [L, N]
            current = torch.cat([torch.arange(logical), torch.arange(redundant) % logical]).repeat(layers, 1)
            args = (load, logical + redundant, groups, nodes, ranks, current)
            assert torch.equal(helper.rebalance_experts(*args), DefaultEplbPolicy.rebalance_experts(*args))
    finally:
        helper.close()
    assert helper._process.returncode == 0  # closing its stdin ends it cleanly


def test_a_failing_policy_raises_with_its_traceback_and_the_helper_serves_on():
    helper = PolicyProcess(FailingPolicy)
    try:
        with pytest.raises(PolicyProcessError, match=r"FailingPolicy rebalance_experts failed(.|\n)*cannot place 5"):
            helper.rebalance_experts(torch.zeros(1, 2), 5, 1, 1, 1)
        with pytest.raises(PolicyProcessError, match="cannot place 7"):
            helper.rebalance_experts(torch.zeros(1, 2), 7, 1, 1, 1)
    finally:
        helper.close()


def test_a_silent_helper_is_stopped_so_its_late_reply_cannot_answer_the_next_call():
    helper = PolicyProcess(SlowPolicy, timeout_s=0.5)
    try:
        old = torch.arange(4).unsqueeze(0)
        assert torch.equal(helper.rebalance_experts(torch.zeros(1, 2), 4, 1, 1, 1, old), old)
        with pytest.raises(PolicyProcessError, match=r"did not answer 'rebalance' within 0.5 s; stopped it"):
            helper.rebalance_experts(torch.full((1, 2), 30.0), 4, 1, 1, 1, old)
        with pytest.raises(PolicyProcessError, match=f"pid {helper.pid}.*has exited"):
            helper.rebalance_experts(torch.zeros(1, 2), 4, 1, 1, 1, old)
    finally:
        helper.close()


def test_a_killed_helper_is_an_error_naming_it():
    helper = PolicyProcess(PidPolicy)
    try:
        os.kill(helper.pid, signal.SIGKILL)
        helper._process.wait(timeout=10)
        with pytest.raises(PolicyProcessError, match=f"pid {helper.pid}.*exited with code -9"):
            helper.rebalance_experts(torch.zeros(1, 2), 2, 1, 1, 1)
    finally:
        helper.close()


def test_something_that_is_not_a_policy_is_refused_before_a_process_starts():
    with pytest.raises(TypeError, match="has no rebalance_experts"):
        PolicyProcess(object)
    with pytest.raises(ValueError, match="timeouts must be > 0 seconds, got timeout_s=0"):
        PolicyProcess(PidPolicy, timeout_s=0)
