"""benchmarks/results.py: RESULTS.md and the README's table are exactly what the JSON records say."""

import json

from tests.benchmarks.scripts import load_benchmark

results = load_benchmark("results")


def test_results_md_and_the_readme_table_are_what_the_records_say(capsys):
    assert results.main(["render", "--check"]) == 0, capsys.readouterr().err


def test_every_benchmark_of_the_newest_record_has_its_section_and_figures():
    (date, record), *_ = results.records()
    text = results.RESULTS_MD.read_text()
    for name in results.FILES:
        if name in record:
            assert results.TITLES[name] in text, name
    run = results.newest_of_each(results.records())[0]["run"]  # a later record may not have re-run it
    assert f"{run['balancedness_without_eplb']} -> {run['balancedness_after']}" in results.README.read_text()
    assert f"## {date}:" in text


def test_a_figure_edited_by_hand_is_caught(tmp_path, monkeypatch, capsys):
    readme = tmp_path / "README.md"
    readme.write_text(results.README.read_text().replace("| >= 0.95 |", "| >= 0.90 |"))
    monkeypatch.setattr(results, "README", readme)
    assert results.main(["render", "--check"]) == 1
    assert f"{readme} is not what the records say" in capsys.readouterr().err


def test_record_keeps_what_make_bench_wrote_with_its_meta(tmp_path, monkeypatch):
    out = tmp_path / "out"
    (out / "run").mkdir(parents=True)
    newest = results.newest_of_each(results.records())[0]  # each benchmark's newest figures
    (out / "run" / "report.json").write_text(json.dumps(newest["run"]))
    (out / "bench_routing_ops.json").write_text(json.dumps(newest["routing_ops"]))
    monkeypatch.setattr(results, "RECORDS", tmp_path / "records")
    folder = results.record_run(out)
    kept = results.load_record(folder)
    assert kept["run"] == newest["run"] and "routing_ops" in kept and "bench" not in kept
    assert {"date", "machine", "torch", "vllm", "commit"} <= set(kept["meta"])


def test_a_later_partial_record_keeps_the_days_commit_names_its_own_and_shows_its_note(tmp_path, monkeypatch):
    import time

    newest = {**results.newest_of_each(results.records())[0], "meta": results.records()[0][1]["meta"]}
    day = tmp_path / "records" / time.strftime("%Y-%m-%d")
    (day / "run").mkdir(parents=True)
    (day / "run" / "report.json").write_text(json.dumps(newest["run"]))
    day_meta = {key: value for key, value in newest["meta"].items() if key != "commits"}  # a whole-day record
    (day / "meta.json").write_text(json.dumps({**day_meta, "commit": "0000000"}))
    out = tmp_path / "out"
    (out / "bench").mkdir(parents=True)
    (out / "bench" / "bench.json").write_text(json.dumps(newest["bench"]))
    monkeypatch.setattr(results, "RECORDS", tmp_path / "records")
    kept = results.load_record(results.record_run(out))
    # the run's report was measured at the day's commit; only the bench says it came later
    assert kept["meta"]["commit"] == "0000000" and set(kept["meta"]["commits"]) == {"bench"}
    (day / "notes").mkdir()
    (day / "notes" / "bench.md").write_text("What the breakdown shows.\n")
    text = results.render_results_md()
    assert f"{results.TITLES['bench']} (recorded later, at commit {kept['meta']['commits']['bench']})" in text
    assert "What the breakdown shows." in text and "(recorded later" not in text.split(results.TITLES["run"])[1][:5]
