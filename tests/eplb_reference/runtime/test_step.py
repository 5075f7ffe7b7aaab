"""One timed step: the output check against the reference, and each rank's threads."""

import torch

from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.step import OutputCheck, check_output


def test_rank_threads_follow_the_device_unless_asked():
    from eplb_reference.runtime.step import rank_threads

    cores = torch.get_num_threads()
    assert rank_threads(RunConfig(device="cpu"), 1) == cores  # the host computes: all its cores to one rank
    assert rank_threads(RunConfig(device="cpu"), cores + 1) == 1  # more ranks than cores: one each
    assert rank_threads(RunConfig(device="cuda"), 1) == 1  # the device computes: one, as vLLM's GPU worker
    assert rank_threads(RunConfig(device="cuda", threads=4), 1) == 4


def test_output_check_flags_nan_and_inf_that_a_max_diff_would_hide():
    expected = torch.tensor([[1.0, -2.0, 3.0]])
    assert check_output(expected.clone(), expected, 0.0) == OutputCheck(ok=True, max_abs_diff=0.0, nonfinite=False)
    off = torch.tensor([[1.0, -2.0, 3.5]])
    assert check_output(off, expected, 0.0) == OutputCheck(ok=False, max_abs_diff=0.5, nonfinite=False)
    assert check_output(off, expected, 0.2).ok  # rtol = atol = 0.2: |0.5| <= 0.2 + 0.2 * 3
    nan = torch.tensor([[1.0, float("nan"), 3.25]])
    # NaN compares false, so max() alone would have reported 0.25 and no sign of the NaN
    assert check_output(nan, expected, 0.0) == OutputCheck(ok=False, max_abs_diff=0.25, nonfinite=True)
    inf = torch.tensor([[float("inf"), -2.0, 3.0]])
    assert check_output(inf, expected, 1.0) == OutputCheck(ok=False, max_abs_diff=0.0, nonfinite=True)
    # the reference's own NaN, reproduced, is the model's and equal; -0.0 equals 0.0 exactly
    both_nan = torch.tensor([[float("nan"), 0.0]])
    assert check_output(both_nan.clone(), both_nan, 0.0).ok
    assert check_output(torch.tensor([[-0.0]]), torch.tensor([[0.0]]), 0.0).ok
