"""bench/measure.py, the one home of how benchmarks compare sides: alternation order, when repeating stops,
paired ratios, and the record that bench/report.py turns into docs/benchmarks.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import measure  # noqa: E402
import report  # noqa: E402


def test_sides_alternate_with_rotating_order_and_warmup_is_discarded():
    calls: list[str] = []
    values = {"a": iter(range(100)), "b": iter(range(100, 200))}

    def side(name: str):
        def go() -> float:
            calls.append(name)
            return float(next(values[name]))
        return go

    res = measure.alternate({"a": side("a"), "b": side("b")}, min_rounds=4, max_rounds=4, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert res["a"][measure.VALUE].samples == (1.0, 2.0, 3.0, 4.0)  # warm-up value 0 dropped
    assert res["b"][measure.VALUE].samples == (101.0, 102.0, 103.0, 104.0)


def test_repeats_until_the_spread_is_known_or_the_round_limit():
    steady = measure.alternate({"x": lambda: 5.0}, min_rounds=3, max_rounds=20, warmup=0)
    assert steady["x"][measure.VALUE].n == 3  # settled as soon as allowed
    noisy = iter([1.0, 10.0] * 50)
    res = measure.alternate({"x": lambda: next(noisy)}, min_rounds=3, max_rounds=7, rel_iqr=0.1, warmup=0)
    assert res["x"][measure.VALUE].n == 7


def test_several_figures_per_side_and_paired_ratios():
    t = iter(range(1, 100))
    res = measure.alternate({"a": lambda: {"s": 2.0 * next(t), "n": 1.0}, "b": lambda: {"s": float(next(t)), "n": 1.0}},
                            min_rounds=2, max_rounds=2, warmup=0)
    # round 1 runs a then b (a=2*1, b=2); round 2 runs b then a (b=3, a=2*4)
    assert res["a"]["s"].samples == (2.0, 8.0) and res["b"]["s"].samples == (2.0, 3.0)
    assert measure.paired_ratio(res["a"]["s"], res["b"]["s"]).samples == (1.0, 8.0 / 3.0)
    with pytest.raises(ValueError):
        measure.paired_ratio(measure.Spread((1.0,)), measure.Spread((1.0, 2.0)))


def test_spread_statistics_and_format():
    s = measure.Spread((4.0, 1.0, 3.0, 2.0, 5.0))
    assert s.median == 3.0 and s.quartiles == (2.0, 4.0)
    assert s.fmt(1) == "3.0 [2.0-4.0] (1.0-5.0, n=5)"
    assert measure.Spread((7.0,)).fmt(0, " ms") == "7 ms"
    assert measure.Spread((0.0, 0.0)).rel_iqr == 0.0


def test_record_json_renders_into_the_benchmarks_page(tmp_path: Path):
    rec = measure.Record("demo", "Demo bench", quick=True, record_dir=tmp_path)
    rec.table("a table", ["side", "figure"], [["ours", "1 | 2"]])
    rec.note("goal: met")
    rec.figure("ratio", {"x": measure.Spread((1.0, 2.0))})
    data = json.loads(rec.save().read_text())
    assert data["name"] == "demo" and data["quick"] is True and len(data["load_start"]) == 3
    assert data["machine"]["cores"] >= 1 and data["figures"]["ratio"]["x"]["samples"] == [1.0, 2.0]
    page = report.render(tmp_path)
    assert "## Demo bench" in page and "Smoke run" in page and "| ours | 1 \\| 2 |" in page
    assert "goal: met" in page and "Missing from this run" in page  # the real benches have no record here


def test_keep_updates_one_bench_in_an_existing_page(tmp_path: Path):
    """--keep: a bench run again replaces its own section and index row; the others stay as they were."""
    first, second = tmp_path / "first", tmp_path / "second"
    for name, title, figure in (("demo", "Demo bench", "1"), ("other", "Other bench (2 sides)", "2")):
        rec = measure.Record(name, title, quick=True, record_dir=first)
        rec.table("t", ["figure"], [[figure]])
        rec.save()
    page = report.render(first)
    again = report.render(tmp_path / "none", page)  # nothing new: the page as it was (less the "missing" line)
    assert again == "\n".join(line for line in page.split("\n") if not line.startswith("Missing from")).replace(
        "|\n\n\n## ", "|\n\n## ", 1)
    rec = measure.Record("demo", "Demo bench", quick=True, record_dir=second)
    rec.table("t", ["figure"], [["9"]])
    rec.save()
    updated = report.render(second, page)
    assert "| 9 |" in updated and "| 1 |" not in updated  # the demo section is the new one
    assert "## Other bench (2 sides)" in updated and "| 2 |" in updated and updated.count("| Other bench") == 1
    assert "Missing from this run" not in updated
