"""Graph mode: CapturedForward replays one graph per capture size with live EPLB tables.

On the host the graph is a test double (``HostReplayGraph``): it proves the wrapper's
bookkeeping -- static buffers per size, recording off during warm-up and capture, the
storage fingerprint that turns a replaced tensor into a counted recapture. It does not
prove capture semantics (a host re-run resolves tables again, a CUDA graph replays frozen
addresses); the same tests run with real CUDA graphs where CUDA exists.
"""

import contextlib

import pytest
import torch

from eplb_graph.graph.graph_capture import CapturedForward, CudaGraph, device_graph_factory
from eplb_graph.core.placement import initial_placement
from eplb_reference.runtime.compile import graph_tensor_reader
from eplb_reference.runtime.config import RunConfig
from eplb_reference.runtime.stack import build_rank_models
from eplb_reference.runtime.workload import make_batch
from tests.markers import requires_cuda


class HostReplayGraph:
    """Capture runs ``fn`` once to get its output buffer; replay runs it again into that buffer."""

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


GRAPHS = [
    pytest.param("cpu", HostReplayGraph, id="host-double"),
    pytest.param("cuda", CudaGraph, id="cuda-graph", marks=requires_cuda),
]


@contextlib.contextmanager
def one_rank_model(device: str):
    """The runtime's model on one EP rank (no collectives), EPLB tables on ``device``."""
    cfg = RunConfig(device=device, ranks=1, mode="eager")
    model, reference, layers, flags = build_rank_models(cfg, 0, 1, None)
    try:
        yield cfg, model, reference, layers, flags
    finally:
        for layer in layers:
            layer.close()


def captured(cfg, model, layers, flags, graph_factory, **options) -> CapturedForward:
    return CapturedForward(
        model, cfg.capture_sizes, device=cfg.device, flags=flags, graph_factory=graph_factory,
        graph_tensors=graph_tensor_reader(model, layers), **options,
    )


def move_experts_in_place(model, reference, layers, placement: torch.Tensor) -> None:
    """What a commit does on one rank: weights into the same storage, then the lookup."""
    for index, layer in enumerate(layers):
        logical = reference.layers[index].mlp.experts.weight_view()
        for live, full in zip(model.layers[index].mlp.experts.weight_view(), logical):
            live.copy_(full[placement.to(full.device)])
        layer.tables.refresh_(placement)


def reset_loads(layers) -> None:
    for layer in layers:
        layer.tables.reset_load_()


def loads(layers) -> torch.Tensor:
    return torch.stack([layer.tables.load.cpu() for layer in layers])  # [L, P]


@pytest.mark.parametrize("device,graph", GRAPHS)
def test_replays_follow_in_place_moves_without_recapture(device, graph):
    with one_rank_model(device) as (cfg, model, reference, layers, flags):
        forward = captured(cfg, model, layers, flags, graph)
        flags.set_(record=True, num_unpadded_tokens=16)
        forward.capture_all()
        # warm-up and capture ran the routing op with recording off, and left the flag as it was
        assert all(int(layer.tables.load.sum()) == 0 for layer in layers)
        assert bool(flags.record_enabled)
        assert forward.stats.captures == len(cfg.capture_sizes)

        workload = cfg.workload()
        decode, prefill = make_batch(workload, 1, 0).to(device), make_batch(workload, 0, 0).to(device)
        for batch in (prefill, decode):
            reset_loads(layers)
            flags.set_(record=True, num_unpadded_tokens=batch.num_tokens)
            out = forward(batch.tokens)
            torch.testing.assert_close(out, reference(batch.tokens), rtol=1e-5, atol=1e-5)
            assert sum(int(layer.tables.load.sum()) for layer in layers) == len(layers) * cfg.top_k * batch.num_tokens
        load_before_move = loads(layers)

        # a rearrangement committed in place: other slots, replicas of other experts
        placement = torch.cat([initial_placement(16, 0).roll(3), torch.tensor([5, 5, 7, 7])])
        move_experts_in_place(model, reference, layers, placement)
        reset_loads(layers)
        model(decode.tokens)  # eager: the op reads the live tables by name
        eager_load = loads(layers)
        reset_loads(layers)
        out = forward(decode.tokens)  # replay: the graph reads them by the address it captured
        torch.testing.assert_close(out, reference(decode.tokens), rtol=1e-5, atol=1e-5)
        assert loads(layers).equal(eager_load)  # the replay routed by the refreshed lookup
        assert not eager_load.equal(load_before_move)  # ... which differs from the captured one
        assert forward.stats.recaptures == 0 and forward.stats.replays == 3


@pytest.mark.parametrize("device,graph", GRAPHS)
def test_a_replaced_table_is_recaptured_and_counted(device, graph):
    with one_rank_model(device) as (cfg, model, reference, layers, flags):
        forward = captured(cfg, model, layers, flags, graph)
        forward.capture_all()
        batch = make_batch(cfg.workload(), 1, 0).to(device)
        forward(batch.tokens)
        layers[0].tables.replica_count = layers[0].tables.replica_count.clone()  # replaced, not updated
        out = forward(batch.tokens)
        assert forward.stats.recaptures == 1
        torch.testing.assert_close(out, reference(batch.tokens), rtol=1e-5, atol=1e-5)
        forward(batch.tokens)
        assert forward.stats.recaptures == 1  # the new graph holds the new address
        experts = model.layers[1].mlp.experts
        experts.w2 = torch.nn.Parameter(experts.w2.detach().clone(), requires_grad=False)  # a weight replaced
        forward(batch.tokens)
        assert forward.stats.recaptures == 2


@pytest.mark.parametrize("device,graph", GRAPHS)
def test_checked_between_steps_a_replay_reads_no_address_and_a_replaced_table_recaptures_every_size(device, graph):
    """The runtime's form: no address walk inside a (timed) replay; ``check_addresses`` after the
    step's commits captures again each size whose graph holds a replaced tensor."""
    with one_rank_model(device) as (cfg, model, reference, layers, flags):
        reads = []
        reader = graph_tensor_reader(model, layers)
        forward = CapturedForward(model, cfg.capture_sizes, device=device, flags=flags, graph_factory=graph,
                                  graph_tensors=lambda: reads.append(1) or reader(), check_addresses_on_replay=False)
        forward.capture_all()
        reads.clear()
        batch = make_batch(cfg.workload(), 1, 0).to(device)
        forward(batch.tokens)
        forward(batch.tokens)
        assert reads == [] and forward.check_addresses() == 0 and len(reads) == 1
        layers[0].tables.lookup = layers[0].tables.lookup.clone()  # replaced, not updated
        assert forward.check_addresses() == len(cfg.capture_sizes)
        assert forward.stats.recaptures == len(cfg.capture_sizes)
        torch.testing.assert_close(forward(batch.tokens), reference(batch.tokens), rtol=1e-5, atol=1e-5)
        assert forward.check_addresses() == 0  # the new graphs hold the new address


def test_a_batch_of_an_uncaptured_size_is_refused():
    with one_rank_model("cpu") as (cfg, model, _, layers, flags):
        forward = captured(cfg, model, layers, flags, HostReplayGraph)
        forward.capture_all()
        with pytest.raises(ValueError, match=r"batch of 32 tokens has no captured graph \(capture sizes \(64, 16\)\)"):
            forward(torch.zeros(1, 32, dtype=torch.long))


def test_no_graph_capture_on_the_host():
    with pytest.raises(ValueError, match="no graph capture on device 'cpu'"):
        device_graph_factory("cpu")
    with pytest.raises(ValueError, match="capture sizes must be positive"):
        CapturedForward(lambda x: x, (), device="cpu", graph_tensors=list, graph_factory=HostReplayGraph)


def test_npu_graphs_need_an_npu_device():
    import os

    if os.environ.get("EPLB_GRAPH_NPU_MODULE") or torch._C._get_privateuse1_backend_name() == "npu":
        pytest.skip("an npu device is loaded in this process (tests/npu_emulation runs the NPU graph cases)")
    with pytest.raises(RuntimeError, match="device 'npu': the NPU runtime needs torch_npu and an ACL graph runner: "
                                           "torch_npu is not installed"):
        device_graph_factory("npu")
