"""What our vllm-ascend hook-up assumes, as read in vllm-ascend's public source.

Checked against vllm-project/vllm-ascend commit 182b75ea84ff13ece27b57391331ef8935410aea
(2026-08-22, "[Test] add memcache dsv4-flash weekly case (#14760)"). Each entry names the module,
the class, its base as that module imports it, and what we rely on; ``None`` where the name we
assumed does not exist there.
"""

VLLM_ASCEND_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"

# (module, class, base (module.class), defines load_model itself)
RUNNERS = (
    ("vllm_ascend.worker.model_runner_v1", "NPUModelRunner", "vllm.v1.worker.gpu_model_runner.GPUModelRunner", True),
    # Model Runner V2: vLLM's MRv2 GPU runner's load_model, inherited; its EPLB state is
    # ``self.eplb`` (an AscendEPLBController), not MRv1's ``self.eplb_state``
    ("vllm_ascend.worker.v2.model_runner", "NPUModelRunner", "vllm.v1.worker.gpu.model_runner.GPUModelRunner", False),
)

# The MRv2 EPLB boundaries of the architecture page: (module, class, base)
MRV2_EPLB = (
    ("vllm_ascend.worker.v2.eplb", "AscendEPLBController", "vllm.v1.worker.gpu.eplb_utils.EPLBController"),
    ("vllm_ascend.distributed.eplb_state", "AscendEplbState", "vllm.distributed.eplb.eplb_state.EplbState"),
    ("vllm_ascend.distributed.eplb_state", "AscendEplbLayerState", "vllm.distributed.eplb.eplb_state.EplbLayerState"),
    # the router hook: the routers inherit BaseRouter's _apply_eplb_mapping hook, which
    # AscendGroupedTopKRouter's select path calls after top-k
    ("vllm_ascend.ops.fused_moe.router.grouped_topk_router", "AscendGroupedTopKRouter",
     "vllm.model_executor.layers.fused_moe.router.base_router.BaseRouter"),
    # the communicator is HCCL over the device group, not a Gloo-staged one
    ("vllm_ascend.distributed.eplb_communicator", "HcclEplbCommunicator",
     "vllm.distributed.eplb.eplb_communicator.TorchDistNcclEplbCommunicator"),
)

# Assumed by the architecture page, absent at the commit above.
ABSENT = {
    "AscendGlooEplbCommunicator": None,  # no class of that name; nothing subclasses TorchDistGlooStagedEplbCommunicator
}
