"""The lent GPU image's software, checked here: what the device call imports, under its Python and torch.

    make gpu-image-check    # builds .venv-gpu-image (Python 3.12, torch 2.11, Triton 3.6), then runs this

The image has Python 3.12, torch 2.11.0+cu130 and Triton 3.6.0 (device/KINDS.md), and no vLLM;
this host's stack is Python 3.11 and torch 2.13. A name that moved between those torch
releases, or a carried wheel that does not import, would cost a device call; this finds it on
the host, with no GPU:

- ``gpu_bench.py``'s own imports and its argument handling;
- every module of the package (with ``--carry``, the vLLM ones too, from the carry installed
  as the device call installs it), and which CUDA kernel registers (Triton's, not the composite);
- the Triton routing kernel compiled to cubin for sm_90 and sm_80 by this Triton.

What it does not prove: anything that runs on a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE = {"python": "3.12", "torch": "2.11"}


def import_every_module() -> dict[str, str]:
    """Module name -> "ok" or the error its import raised."""
    import eplb_graph

    results = {}
    for module in pkgutil.walk_packages(eplb_graph.__path__, "eplb_graph."):
        try:
            importlib.import_module(module.name)
            results[module.name] = "ok"
        except Exception as error:  # reported, then the check fails
            results[module.name] = f"{type(error).__name__}: {error}"
    return results


def compile_to_cubin() -> str:
    """The compile cases' pytest summary line (run in this interpreter, with this Triton)."""
    cases = ROOT / "tests" / "custom_ops" / "triton_compile_cases.py"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(cases)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    return (lines[-1] if lines else done.stderr[-500:]) if done.returncode == 0 else f"FAILED: {done.stdout[-2000:]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--carry", type=Path, help="the carry make gpu-carry packs, installed first as on the device")
    args = parser.parse_args()
    os.environ["EPLB_GRAPH_NATIVE_KERNEL"] = "0"  # as the device call: no host kernel build
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_bench

    gpu_bench.parse_args(["--only", "run"])
    carried = gpu_bench.use_carry(args.carry) if args.carry is not None else None
    modules = import_every_module()
    from eplb_graph.custom_ops import CUDA_KERNEL

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    report = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "image_like": python == IMAGE["python"] and torch.__version__.startswith(IMAGE["torch"]),
        "vllm_carry": None if carried is None else carried["pins"],
        "cuda_kernel": CUDA_KERNEL,
        "modules_failing": {name: why for name, why in modules.items() if why != "ok"},
        "modules_ok": sum(why == "ok" for why in modules.values()),
        "triton_compile": compile_to_cubin(),
    }
    print(json.dumps(report, indent=2))
    problems = [] if report["image_like"] else [f"not the image's Python {IMAGE['python']} / torch {IMAGE['torch']}"]
    if CUDA_KERNEL != "triton":
        problems.append(f"the CUDA kernel would be {CUDA_KERNEL!r}")
    if report["modules_failing"]:
        problems.append(f"{len(report['modules_failing'])} module(s) fail to import")
    if report["triton_compile"].startswith("FAILED"):
        problems.append("the Triton kernel does not compile")
    for problem in problems:
        print(f"gpu_image_check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # the check itself broke: say where
        traceback.print_exc()
        sys.exit(1)
