"""Set-up of vLLM's groups for the EP ranks (the EP layer itself runs in test_controller.py and test_rank.py)."""

import subprocess
import sys

import pytest


pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast

BUILD_CONFIG_TWICE = """
import logging, sys
import torch
from vllm.config import ParallelConfig, VllmConfig
from eplb_reference.runtime.groups import MODEL_RUNNER_CHECK_LOGGERS, _quiet_model_runner_checks

def build():
    VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True))

def levels():
    return [logging.getLogger(name).level for name in MODEL_RUNNER_CHECK_LOGGERS]

before = levels()
with _quiet_model_runner_checks():
    build()
print("--- quiet above, plain below", file=sys.stderr, flush=True)
print(levels() == before, torch.cpu._is_avx512_bf16_supported())
build()
"""


def test_model_runner_warnings_are_kept_out_of_the_ranks_output():
    """vLLM's checks for its own model runner (Triton, V2 runner, mamba dtype) printed three
    warnings per rank on every run; the EP set-up silences exactly those loggers while it
    builds its config, and gives them back their levels afterwards."""
    done = subprocess.run([sys.executable, "-c", BUILD_CONFIG_TWICE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    quiet, plain = done.stderr.split("--- quiet above, plain below")
    for warning in ("Model Runner V2 requires Triton", "Reset SSM cache type", "Triton is not installed"):
        assert warning not in quiet
    levels_restored, warns_on_every_build = done.stdout.split()
    assert levels_restored == "True"
    if warns_on_every_build == "True":  # vLLM resets the SSM cache type only on AVX-512 BF16 CPUs
        # the same construction prints again once the levels are back (the once-only warnings stay spent)
        assert "Reset SSM cache type" in plain
