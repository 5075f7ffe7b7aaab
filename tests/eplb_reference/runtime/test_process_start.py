"""``runtime/process_start.py``: a child forked from the fork server sees the launcher's
environment and standard streams of the moment it starts, not the server's."""

import os

import pytest

from eplb_reference.runtime.process_start import LauncherState, process_context
from tests.eplb_reference.runtime import process_start_cases


def start_child(name: str) -> tuple:
    ctx = process_context()
    results = ctx.Queue()
    child = ctx.Process(target=process_start_cases.report_environment_and_streams,
                        args=(name, LauncherState(), results))
    child.start()
    report = results.get(timeout=120)
    child.join(30)
    assert child.exitcode == 0
    return report


@pytest.mark.launches  # a fork server and its children
def test_a_child_sees_the_launchers_environment_and_streams_of_the_moment_it_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("EPLB_GRAPH_TEST_LAUNCHER", "first")
    start_child("EPLB_GRAPH_TEST_LAUNCHER")  # the fork server runs from here on, with this environment and streams
    monkeypatch.setenv("EPLB_GRAPH_TEST_LAUNCHER", "second")
    saved = [os.dup(1), os.dup(2)]
    out, err = tmp_path / "out", tmp_path / "err"
    try:  # the launcher's streams, redirected after the server started
        for target, path in ((1, out), (2, err)):
            with path.open("w") as handle:
                os.dup2(handle.fileno(), target)
        value, torch_imported, pid = start_child("EPLB_GRAPH_TEST_LAUNCHER")
    finally:
        for target, fd in zip((1, 2), saved):
            os.dup2(fd, target)
            os.close(fd)
    assert value == "second" and torch_imported  # torch imported by the server, before the child existed
    assert f"stdout of the child {pid}" in out.read_text() and f"stderr of the child {pid}" in err.read_text()


def test_spawn_can_be_asked_for_and_a_wrong_method_is_named(monkeypatch):
    monkeypatch.setenv("EPLB_GRAPH_START_METHOD", "spawn")
    assert process_context().get_start_method() == "spawn"
    monkeypatch.setenv("EPLB_GRAPH_START_METHOD", "fork")
    with pytest.raises(ValueError, match="EPLB_GRAPH_START_METHOD='fork': expected 'forkserver' or 'spawn'"):
        process_context()
