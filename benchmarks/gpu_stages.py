"""The stages of a device call: each a subprocess in its own process group, inside one budget.

What a borrowed GPU needs of its harness, proven on the host by ``make gpu-dryrun``:

- the report is rewritten after every stage, straight to the path the call brings back, so a
  call killed at its limit still returns what it measured (stages not reached are listed);
- a stage's output goes to a log as it runs, and its tail is kept in the report whatever
  ends it: exit, failure or timeout;
- a stage runs in a process group of its own and is killed whole (rank processes included)
  on timeout; the report counts what was still alive afterwards;
- a stage's stale JSON is removed before it runs, so an earlier call's figures cannot pass
  for this one's;
- a stage passes only when its own check of what it claims holds (tests that ran rather than
  skipped, rearrangements that happened, the kernel that served).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TAIL_CHARS = 3000
KILL_GRACE_S = 5.0  # SIGTERM, then SIGKILL: a rank gets this long to flush what it wrote


@dataclass
class Stage:
    name: str
    command: list[str]
    timeout_s: float
    json_file: Path | None = None
    skip_why: str | None = None  # set: reported as skipped, never run
    check: Callable[[dict], list[str]] | None = None  # what its finished entry must show, as problems
    forced_timeout: bool = False  # the host dry run's: this stage is made to time out
    asked: bool = True  # False: not part of this call (skipped, and not counted by exit_code)


def live_processes_in_group(pgid: int) -> list[int]:
    """Pids of the processes of group ``pgid`` that are alive (zombies are not)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def kill_group(pgid: int, grace_s: float = KILL_GRACE_S) -> list[int]:
    """SIGTERM to the whole group, SIGKILL to what outlives the grace; returns what still lives."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return []
        deadline = time.monotonic() + grace_s
        while live_processes_in_group(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return live_processes_in_group(pgid)


def pytest_counts(text: str) -> dict[str, int]:
    """The counts of pytest's last summary line in ``text`` ({} when there is none)."""
    summaries = re.findall(r"^=*\s*((?:\d+ \w+(?:, )?)+) in [\d.]+s", text, flags=re.MULTILINE)
    if not summaries:
        return {}
    return {word: int(count) for count, word in re.findall(r"(\d+) (\w+)", summaries[-1])}


def tests_ran(entry: dict) -> list[str]:
    """A test stage passes only when tests ran and none was skipped: a CUDA test that skips on
    a GPU measured nothing."""
    counts = pytest_counts(entry.get("tail", ""))
    problems = []
    if not counts.get("passed"):
        problems.append(f"no test passed ({counts or 'no pytest summary'})")
    if counts.get("skipped"):
        problems.append(f"{counts['skipped']} test(s) skipped")
    return problems


class StageRunner:
    """Runs stages in order inside ``budget_s``; after each one rewrites ``report_path`` with
    ``header`` and every entry so far (``pending``: the stages not reached yet)."""

    def __init__(self, budget_s: float, report_path: Path, header: dict, logs: Path,
                 names: list[str]) -> None:
        self.deadline = time.monotonic() + budget_s
        self.report_path = report_path
        self.header = header
        self.logs = logs
        self.stages: dict[str, dict] = {}
        self.pending = list(names)
        logs.mkdir(parents=True, exist_ok=True)
        self.write()

    def write(self) -> None:
        report = {**self.header, "stages": self.stages, "pending": self.pending}
        partial = self.report_path.with_suffix(".tmp")
        partial.write_text(json.dumps(report, indent=2))
        partial.replace(self.report_path)  # a reader never sees half a report

    def run(self, stage: Stage) -> dict:
        left = self.deadline - time.monotonic()
        if stage.skip_why is not None:
            entry = {"status": "skipped", "why": stage.skip_why}
        elif left < 30 and not stage.forced_timeout:
            entry = {"status": "skipped", "why": f"{left:.0f} s of the budget left"}
        else:
            entry = self._execute(stage, stage.timeout_s if stage.forced_timeout else min(stage.timeout_s, left))
        entry["command"] = " ".join(stage.command)
        self.stages[stage.name] = entry
        if stage.name in self.pending:
            self.pending.remove(stage.name)
        self.write()
        print(f"[{stage.name}] {entry['status']} ({entry.get('seconds', 0)} s)"
              + "".join(f"\n  {problem}" for problem in entry.get("problems", [])), flush=True)
        return entry

    def _execute(self, stage: Stage, timeout_s: float) -> dict:
        if stage.json_file is not None:
            stage.json_file.unlink(missing_ok=True)  # an earlier call's figures must not pass for these
        log_path = self.logs / f"{stage.name}.log"
        start = time.monotonic()
        with open(log_path, "w") as log:
            process = subprocess.Popen(stage.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = process.wait(timeout=timeout_s)
                status = "ok" if code == 0 else f"exit {code}"
            except subprocess.TimeoutExpired:
                status = f"timeout after {timeout_s:.0f} s"
            # whatever ended the stage, nothing it started outlives it (ranks whose parent exited too)
            left_alive = kill_group(process.pid)
            process.wait()
        entry = {"status": status, "seconds": round(time.monotonic() - start, 1), "timeout_s": round(timeout_s),
                 "tail": log_path.read_text(errors="replace")[-TAIL_CHARS:], "processes_left_alive": len(left_alive)}
        if stage.forced_timeout:
            entry["forced_timeout"] = True
        if stage.json_file is not None and stage.json_file.exists():
            entry["json"] = json.loads(stage.json_file.read_text())
        if status == "ok" and stage.check is not None:
            entry["problems"] = stage.check(entry)
            if entry["problems"]:
                entry["status"] = "failed"
        return entry


def forced_timeout_held(entry: dict) -> bool:
    """The dry run's stage made to time out did, kept its partial output and left nothing alive."""
    return entry["status"].startswith("timeout") and bool(entry.get("tail")) and entry["processes_left_alive"] == 0


def exit_code(stages: dict[str, dict], asked: list[str]) -> int:
    """0 when every stage of this call passed (one made to time out: when it timed out cleanly);
    a skip for lack of vLLM or budget counts as not passed."""
    entries = [stages[name] for name in asked]
    held = [forced_timeout_held(entry) if entry.get("forced_timeout") else entry["status"] == "ok" for entry in entries]
    return 0 if all(held) else 1
