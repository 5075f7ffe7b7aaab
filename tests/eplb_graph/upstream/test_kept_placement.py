"""``PlacementKeeper``: EP rank 0 reads the file, the ranks agree before anything moves, one rank
writes, and a fully committed rearrangement (not every step) reaches the file with the window it
was computed from. The moves themselves run through upstream's rearrangement in real processes:
tests/eplb_reference/runtime/test_controller.py and the vLLM engines (tests/eplb_graph/vllm_plugin/test_engine.py)."""

import types

import pytest
import torch

from eplb_graph.core.placement_file import PlacementFileError, PlacementIdentity, PlacementRecord, load, save
from eplb_graph.upstream.kept_placement import PlacementKeeper, refusal

IDENTITY = PlacementIdentity("Model", "abc", 2, 4, 6, 2, "none")
KEPT = torch.tensor([[3, 2, 1, 0, 3, 2], [0, 1, 2, 3, 1, 1]])
INITIAL = torch.tensor([[0, 1, 2, 3, 0, 1]] * 2)


class FakeBinding:
    """What the keeper asks of ``UpstreamBinding``: the tables' check, and the move (recorded)."""

    def __init__(self, max_replicas: int = 3) -> None:
        self.max_replicas = max_replicas
        self.restored = []

    def check_placements(self, model_state, placements):
        if int(torch.bincount(placements[0]).max()) > self.max_replicas:
            raise ValueError(f"more than max_replicas={self.max_replicas}")

    def restore(self, model_state, placements):
        self.restored.append(placements.clone())
        model_state.physical_to_logical_map = placements.clone()


def eplb_state():
    """Upstream's ``EplbState`` as the keeper reads it: one model state, the rearrangement step."""
    model_state = types.SimpleNamespace(physical_to_logical_map=INITIAL.clone(),
                                        last_expert_load=torch.tensor([[4.0, 3, 2, 1], [1, 1, 1, 9]]))
    return types.SimpleNamespace(model_states={"m": model_state}, expert_rearrangement_step=6)


def test_any_ranks_problem_is_one_error_naming_each_rank():
    assert refusal(["", ""]) is None
    error = refusal(["", "ep_size is 2 in the file, 4 here"])
    assert isinstance(error, PlacementFileError) and str(error) == "EP rank 1: ep_size is 2 in the file, 4 here"


def test_a_kept_placement_is_moved_to_and_the_first_rearrangement_waits_a_full_interval(tmp_path):
    path = tmp_path / "p.json"
    save(path, PlacementRecord(IDENTITY, KEPT, torch.ones(2, 4), 5, "runtime"))
    binding, state = FakeBinding(), eplb_state()
    keeper = PlacementKeeper(path, IDENTITY, ep_rank=0, written_by="runtime")
    record = keeper.restore(binding, state, None)
    assert record.rearrangements == 5 and len(binding.restored) == 1 and torch.equal(binding.restored[0], KEPT)
    assert state.expert_rearrangement_step == 0  # upstream's fresh state starts at 3/4 of an interval
    model_state = state.model_states["m"]
    keeper.close(model_state, 0)  # nothing rearranged since: the file stays as it was (its window kept)
    assert load(path).written_by == "runtime" and torch.equal(load(path).load_window, torch.ones(2, 4).double())


@pytest.mark.parametrize(("identity", "binding", "message"), [
    (PlacementIdentity("Model", "abc", 2, 4, 6, 4, "none"), FakeBinding(), "EP rank 0: .*ep_size is 2 in the file, 4 here"),
    # the layer and slot counts of the built model (the config gate knows no layer count)
    (PlacementIdentity("Model", "abc", 3, 4, 8, 2, "none"), FakeBinding(),
     "EP rank 0: .*num_layers is 2 in the file, 3 here; num_physical_experts is 6 in the file, 8 here"),
    (IDENTITY, FakeBinding(max_replicas=1), "EP rank 0: more than max_replicas=1"),
])
def test_a_file_that_does_not_fit_is_refused_before_anything_moves(tmp_path, identity, binding, message):
    path = tmp_path / "p.json"
    save(path, PlacementRecord(IDENTITY, KEPT, None, 5, "runtime"))
    keeper = PlacementKeeper(path, identity, ep_rank=0, written_by="runtime")
    state = eplb_state()
    with pytest.raises(PlacementFileError, match=message):
        keeper.restore(binding, state, None)
    keeper.abandon()
    assert binding.restored == [] and state.expert_rearrangement_step == 6
    assert load(path).rearrangements == 5  # nothing moved, nothing written


def test_only_rank_0_reads_and_a_directory_it_cannot_write_to_is_its_refusal(tmp_path):
    """Its finding travels to every rank (here, one) and is raised there, named once."""
    missing = tmp_path / "missing" / "p.json"
    follower = PlacementKeeper(missing, IDENTITY, ep_rank=1, written_by="vllm")
    assert follower.writer is None
    keeper = PlacementKeeper(missing, IDENTITY, ep_rank=0, written_by="vllm")
    status, why = keeper.read()
    assert status == "refused" and "does not exist" in why
    with pytest.raises(PlacementFileError, match=r"^EP rank 0: placement file .* does not exist$"):
        keeper.restore(FakeBinding(), eplb_state(), None)
    keeper.abandon()


def test_rank_0_writes_each_finished_rearrangement_with_the_window_it_started_from(tmp_path):
    path = tmp_path / "p.json"
    state = eplb_state()
    model_state = state.model_states["m"]
    keeper = PlacementKeeper(path, IDENTITY, ep_rank=0, written_by="vllm")
    assert keeper.restore(FakeBinding(), state, None) is None and not path.exists()  # a cold start
    first_window = model_state.last_expert_load.clone()
    keeper.after_step(model_state, 0, in_flight=True)  # rearrangement 1 starts from first_window
    keeper.after_step(model_state, 0, in_flight=True)
    assert keeper.writer.flush() and not path.exists()
    # one step commits rearrangement 1's last layer and starts rearrangement 2 on a new window
    model_state.physical_to_logical_map = KEPT.clone()
    model_state.last_expert_load = torch.tensor([[9.0, 9, 9, 9], [9, 9, 9, 9]])
    keeper.after_step(model_state, 1, in_flight=True)
    assert keeper.writer.flush()
    written = load(path)
    assert written.rearrangements == 1 and torch.equal(written.physical_to_logical, KEPT)
    assert torch.equal(written.load_window, first_window.double())  # not rearrangement 2's
    model_state.physical_to_logical_map = INITIAL.clone()  # rearrangement 2 committed one layer: shutdown
    keeper.close(model_state, 1)
    assert torch.equal(load(path).physical_to_logical, INITIAL) and keeper.writer is None
