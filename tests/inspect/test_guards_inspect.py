"""The inspector shows the guards: the last step's figures and each crossing, linked to its example episode.

The scripted run (tests/inspect/scripted_run.py) has a sandbox failure in each step; the guards
(rayrl/rl/guards.py) run over its step-1 episodes as the pipeline runs them, with the infrastructure
threshold at 0 so the guard fires, and write guards.jsonl and the figures beside the run's own files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rayrl.config import GuardsConfig
from rayrl.inspect.reader import RunReader
from rayrl.rl.guards import StepView, check_guards, write_crossings


def _guarded_copy(scripted_run, tmp_path: Path) -> Path:
    run_dir, made = scripted_run
    copy = tmp_path / "guarded"
    shutil.copytree(run_dir, copy)
    report = check_guards(StepView(made["steps"][1], 3), GuardsConfig(infra_failures="stop", infra_failures_max=0.0),
                          step=1, episodes_file=str(copy / "episodes" / "step000001.jsonl"))
    write_crossings(copy, report.crossings)
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    rows[0].update(report.metrics)
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return copy


def test_the_reader_gives_each_crossing_its_episode_key(scripted_run, tmp_path):
    copy = _guarded_copy(scripted_run, tmp_path)
    summary = RunReader(copy).read().summary()
    (crossing,) = summary["guards"]
    assert crossing["guard"] == "infra_failures" and crossing["action"] == "stop"
    assert crossing["key"] == "1:3"  # the sandbox failure, the step's fourth episode
    assert summary["episodes"][3]["failure"] == "sandbox_failed"
    assert summary["metrics"][0]["guards/infra_failure_rate"] == pytest.approx(0.25)
    assert summary["problems"] == []
    stamp = RunReader(copy).stamp()
    (copy / "guards.jsonl").open("a").write(json.dumps({**crossing, "step": 2}) + "\n")
    assert RunReader(copy).stamp() != stamp  # a new crossing is news to a polling page
    assert RunReader(scripted_run[0]).read().summary()["guards"] == []  # a run without crossings


def test_the_page_lists_figures_and_links_the_example_episode(scripted_run, serve, tmp_path):
    browser_tests = pytest.importorskip("tests.inspect.test_browser")
    copy = _guarded_copy(scripted_run, tmp_path)
    served = serve(copy)
    with browser_tests.sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(tmp_path / "profile"),
                                                       executable_path=browser_tests.CHROMIUM,
                                                       args=browser_tests.ARGS, headless=True)
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(served.url)
            page.wait_for_selector("#guards li")
            assert page.locator("#guards").is_visible()
            assert "infra_failure_rate 0.250" in page.locator("#guard-figures").inner_text()
            item = page.locator("#guard-crossings li.guard-stop")
            assert "step 1 · infra_failures (stop): 0.250 of 4 episodes failed by infrastructure" in item.inner_text()
            item.locator("a").click()
            page.wait_for_function("() => document.getElementById('ep-title').textContent.startsWith('Episode 1:3')")
            assert not errors, errors
        finally:
            context.close()
