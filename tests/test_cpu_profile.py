"""tests/cpu_profile.py: the opt-in plugin that says where the suite's CPU goes."""

import pytest

from tests.cpu_profile import by_file, check_one_test_at_a_time, machine_cpu_seconds


def test_the_machine_clock_counts_a_busy_loop_as_busy():
    busy, idle = machine_cpu_seconds()
    spin = 0
    while machine_cpu_seconds()[0] - busy < 0.05:  # at least 5 ticks of this loop's own CPU
        spin += 1
    assert spin > 0 and machine_cpu_seconds()[1] >= idle


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
