import pytest

from eplb_reference.cli import main
from eplb_reference.runtime.demo import run_demo


def test_demo_rebalances_a_compiled_router_without_recompiling():
    report = run_demo(num_logical=32, num_redundant_experts=8, ranks=4, steps=6, backend="aot_eager")
    assert report.recompiles == 0
    assert report.lookup_data_ptr_stable
    assert report.routed_only_to_hosting_slots
    assert report.balancedness_after > report.balancedness_before
    assert report.balancedness_after >= 0.9


@pytest.mark.parametrize(
    "args, message",
    [
        (["--experts", "8", "--redundant", "1", "--ranks", "2"], "9 physical experts do not divide over 2 ranks"),
        (["--steps", "0"], "steps must be >= 1, got 0"),
        (["--ranks", "0"], "ranks must be >= 1, got 0"),
        (["--redundant", "-1"], "redundant experts must be >= 0, got -1"),
        (["--experts", "0"], "experts must be >= 1, got 0"),
        (["--experts", "2"], "top_k must be in [1, 2], got 4"),
    ],
)
def test_cli_rejects_bad_input_with_a_clear_error(args, message, capsys):
    assert main(["demo", *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_unknown_backend():
    with pytest.raises(SystemExit):
        main(["demo", "--backend", "tensorrt"])
