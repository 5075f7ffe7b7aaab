"""``runtime/elastic_cli.py``: the elastic flags, and what the elastic handlers refuse before anything starts.

The handlers' runs are ``test_cli.py``'s and ``test_elastic_run.py``'s; bad plans and sizes are
refused by ``elastic_run`` (``test_cli.py`` checks their messages through ``main``).
"""

import argparse

import pytest

from eplb_graph.runtime.config import RunConfig
from eplb_graph.runtime.elastic_cli import add_scale_plan_arguments, add_serve_arguments, run_scale_plan, serve_command


def test_the_elastic_flags_parse_with_their_defaults():
    run = argparse.ArgumentParser()
    add_scale_plan_arguments(run)
    args = run.parse_args(["--scale-plan", "2,4,2", "--kill", "3@150", "--kill", "0@20"])
    assert (args.scale_plan, args.max_ranks, args.resize_deadline, args.kill) == ("2,4,2", None, 30.0, ["3@150", "0@20"])
    serve = argparse.ArgumentParser()
    add_serve_arguments(serve)
    args = serve.parse_args(["--port", "9000"])
    assert (args.host, args.port, args.max_ranks) == ("127.0.0.1", 9000, None)


@pytest.mark.parametrize("overrides", [{"device": "npu"}, {"policy_process": True}])
def test_a_device_or_a_policy_process_is_refused_before_the_output_directory_is_made(overrides, tmp_path):
    args = argparse.Namespace(max_ranks=None, kill=[], resize_deadline=30.0, timeout=60.0, json=True,
                              host="127.0.0.1", port=0)
    made = []
    config = RunConfig(ranks=2, **overrides)
    with pytest.raises(ValueError, match="runs on the host"):
        run_scale_plan(args, (2, 4), config, lambda: made.append(1))
    with pytest.raises(ValueError, match="serve runs on the host"):
        serve_command(args, config)
    assert not made


def test_a_bad_kill_is_refused_before_the_output_directory_is_made():
    args = argparse.Namespace(max_ranks=None, kill=["3"], resize_deadline=30.0, timeout=60.0, json=True)
    made = []
    with pytest.raises(ValueError, match="--kill takes MEMBER@STEP"):
        run_scale_plan(args, (2, 4), RunConfig(ranks=2), lambda: made.append(1))
    assert not made
