"""The CUDA routing kernel (``custom_ops/triton_routing.py``), checked on the host.

``make venv`` installs the Triton release of the lent GPU image (requirements/
triton-interpreter.txt) into ``.venv/triton-interpreter``, off the main path (the main test
process never imports Triton: vLLM's CPU build and Inductor change behaviour when it is
importable). Each test runs one case file in a subprocess with that folder on PYTHONPATH:

- ``triton_interpreted_cases.py`` under ``TRITON_INTERPRET=1``: the kernel's logic equals
  the Python reference and the CPU kernel;
- ``triton_compile_cases.py`` with the real compiler: the kernel compiles to cubin for
  sm_90 and sm_80 for every argument signature we launch with.

What each proves and does not is said at the top of its case file.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.launches  # rank processes or an engine: left out by make test-fast

REPO_ROOT = Path(__file__).resolve().parents[2]
TRITON_PATH = Path(sys.prefix) / "triton-interpreter"


def run_cases(case_file: str, tmp_path: Path, **env_overrides: str) -> None:
    """Runs ``case_file`` with the carried Triton; every collected case must pass (a skip fails)."""
    if not (TRITON_PATH / "triton").is_dir():
        pytest.skip(f"no Triton at {TRITON_PATH} (make venv installs it)")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(env_overrides, TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))  # a cached kernel is not a compile
    env["PYTHONPATH"] = os.pathsep.join([str(TRITON_PATH), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).with_name(case_file))],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert re.fullmatch(r"\d+ passed.*", summary) and not re.search(r"skipped|deselected|xfail", summary), summary


def test_triton_kernel_under_the_interpreter_matches_the_reference(tmp_path):
    run_cases("triton_interpreted_cases.py", tmp_path, TRITON_INTERPRET="1")


def test_triton_kernel_compiles_to_cubin_for_sm90_and_sm80(tmp_path):
    run_cases("triton_compile_cases.py", tmp_path)
