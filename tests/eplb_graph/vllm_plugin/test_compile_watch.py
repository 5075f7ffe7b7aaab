"""CompileWatch: model graphs compiled before it starts are expected; later ones are counted and logged."""

from __future__ import annotations

import logging

from eplb_graph.vllm_plugin.compile_watch import CompileWatch


class Rewrites:
    """Stands in for the sum of the layers' graph_mappings (what the worker counts)."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def test_compiles_before_the_start_are_expected_and_later_ones_are_counted_and_warned_once_each(caplog):
    rewrites = Rewrites()
    watch = CompileWatch(rewrites, logging.getLogger("test.compile_watch"))
    rewrites.now = 2  # warm-up: our pass mapped the model graph's two MoE layers
    assert watch.check() is None and watch.since_start() is None
    with caplog.at_level(logging.INFO, logger="test.compile_watch"):
        watch.start(after="the end of warm-up")
        watch.start(after="the first real step")  # already started: nothing changes
        assert watch.check() is None and watch.since_start() == 0
        rewrites.now = 4  # a graph compiled again while serving
        assert watch.check() == 2
        assert watch.check() is None  # the same compile: warned once
        rewrites.now = 6
        assert watch.check() == 4 and watch.since_start() == 4
    messages = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert messages == [
        ("INFO", "eplb-graph: watching for compiles from the end of warm-up on (the EPLB pass made 2 layer mappings "
                 "before)"),
        ("WARNING", "eplb-graph: a model graph was compiled while serving: 2 layer mappings by the EPLB pass since "
                    "warm-up (a shape or value froze into a compiled graph)"),
        ("WARNING", "eplb-graph: a model graph was compiled while serving: 4 layer mappings by the EPLB pass since "
                    "warm-up (a shape or value froze into a compiled graph)"),
    ]
