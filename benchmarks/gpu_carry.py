"""Packs upstream's EPLB control plane for the lent GPU image, and installs it there.

    python benchmarks/gpu_carry.py --out .gpu-carry    # here, where PyPI answers: ~30 MB
    python benchmarks/gpu_bench.py --carry .gpu-carry --out /tmp/gpu    # there (carry=[".gpu-carry"])

The lent H200 image has Python 3.12 and torch 2.11.0+cu130, no vLLM, and no network; vLLM's
CUDA wheel is 327 MB, over the 64 MiB that travels with the tree, and 97 % of it is compiled
kernels (flash-attention, vLLM's own ops, DeepGEMM), which this runtime never calls:
upstream's EPLB (``EplbState``, the policy, the async worker, the rearrangement) is Python
over torch, and the data plane is ours. So the carry holds vLLM's own wheel with its compiled
libraries and C++/CUDA sources left out, and the wheels of the packages vLLM imports on the
way to its EPLB modules and CUDA platform that the image lacks (``requirements/gpu-carry.txt``).

``install`` puts both into a scratch site directory on the GPU machine and writes an empty
module where vLLM's CUDA platform imports its kernel library at module level
(``vllm._C_stable_libtorch``): the platform then loads, and a call of one of vLLM's own ops
fails by name (no such ``torch.ops._C`` op) instead of running something else.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements" / "gpu-carry.txt"
PYTHON = "3.12"  # the lent image's; the compiled dependency wheels are built for it
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64"]
LIMIT_BYTES = 56 * 2**20  # of the 64 MiB that travels, the rest is the tree itself
MANIFEST = "manifest.json"
LEFT_OUT_SUFFIXES = (".so", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".inl")
KERNEL_LIBRARY = "vllm/_C_stable_libtorch.py"  # imported by vllm/platforms/cuda.py at module level
KERNEL_LIBRARY_STUB = '"""Left out of the carry (benchmarks/gpu_carry.py): this runtime calls none of vLLM\'s CUDA ops."""\n'


class CarryError(RuntimeError):
    pass


def read_requirements(path: Path = REQUIREMENTS) -> list[str]:
    """``name==version`` lines; vLLM's comes first."""
    pins = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    for pin in pins:
        if "==" not in pin:
            raise CarryError(f"{path}: {pin!r} is not pinned (name==version)")
    if not pins or not pins[0].startswith("vllm=="):
        raise CarryError(f"{path}: the first pin must be vllm's")
    return pins


def is_left_out(name: str, head: bytes) -> bool:
    """Compiled code (shared libraries, executables) and C++/CUDA sources and headers."""
    base = name.rsplit("/", 1)[-1]
    return head.startswith(b"\x7fELF") or base.endswith(LEFT_OUT_SUFFIXES) or ".so." in base


def strip_wheel(wheel: Path, out: Path) -> dict:
    """``wheel`` without what ``is_left_out`` names, as a zip of the same paths."""
    kept = left_out = left_out_bytes = 0
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            data = source.read(info)
            if is_left_out(info.filename, data[:4]):
                left_out += 1
                left_out_bytes += info.file_size
                continue
            target.writestr(info, data)
            kept += 1
    return {"files_kept": kept, "files_left_out": left_out, "bytes_left_out": left_out_bytes}


def download(pins: list[str], into: Path) -> list[Path]:
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", PYTHON, "--implementation", "cp", "-d", str(into)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    done = subprocess.run(command + pins, capture_output=True, text=True)
    if done.returncode != 0:
        raise CarryError(f"pip download failed:\n{done.stderr[-2000:]}")
    return sorted(into.glob("*.whl"))


def pack(out: Path, pins: list[str], wheels: list[Path]) -> dict:
    """``out``: vLLM's stripped wheel, the others under wheels/, and a manifest. Refuses a
    carry over ``LIMIT_BYTES``, or an ``out`` that holds anything but an earlier carry,
    before writing anything."""
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).exists():
        raise CarryError(f"{out} is not empty and holds no carry: not overwritten")
    vllm_name = pins[0].split("==")[0]
    vllm_wheels = [w for w in wheels if w.name.split("-")[0] == vllm_name]
    if len(vllm_wheels) != 1:
        raise CarryError(f"expected one {vllm_name} wheel among {[w.name for w in wheels]}")
    others = [w for w in wheels if w not in vllm_wheels]
    with tempfile.TemporaryDirectory() as scratch:
        stripped = Path(scratch) / f"{vllm_wheels[0].stem}-python-only.zip"
        counts = strip_wheel(vllm_wheels[0], stripped)
        total = stripped.stat().st_size + sum(w.stat().st_size for w in others)
        if total > LIMIT_BYTES:
            raise CarryError(f"the carry would be {total / 2**20:.1f} MiB, over {LIMIT_BYTES / 2**20:.0f} MiB")
        if out.exists():
            shutil.rmtree(out)
        (out / "wheels").mkdir(parents=True)
        shutil.copy2(stripped, out / stripped.name)
    for wheel in others:
        shutil.copy2(wheel, out / "wheels" / wheel.name)
    manifest = {"python": PYTHON, "pins": pins, "vllm_zip": stripped.name, **counts,
                "wheels": [w.name for w in others], "bytes": total}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return manifest


def install(carry: Path, site: Path) -> dict:
    """Installs a carry into ``site`` (made if missing) for this interpreter; returns its manifest
    with the site. Nothing is installed for a carry made for another Python."""
    manifest_path = carry / MANIFEST
    if not manifest_path.exists():
        raise CarryError(f"{carry} is not a carry (no {MANIFEST}): make one with benchmarks/gpu_carry.py")
    manifest = json.loads(manifest_path.read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != here:
        raise CarryError(f"the carry in {carry} is for Python {manifest['python']}, this is {here}")
    site.mkdir(parents=True, exist_ok=True)
    wheels = [str(carry / "wheels" / name) for name in manifest["wheels"]]
    if wheels:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--disable-pip-version-check", "--target", str(site), *wheels],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise CarryError(f"installing the carried wheels failed:\n{done.stderr[-2000:]}")
    with zipfile.ZipFile(carry / manifest["vllm_zip"]) as stripped:
        stripped.extractall(site)
    (site / KERNEL_LIBRARY).write_text(KERNEL_LIBRARY_STUB)
    return {**manifest, "site": str(site)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(".gpu-carry"))
    args = parser.parse_args()
    try:
        pins = read_requirements()
        with tempfile.TemporaryDirectory() as scratch:
            manifest = pack(args.out, pins, download(pins, Path(scratch)))
    except CarryError as error:
        print(f"gpu_carry: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {manifest['bytes'] / 2**20:.1f} MiB, {pins[0]} without {manifest['files_left_out']} "
          f"compiled or C++/CUDA files ({manifest['bytes_left_out'] / 2**20:.0f} MB), {len(manifest['wheels'])} wheels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
