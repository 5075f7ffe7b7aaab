"""RunConfig: what a run is, refused before any process starts where it cannot run here."""

import pytest
import torch

from eplb_reference.runtime.config import RunConfig


def test_cuda_needs_a_gpu_per_rank(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # vLLM's CPU platform sets it when a config is built
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device 'cuda': torch.cuda.is_available\(\) is False"):
        RunConfig(device="cuda").validate()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 ranks need 2 GPUs \\(NCCL runs one rank per GPU\\), 1 visible"):
        RunConfig(device="cuda", ranks=2).validate()
    RunConfig(device="cuda", ranks=1).validate()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun over two machines, one rank on each
    RunConfig(device="cuda", ranks=2).validate()


def test_cpp_wrapper_is_refused_where_it_cannot_serve():
    from eplb_reference.runtime.config import check_cpp_wrapper, collectives_refuse_cpp_wrapper

    with pytest.raises(ValueError, match="cpp_wrapper is a host option"):
        check_cpp_wrapper("cuda", "inductor", 1)
    with pytest.raises(ValueError, match="cpp_wrapper is an Inductor option; the backend is 'aot_eager'"):
        check_cpp_wrapper("cpu", "aot_eager", 1)
    check_cpp_wrapper("cpu", "inductor", 1)
    if collectives_refuse_cpp_wrapper():  # torch 2.13: the collectives' group argument is typed Any
        with pytest.raises(ValueError, match="cpp_wrapper needs ranks 1 with torch"):
            RunConfig(cpp_wrapper=True, ranks=2).validate()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_experts=16, num_redundant_experts=3), "19 physical experts do not divide over 2 ranks"),
        (dict(ranks=0), "ranks must be >= 1, got 0"),
        (dict(num_redundant_experts=-1), "redundant experts must be >= 0, got -1"),
        (dict(num_experts=0), "experts must be >= 1, got 0"),
        (dict(num_experts=8, top_k=9), "top_k must be in [1, 8], got 9"),
        (dict(weight_format="gptq"), "quantization format 'gptq' is not supported"),
        (dict(weight_format="w4a8", expert_intermediate=15), "odd intermediate size 15"),
    ],
)
def test_a_layout_or_format_that_cannot_run_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RunConfig(**overrides).validate()



def test_a_placement_file_the_run_cannot_start_from_is_refused_naming_the_field(tmp_path):
    from eplb_graph.core.placement import initial_placement
    from eplb_graph.core.placement_file import PlacementRecord, save

    path = tmp_path / "placement.json"
    RunConfig(placement_file=str(path)).validate()  # none yet: the run starts cold and writes it
    kept = RunConfig()
    save(path, PlacementRecord(kept.placement_identity(), initial_placement(16, 4).repeat(2, 1), None, 1, "runtime"))
    RunConfig(placement_file=str(path)).validate()
    with pytest.raises(ValueError, match="ep_size is 2 in the file, 4 here"):
        RunConfig(placement_file=str(path), ranks=4).validate()
    with pytest.raises(ValueError, match="num_physical_experts is 20 in the file, 24 here"):
        RunConfig(placement_file=str(path), num_redundant_experts=8).validate()
    with pytest.raises(ValueError, match="config_hash is"):
        RunConfig(placement_file=str(path), seed=1).validate()
    with pytest.raises(ValueError, match="quantization is 'unquantized' in the file, 'w4a8' here"):
        RunConfig(placement_file=str(path), weight_format="w4a8").validate()
    with pytest.raises(ValueError, match="a placement file keeps what EPLB placed: it needs EPLB on"):
        RunConfig(placement_file=str(path), eplb=False).validate()
