"""Where the suite's CPU goes, test by test: ``python -m pytest -n 0 -p tests.cpu_profile tests``.

``--durations`` gives a test's wall time, which under ``make test``'s two workers includes the
time it waited for the other worker's share of the two cores. This plugin reads the machine's
CPU time instead (``/proc/stat``: every process, those a test spawns or forks included, which a
process's own rusage misses once they are not its waited-for children) around each test. So it
needs the machine to itself and one test at a time, and refuses pytest-xdist workers. At the end
it prints the files by CPU seconds; ``EPLB_GRAPH_TEST_CPU=PATH`` also writes a JSON line per test.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable

import pytest

OUT_ENV = "EPLB_GRAPH_TEST_CPU"
SHOWN_FILES = 25


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine since boot, summed over its cores."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, (idle + iowait) / tick


def by_file(rows: Iterable[dict]) -> list[dict]:
    """Per-test rows summed per test file, the most CPU first."""
    files: dict[str, dict] = {}
    for row in rows:
        path = row["id"].split("::")[0]
        total = files.setdefault(path, {"file": path, "tests": 0, "wall_s": 0.0, "cpu_s": 0.0})
        total["tests"] += 1
        total["wall_s"] += row["wall_s"]
        total["cpu_s"] += row["cpu_s"]
    return sorted(files.values(), key=lambda total: -total["cpu_s"])


class CpuProfile:
    """The machine's busy and idle CPU seconds across each test's setup, call and teardown."""

    def __init__(self, out: str | None) -> None:
        self.out = out
        self.rows: list[dict] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        busy, idle = machine_cpu_seconds()
        start = time.monotonic()
        yield
        busy_after, idle_after = machine_cpu_seconds()
        row = {"id": item.nodeid, "wall_s": round(time.monotonic() - start, 2), "cpu_s": round(busy_after - busy, 2),
               "idle_s": round(idle_after - idle, 2)}
        self.rows.append(row)
        if self.out:
            with open(self.out, "a") as out:
                out.write(json.dumps(row) + "\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        files = by_file(self.rows)
        terminalreporter.section(f"CPU seconds of the whole machine, by test file (top {SHOWN_FILES})")
        for total in files[:SHOWN_FILES]:
            terminalreporter.write_line(f"{total['cpu_s']:8.1f} s CPU {total['wall_s']:8.1f} s wall "
                                        f"{total['tests']:4d} tests  {total['file']}")
        terminalreporter.write_line(f"{sum(t['cpu_s'] for t in files):8.1f} s CPU {sum(t['wall_s'] for t in files):8.1f} "
                                    f"s wall {len(self.rows):4d} tests  in all")


def check_one_test_at_a_time(numprocesses: int | str | None) -> None:
    """pytest-xdist's ``-n``: 0 or absent runs one test at a time."""
    if numprocesses:
        raise pytest.UsageError("tests.cpu_profile reads the whole machine's CPU time, so it needs one test at a "
                                f"time: run it with -n 0 (got -n {numprocesses})")


def pytest_configure(config: pytest.Config) -> None:
    check_one_test_at_a_time(getattr(config.option, "numprocesses", None))
    config.pluginmanager.register(CpuProfile(os.environ.get(OUT_ENV)), "eplb-graph-cpu-profile")
