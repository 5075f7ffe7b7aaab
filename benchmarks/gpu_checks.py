"""Every GPU check in one call, for a machine with CUDA (JSON out, table last).

    python benchmarks/gpu_checks.py --out out/gpu_checks.json

1. the CUDA tests: the Triton map_and_record kernel against the CPU kernel (opcheck too),
   and the layer lookup refreshed in place under torch.cuda.CUDAGraph capture and replay;
2. the routing-op benchmark on CUDA (registered op vs the inline torch composite).

What it does not cover yet: the multi-rank runtime on CUDA (`eplb-graph run --device cuda` is
refused until the runtime places models on a GPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CUDA_TESTS = [
    "tests/custom_ops/test_routing_ops.py::test_cuda_kernel_matches_the_cpu_kernel",
    "tests/eplb_graph/test_layer_lookup.py::test_refreshed_lookup_survives_cuda_graph_replay",
]


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/gpu_checks.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_checks: torch.cuda.is_available() is False; nothing to check here", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", *CUDA_TESTS], capture_output=True, text=True)
    op_json = args.out.with_name("bench_routing_ops_cuda.json")
    bench = subprocess.run(
        [sys.executable, "benchmarks/bench_routing_ops.py", "--device", "cuda", "--out", str(op_json)],
        capture_output=True, text=True,
    )
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda_tests_passed": tests.returncode == 0,
        "cuda_tests_summary": tests.stdout.strip().splitlines()[-1:] if tests.stdout else [],
        "routing_op_bench": json.loads(op_json.read_text()) if bench.returncode == 0 else {"error": bench.stderr[-2000:]},
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(tests.stdout[-3000:])
    print(bench.stdout)
    print(f"wrote {args.out}")
    return 0 if tests.returncode == 0 and bench.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
