"""Per-rank bodies of the multi-rank tests on the emulated device (module level, so spawned
processes can import them); each installs the device in its own process first."""

import torch

from tests.npu_emulation import install


def upstream_rearrange_moves_npu_experts_through_host_staging(rank, world_size, init_method):
    """Upstream's rearrange_expert_weights_inplace moving npu expert weights with GlooStagedCommunicator."""
    emulation = install()
    from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace
    from vllm.distributed.parallel_state import get_ep_group, get_eplb_group

    from eplb_graph.movement.mover import GlooStagedCommunicator
    from tests.eplb_reference.runtime.multirank_cases import _setup

    torch.npu.set_device(rank)
    _, context = _setup(rank, world_size, init_method)
    with context:
        num_layers, num_physical, num_logical = 2, 12, 8
        num_local = num_physical // world_size
        gen = torch.Generator().manual_seed(7)
        logical = [[torch.randn(num_logical, 6, 5, generator=gen), torch.randn(num_logical, 3, generator=gen)]
                   for _ in range(num_layers)]
        old = torch.stack([torch.cat([torch.arange(num_logical), torch.arange(4)]) for _ in range(num_layers)])
        new = torch.stack([torch.cat([torch.arange(num_logical), torch.randint(0, num_logical, (4,), generator=gen)])
                           [torch.randperm(num_physical, generator=gen)] for _ in range(num_layers)])
        local = slice(rank * num_local, (rank + 1) * num_local)
        weights = [[w[old[i, local]].to("npu") for w in logical[i]] for i in range(num_layers)]  # [local, ...] on npu
        addresses = [w.data_ptr() for layer in weights for w in layer]
        buffers = [torch.empty_like(w) for w in weights[0]]
        communicator = GlooStagedCommunicator(get_eplb_group().cpu_group, timeout_s=20)
        copies_before = _copies(emulation)
        rearrange_expert_weights_inplace(old, new, weights, buffers, get_ep_group().device_group, communicator)
        direct = [[w[new[i, local]] for w in logical[i]] for i in range(num_layers)]
        return {
            "equal": all(torch.equal(a.cpu(), b) for la, lb in zip(weights, direct) for a, b in zip(la, lb)),
            "on_npu": all(w.device.type == "npu" for layer in weights for w in layer),
            "storage_kept": [w.data_ptr() for layer in weights for w in layer] == addresses,
            "bytes_received": communicator.bytes_received,
            "host_copies": _copies(emulation) - copies_before,
            "pinned": communicator.staging.pin_memory,
            "unpinned_because": communicator.staging.unpinned_because,
        }


def _copies(emulation) -> int:
    return emulation.fallback.cross_device_copies
