"""Ascend (vllm-ascend): where the plugin meets its model runners; imported lazily, never here.

How vllm-ascend runs eplb-graph, as far as this package is concerned:

* vllm-ascend's model runners subclass vLLM's GPU runner and override ``load_model``; the
  plugin wraps each of the classes named below when vllm-ascend imports its module, exactly
  like the CPU and GPU runners (``runner_hooks.py``), so ``VllmEplbWorker`` binds the MoE
  layers after load.
* MoE forward on Ascend runs inside the opaque ``torch.ops.vllm.moe_forward`` (no top-k in
  any graph), so every layer is mapped by the router hook; ACL graphs (vllm-ascend's
  ``ACLGraphWrapper``) capture our op with the layer's stable tables, which are refreshed
  in place at upstream's commits, so replays route by the committed placement.
* torchair graph mode compiles through ``eplb_graph.passes.inductor_pass.torchair_backend``;
  the pass finds no traced router top-k there and leaves the router hook's op alone.

As read in vllm-ascend's source (the commit in ``tests/eplb_graph/vllm_plugin/ascend_names.py``): the V2
runner inherits vLLM's Model Runner V2 ``load_model`` and keeps its EPLB state in
``runner.eplb`` (an ``AscendEPLBController``), which ``VllmEplbWorker`` does not read yet, so
MRv2 with EPLB on is refused at load (``runner_hooks.attach_after_load``); its EPLB transfers
use ``HcclEplbCommunicator`` (HCCL over the device group), not a Gloo-staged communicator.

Nothing here imports ``vllm_ascend`` or ``torch_npu``: installing torch-npu without the CANN
toolkit breaks ``import torch`` itself, and vLLM imports them where they belong.
"""

from __future__ import annotations

from eplb_graph.upstream.adaptations import ADAPTATIONS

# Module and class names of vllm-ascend's model runners (Model Runner V1 and V2), as declared
# in the adaptations that wrap their load_model.
ASCEND_RUNNERS = tuple((a.module, a.qualname.split(".")[0]) for a in ADAPTATIONS if a.when.requires == "vllm_ascend")
