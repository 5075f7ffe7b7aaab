"""tests/cpu_profile.py: the opt-in plugin that says where the suite's CPU goes."""

import time

import pytest

from tests.cpu_profile import by_file, check_one_test_at_a_time, machine_cpu_seconds


def test_the_machine_clock_counts_this_process_busy_time_at_least():
    busy, idle = machine_cpu_seconds()
    start = time.process_time()
    while time.process_time() - start < 0.2:  # this process's own CPU; other processes only add to the machine's
        pass
    busy_after, idle_after = machine_cpu_seconds()
    assert busy_after - busy >= 0.2 - 0.05  # /proc/stat counts ticks of 10 ms per core, cut at both ends
    assert idle_after >= idle


def test_tests_are_summed_per_file_the_most_cpu_first():
    rows = [{"id": "tests/a.py::one", "wall_s": 1.0, "cpu_s": 2.0}, {"id": "tests/b.py::one[x]", "wall_s": 5.0, "cpu_s": 3.0},
            {"id": "tests/a.py::two", "wall_s": 1.5, "cpu_s": 2.5}]
    assert by_file(rows) == [{"file": "tests/a.py", "tests": 2, "wall_s": 2.5, "cpu_s": 4.5},
                             {"file": "tests/b.py", "tests": 1, "wall_s": 5.0, "cpu_s": 3.0}]


@pytest.mark.parametrize("numprocesses", [2, "auto"])
def test_it_refuses_more_than_one_test_at_a_time(numprocesses):
    with pytest.raises(pytest.UsageError, match=f"run it with -n 0 \\(got -n {numprocesses}\\)"):
        check_one_test_at_a_time(numprocesses)
    check_one_test_at_a_time(0)
    check_one_test_at_a_time(None)
