import pytest

from eplb_graph.cli import main
from eplb_graph.demo import run_demo


def test_demo_rebalances_a_compiled_router_without_recompiling():
    report = run_demo(num_logical=32, num_redundant=8, ranks=4, steps=6, backend="aot_eager")
    assert report.recompiles == 0
    assert report.lookup_data_ptr_stable
    assert report.routed_only_to_hosting_slots
    assert report.balancedness_after > report.balancedness_before
    assert report.balancedness_after >= 0.9


def test_cli_rejects_ranks_that_do_not_divide_physical_experts(capsys):
    assert main(["demo", "--experts", "8", "--redundant", "1", "--ranks", "2"]) == 2
    assert "9 physical experts do not divide over 2 ranks" in capsys.readouterr().err


def test_cli_rejects_unknown_backend():
    with pytest.raises(SystemExit):
        main(["demo", "--backend", "tensorrt"])
