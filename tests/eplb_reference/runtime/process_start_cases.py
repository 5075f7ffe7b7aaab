"""Child bodies for test_process_start.py (importable by a child: not a test module)."""

import os
import sys


def report_environment_and_streams(name: str, launcher, results) -> None:
    launcher.apply()
    print(f"stdout of the child {os.getpid()}", flush=True)
    print(f"stderr of the child {os.getpid()}", file=sys.stderr, flush=True)
    results.put((os.environ.get(name), "torch" in sys.modules, os.getpid()))
