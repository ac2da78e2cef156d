"""The inspector in real headless Chromium (Debian's package, driven by Playwright): the served page over a
run of scripted episodes through the real gateway, and the static export, which must render the same.

Chromium is installed by scripts/install_system_deps.sh (run by `make test`); where it is not there
(not root, no apt) these tests are skipped, saying so. Started with the flags this machine needs
(no background networking: the machine has no network) and a fresh profile.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]

sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is a test dependency: pip install -e '.[test]'")
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason="Debian's chromium is not installed (scripts/install_system_deps.sh installs "
                                       "it when run as root with apt-get)")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, args=ARGS, headless=True,
            viewport={"width": 1400, "height": 1000})
        yield context
        context.close()


@pytest.fixture
def page(browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda err: errors.append(str(err)))
    yield page
    page.close()
    assert not errors, errors  # no script error on any page


def _rows(page) -> list[str]:
    return page.eval_on_selector_all("#episodes tbody tr", "rows => rows.map(r => r.dataset.key)")


def _open(page, key: str) -> None:
    page.click(f'#episodes tbody tr[data-key="{key}"]')
    page.wait_for_function("k => document.getElementById('ep-title').textContent.startsWith('Episode ' + k)", arg=key)


def _background(page, selector: str) -> str:
    return page.eval_on_selector(selector, "e => getComputedStyle(e).backgroundColor")


def _view(page) -> dict:
    """What the episode panel shows, to compare the served page with the export."""
    return page.evaluate("""() => ({
        tree: document.getElementById('tree').innerText,
        samples: document.getElementById('samples').innerText,
        summary: document.getElementById('ep-summary').innerText,
        classes: [...document.querySelectorAll('#samples .tok')].map(t => t.className).join('|'),
    })""")


def test_served_page_filters_and_shows_tokens_tree_drift_and_fork_merge(scripted_run, serve, page):
    run_dir, made = scripted_run
    served = serve(run_dir)
    page.goto(served.url)
    page.wait_for_selector("#episodes tbody tr")
    assert len(_rows(page)) == 7 and page.locator("#charts figure.chart").count() == 8
    for title in ("mean |Δ log-prob|", "max |Δ log-prob|", "KL(engine ‖ trainer)"):  # the engine-trainer gap
        chart = page.locator(f'#charts figure.chart[data-title="engine-trainer gap: {title}"]')
        assert chart.locator("circle.dot").count() == 2, title
    assert page.locator("#problems").is_hidden()

    # filtering and sorting
    page.select_option("#f-status", "failed")
    assert _rows(page) == ["1:3", "2:2"]
    page.select_option("#f-status", "")
    page.select_option("#f-step", "2")
    assert _rows(page) == ["2:0", "2:1", "2:2"]
    page.select_option("#f-step", "")
    page.fill("#f-search", "TANGLE")
    assert _rows(page) == ["1:0"]
    page.fill("#f-search", "sandbox_failed")  # the failure kind (rayrl/rl/failures.py) is searchable and shown
    assert _rows(page) == ["1:3", "2:2"]
    assert page.locator('#episodes tr[data-key="1:3"] td.status-failed').inner_text() == "failed · sandbox_failed"
    page.fill("#f-search", "")
    page.fill("#f-reward", "1")
    assert set(_rows(page)) == {"1:0", "1:2", "2:1"}
    page.fill("#f-reward", "")
    page.fill("#f-length", "400")
    assert _rows(page) == ["1:0"]  # the longest episode
    page.fill("#f-length", "")
    page.select_option("#f-sort", "tokens")
    page.check("#f-desc")
    assert _rows(page)[0] == "1:0" and page.locator("#count").inner_text() == "7 of 7 episodes"

    # the scripted episode: drift point, fork-merge, sub-agent branch, linked to the LLM calls
    _open(page, "1:0")
    summary = page.locator("#ep-summary").inner_text()  # each reward function's score, the judge's calls
    assert "reward by function\ncorrect_answer 1, answer_format 0.500" in summary, summary
    assert "judge calls\n1 (0 failed), 42 tokens, 0.25 s after 2 attempts" in summary, summary
    tangle = made["steps"][1][0]
    position = tangle.samples[1].metadata["drift"]["position"]
    drift = page.locator("#tree .badge.drift")
    assert drift.count() == 1 and drift.is_visible() and drift.inner_text() == f"drift: response @ {position}"
    assert page.locator('#tree .node[data-turn="2"] .badge.drift').count() == 1  # on LLM call #2's node
    merged = page.locator("#tree .badge.merged")
    assert merged.count() == 1 and merged.is_visible()
    assert page.locator('#tree .node[data-turn="1"] .badge.merged').count() == 1  # on LLM call #1's node
    assert page.locator("#tree .badge.branch").inner_text().startswith("new branch")
    assert page.locator("#samples .note.drift").is_visible()
    assert page.locator("#samples .tok.drift-at").count() == 1
    assert "diverges at token" in page.locator("#samples").inner_text()
    page.click('#tree .node[data-turn="2"]')  # a tree node lights up the tokens its LLM call generated
    assert page.locator("#samples .tok.hl").count() == int(tangle.samples[1].loss_mask.size)

    # a joined two-call episode: trained and masked tokens look different
    _open(page, "1:1")
    trained, masked = page.locator("#samples .tok.trained"), page.locator("#samples .tok.masked")
    plain = made["steps"][1][1].samples[0]
    assert trained.count() == plain.num_trained_tokens
    assert masked.count() == plain.response_length - plain.num_trained_tokens
    assert masked.count() > 0
    assert _background(page, "#samples .tok.trained") != _background(page, "#samples .tok.masked")
    assert _background(page, "#samples .tok.masked") != _background(page, "#samples .tok.prompt")
    masked.filter(has_text=re.compile(r"\S")).first.click()  # one with something to see ("\n" spans have no box)
    info = page.locator("#token-info").inner_text()
    assert "masked" in info and "policy v3" in info and "advantage -1.000" in info
    trained.filter(has_text=re.compile(r"\S")).first.click()
    assert "trained" in page.locator("#token-info").inner_text()
    assert page.locator("#tree .node.sel").count() == 1  # the token's LLM call is selected in the tree
    first = page.locator("#samples .tok").first
    assert first.inner_text() == "<|im_start|>"
    page.check("#raw-ids")
    assert page.locator("#samples .tok").first.inner_text() == f"[{plain.tokens[0]}]"


def test_static_export_renders_the_same_with_no_server(scripted_run, serve, page, browser, tmp_path):
    run_dir, _ = scripted_run
    out = tmp_path / "inspector.html"
    done = subprocess.run([sys.executable, "-m", "rayrl.inspect", str(run_dir), "--export", str(out)], check=False,
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    served = serve(run_dir)
    page.goto(served.url)
    page.wait_for_selector("#episodes tbody tr")
    views = {}
    for key in ("1:0", "1:1", "1:2"):
        _open(page, key)
        views[key] = _view(page)
    rows = _rows(page)

    static = browser.new_page()
    requests: list[str] = []
    static.on("request", lambda r: requests.append(r.url))
    static.goto(out.as_uri())
    static.wait_for_selector("#episodes tbody tr")
    assert _rows(static) == rows
    for key, view in views.items():
        _open(static, key)
        assert _view(static) == view, key
    assert static.locator("#tree .badge.drift").count() == 0  # the last one opened, 1:2, has none
    _open(static, "1:0")
    assert static.locator("#tree .badge.drift").is_visible() and static.locator("#tree .badge.merged").is_visible()
    static.select_option("#f-status", "failed")
    assert _rows(static) == ["1:3", "2:2"]
    assert requests == [out.as_uri()]  # the file itself, nothing else: it needs no server and no network
    static.close()


def test_one_episode_has_its_own_link_served_and_exported(scripted_run, serve, page, browser, tmp_path):
    run_dir, _ = scripted_run
    served = serve(run_dir)
    page.goto(served.url + "#episode=1:2")  # a link someone shared: opens that episode
    page.wait_for_function("() => document.getElementById('ep-title').textContent.startsWith('Episode 1:2')")
    assert page.get_attribute("#ep-link", "href").endswith("#episode=1:2")
    _open(page, "2:1")  # opening another one updates the address bar and the link
    assert page.evaluate("location.hash") == "#episode=2:1"
    assert page.get_attribute("#ep-link", "href").endswith("#episode=2:1")
    page.evaluate("location.hash = '#episode=1:0'")  # following a link within the page
    page.wait_for_function("() => document.getElementById('ep-title').textContent.startsWith('Episode 1:0')")

    out = tmp_path / "inspector.html"
    done = subprocess.run([sys.executable, "-m", "rayrl.inspect", str(run_dir), "--export", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    static = browser.new_page()
    static.goto(out.as_uri() + "#episode=1:1")
    static.wait_for_function("() => document.getElementById('ep-title').textContent.startsWith('Episode 1:1')")
    assert static.get_attribute("#ep-link", "href") == out.as_uri() + "#episode=1:1"
    static.close()
