"""The CUDA routing kernel's logic, checked on the host by Triton's interpreter.

``make venv`` installs the Triton release of the lent GPU image (requirements/
triton-interpreter.txt) into ``.venv/triton-interpreter``, off the main path: this test
runs ``triton_interpreted_cases.py`` in a subprocess with that folder on PYTHONPATH and
``TRITON_INTERPRET=1``. What the interpreter does and does not prove is said there.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("triton_interpreted_cases.py")
TRITON_INTERPRETER_PATH = Path(sys.prefix) / "triton-interpreter"


def test_triton_kernel_under_the_interpreter_matches_the_reference():
    if not (TRITON_INTERPRETER_PATH / "triton").is_dir():
        pytest.skip(f"no Triton at {TRITON_INTERPRETER_PATH} (make venv installs it)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(TRITON_INTERPRETER_PATH), str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    # every case collected ran and passed: a skip (no Triton, no interpreter) is a failure here
    assert re.fullmatch(r"\d+ passed.*", summary) and not re.search(r"skipped|deselected|xfail", summary), summary
