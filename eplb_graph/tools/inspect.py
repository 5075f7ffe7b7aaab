"""`eplb-graph inspect`: compile a MoE model with the EPLB pass and show what the compiler made of it.

For each MoE layer: the graph around its router with the inserted routing op marked,
the verifier's report and the counts (routers found, mapped, unattributed). ``--out``
writes the whole graph before and after the pass as text and as an HTML page with the
inserted ops highlighted; ``--json`` prints a machine-readable report.
"""

from __future__ import annotations

import html
import json
from importlib.metadata import entry_points
from pathlib import Path

import torch
from torch import fx

from eplb_graph.pytorch.backend import CompiledGraphRecord
from eplb_graph.pytorch.enable import EplbHandle, enable
from eplb_graph.tools.inspect_models import HF_FAMILIES, build_tiny_hf_model
from eplb_graph.passes.insert_routing import is_routing_node
from eplb_graph.passes.router_sites import RouterSite, topk_indices

# Models other installed distributions offer: name -> a callable returning (model, token ids)
MODELS_GROUP = "eplb_graph.inspect_models"
BACKENDS = ("aot_eager", "inductor", "eager")
MARK = ">>"


def model_names() -> tuple[str, ...]:
    """The transformers families built here, then the models installed distributions add."""
    return (*HF_FAMILIES, *sorted(point.name for point in entry_points(group=MODELS_GROUP)))


def build_model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """A small random model of the family and a batch of token ids for it."""
    if name in HF_FAMILIES:
        return build_tiny_hf_model(name), torch.randint(0, 128, (2, 8))
    for point in entry_points(group=MODELS_GROUP, name=name):
        return point.load()()
    raise ValueError(f"unknown model {name!r}; expected one of {', '.join(model_names())}")


def router_neighbourhood(site: RouterSite) -> list[str]:
    """The top-k, its outputs, the routing op and the routing op's consumers, in graph order."""
    nodes: set[fx.Node] = {site.topk, *site.topk.users}
    for mapped in site.mapped:
        nodes |= {mapped, *mapped.users}
    for ids in topk_indices(site.topk):
        nodes |= set(ids.users)
    ordered = [n for n in site.topk.graph.nodes if n in nodes]
    return [f"{MARK if is_routing_node(n) else '  '} {n.format_node()}" for n in ordered]


def inspect_model(model_name: str, backend: str = "aot_eager", num_redundant_experts: int = 2) -> tuple[EplbHandle, CompiledGraphRecord]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    model, tokens = build_model(model_name)
    # Not strict: an unattributable router is listed in the report instead of aborting.
    handle = enable(model, num_redundant_experts=num_redundant_experts, strict=False)
    with torch.no_grad():
        handle.set_batch(num_tokens=tokens.numel())
        torch.compile(model, backend=handle.backend(backend), fullgraph=True)(tokens)
    return handle, handle.compiled_graphs[-1]


def build_report(model_name: str, backend: str, handle: EplbHandle, record: CompiledGraphRecord) -> dict:
    sites = {s.router.key: s for s in record.result.sites if s.mapped}
    report = record.report
    return {
        "model": model_name,
        "backend": backend,
        "routers_found": record.result.routers_found,
        "routers_mapped": record.result.routers_mapped,
        "unattributed": [f"{s.topk.name} ({s.module_path or '?'})" for s in record.result.unattributed],
        "verifier_ok": bool(report and report.ok),
        "verifier": report.as_dict() if report else None,
        "layers": [
            {
                "key": layer.key,
                "name": layer.name,
                "router": layer.spec.router_path,
                "num_logical_experts": layer.tables.num_logical_experts,
                "num_physical_experts": layer.tables.num_physical_experts,
                "top_k": layer.spec.top_k,
                "topk_node": sites[layer.key].topk.name if layer.key in sites else None,
                "routing_node": sites[layer.key].mapped[0].name if layer.key in sites else None,
                "other_topk_in_router": [
                    {"node": s.topk.name, "reason": s.reason}
                    for s in record.result.sites
                    if s.router is not None and s.router.key == layer.key and not s.mapped
                ],
            }
            for layer in handle.layers
        ],
    }


def format_text(report: dict, record: CompiledGraphRecord) -> str:
    lines = [f"model {report['model']} compiled with backend {report['backend']} + EPLB pass"]
    by_key = {s.router.key: s for s in record.result.sites if s.router is not None and s.mapped}
    for layer in report["layers"]:
        lines.append(f"\n== {layer['name']} (router {layer['router']}, {layer['num_logical_experts']} logical -> "
                     f"{layer['num_physical_experts']} physical experts, top-{layer['top_k']}, key {layer['key']})")
        for other in layer["other_topk_in_router"]:
            lines.append(f"   not mapped: {other['node']}: {other['reason']}")
        site = by_key.get(layer["key"])
        lines.extend(router_neighbourhood(site) if site else ["   (router top-k not found in the graph)"])
    verifier = report["verifier"] or {}
    lines.append(
        f"\nrouters found {report['routers_found']}, mapped {report['routers_mapped']}, "
        f"unattributed {len(report['unattributed'])}; verifier {'OK' if report['verifier_ok'] else 'FAILED'}"
    )
    lines.extend(f"  problem: {p}" for p in verifier.get("problems", []))
    lines.extend(f"  unattributed: {u}" for u in report["unattributed"])
    return "\n".join(lines)


def write_outputs(out: Path, report: dict, record: CompiledGraphRecord) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    before, after, page, data = out / "graph_before.txt", out / "graph_after.txt", out / "graph.html", out / "report.json"
    before.write_text(record.graph_before)
    after.write_text(record.graph_after)
    data.write_text(json.dumps(report, indent=2))
    rows = []
    for line in record.graph_after.splitlines():
        css = ' class="eplb"' if "eplb_graph.map_and_record_layer" in line else (' class="topk"' if "topk" in line else "")
        rows.append(f"<div{css}>{html.escape(line) or '&nbsp;'}</div>")
    page.write_text(
        "<!doctype html><meta charset=utf-8><title>EPLB graph: {model}</title><style>"
        "body{{font:13px monospace;white-space:pre}} .eplb{{background:#ffe08a;font-weight:bold}}"
        " .topk{{background:#dbeafe}}</style><h3>{model} after the EPLB pass ({mapped}/{found} routers mapped, "
        "verifier {ok})</h3>{rows}".format(
            model=html.escape(report["model"]), mapped=report["routers_mapped"], found=report["routers_found"],
            ok="OK" if report["verifier_ok"] else "FAILED", rows="\n".join(rows),
        )
    )
    return [before, after, page, data]
