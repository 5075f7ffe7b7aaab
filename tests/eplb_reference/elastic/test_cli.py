"""``runtime/elastic/cli.py``: the elastic flags, and what the elastic handlers refuse before anything starts.

Bad plans, sizes and bounds through ``main`` are ``tests/eplb_reference/test_cli.py``'s; the runs
themselves ``test_scripted.py``'s, ``test_server.py``'s and ``test_chaos.py``'s.
"""

import argparse

import pytest

from eplb_reference.cli import build_parser
from eplb_reference.elastic.join import parse_store
from eplb_reference.elastic.protocol import SECRET_ENV, RunSecret


def test_the_elastic_flags_parse_with_their_defaults():
    parser = build_parser()
    args = parser.parse_args(["run", "--scale-plan", "2,4,2", "--kill", "3@150", "--kill", "0@20"])
    assert (args.scale_plan, args.max_ranks, args.resize_deadline, args.hang_timeout, args.kill, args.chaos) == (
        "2,4,2", None, 30.0, 10.0, ["3@150", "0@20"], None)
    args = parser.parse_args(["run", "--chaos", "7", "--faults", "24"])
    assert (args.chaos, args.faults) == (7, 24)
    args = parser.parse_args(["serve", "--port", "9000", "--store-port", "29500"])
    assert (args.host, args.port, args.store_port, args.max_ranks, args.mode) == ("127.0.0.1", 9000, 29500, None, "eager")
    assert (args.store_host, args.api_key_file, args.max_concurrency, args.secret_file) == ("127.0.0.1", None, 64, None)
    args = parser.parse_args(["join", "--store", "10.0.0.5:29500", "--secret-file", "run.secret"])
    assert (args.store, args.name, args.secret_file) == ("10.0.0.5:29500", "ep", "run.secret")


@pytest.mark.parametrize("overrides, message", [
    (["--device", "npu"], "the NPU runtime needs torch_npu"), (["--policy-process"], "serve runs on the host"),
    (["--hang-timeout", "-1"], "--hang-timeout must be > 0 seconds, got -1.0"),
    (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
    (["--api-key-file", "/nonexistent/key"], "the API key file /nonexistent/key cannot be read"),
    (["--secret-file", "/nonexistent/dir/run.secret"], "--secret-file /nonexistent/dir/run.secret"),
])
def test_what_the_server_cannot_take_is_refused_before_it_starts(overrides, message, capsys, monkeypatch):
    from eplb_reference.cli import main
    from eplb_reference.elastic import server

    monkeypatch.setattr(server.ElasticServer, "__init__", lambda *a, **k: pytest.fail("the server was built"))
    assert main(["serve", *overrides]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("text, message", [
    ("localhost", "--store takes HOST:PORT"), ("host:port", "--store takes HOST:PORT"), (":29500", "--store takes HOST:PORT"),
    ("h:70000", "--store takes HOST:PORT"),
])
def test_a_store_address_that_is_not_one_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_store(text)
    assert parse_store("10.0.0.5:29500") == ("10.0.0.5", 29500) and parse_store("[::1]:80") == ("[::1]", 80)


def test_joining_without_the_runs_secret_is_refused_before_any_connection(capsys, monkeypatch):
    from eplb_reference.cli import main

    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert main(["join", "--store", "127.0.0.1:1", "--timeout", "1"]) == 2
    assert "the run's secret is needed to join it: --secret-file PATH" in capsys.readouterr().err


def test_joining_a_store_nobody_hosts_fails_with_a_clear_error(capsys, monkeypatch):
    from eplb_reference.cli import main

    monkeypatch.setenv(SECRET_ENV, RunSecret.generate().environment()[SECRET_ENV])
    assert main(["join", "--store", "127.0.0.1:1", "--timeout", "1"]) == 2
    assert "--store 127.0.0.1:1: no elastic run's store answers there" in capsys.readouterr().err
    assert isinstance(build_parser(), argparse.ArgumentParser)
