"""The one `eplb-graph` command line: the product's commands import nothing of the reference
runtime, the reference's commands arrive as entry points and load only when asked for."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from eplb_graph.tools import cli


def _modules_after(argv: list[str]) -> tuple[int, set[str]]:
    """Runs the CLI in a fresh interpreter; its exit code and the top-level packages it imported."""
    code = ("import sys\nfrom eplb_graph.tools.cli import main\n"
            "try:\n    status = main(sys.argv[1:])\nexcept SystemExit as done:\n    status = done.code\n"
            "print(sorted({name.split('.')[0] for name in sys.modules}), file=sys.stderr)\nsys.exit(status)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    return done.returncode, set(eval(last))  # noqa: S307  (our own child's repr of a list of names)


@pytest.mark.parametrize("argv", [["doctor", "--markdown"], ["inspect", "--model", "mixtral", "--json"], ["--help"]])
def test_product_commands_import_nothing_of_the_reference(argv):
    status, imported = _modules_after(argv)
    assert status == 0
    assert "eplb_graph" in imported and "eplb_reference" not in imported


def test_the_reference_commands_are_entry_points_listed_but_not_loaded():
    added = cli.added_commands()
    assert set(cli.REFERENCE_COMMANDS) <= set(added)
    assert all(point.value == "eplb_reference.cli:main" for name, point in added.items() if name in cli.REFERENCE_COMMANDS)
    usage = cli.build_parser(added).format_help()
    assert all(name in usage for name in cli.REFERENCE_COMMANDS)


def test_a_reference_command_gets_the_whole_command_line(monkeypatch):
    seen = []
    point = EntryPoint("run", "tests.eplb_graph.tools.test_cli:_record", "eplb_graph.commands")
    monkeypatch.setattr(cli, "added_commands", lambda: {"run": point})
    monkeypatch.setattr(sys.modules[__name__], "_record", lambda argv: seen.append(argv) or 7, raising=False)
    assert cli.main(["run", "--steps", "3"]) == 7
    assert seen == [["run", "--steps", "3"]]


def test_a_reference_command_without_the_reference_installed_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(cli, "added_commands", dict)
    assert cli.main(["serve", "--ranks", "2"]) == 2
    assert "pip install -e reference" in capsys.readouterr().err
