"""The inspector's one page, served live or exported as a single self-contained HTML file.

One template (static/inspector.html) with its stylesheet and script inlined, so the served page and
the exported file are the same document: the served one asks the server's JSON API, the exported one
carries that API's answers embedded (``<script id="rayrl-data" type="application/json">``) and loads
nothing from anywhere. Every ``<`` in the embedded JSON is written as ``\\u003c``, so no text from a
run (a model can write ``</script>``) can end the data block early.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from rayrl.inspect.reader import RunReader

STATIC = Path(__file__).resolve().parent / "static"


@lru_cache(maxsize=1)
def _template() -> str:
    html = (STATIC / "inspector.html").read_text()
    html = html.replace("/*CSS*/", (STATIC / "inspector.css").read_text())
    return html.replace("/*JS*/", (STATIC / "inspector.js").read_text())


def render_page(data: dict[str, Any] | None = None) -> str:
    """The page; with ``data`` (``{"run": ..., "details": {key: ...}}``) embedded for the static export."""
    block = ""
    if data is not None:
        payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
        block = f'<script id="rayrl-data" type="application/json">{payload}</script>'
    return _template().replace("<!--DATA-->", block)


def export_html(reader: RunReader, path: str | Path) -> dict[str, int]:
    """Write the whole run (every episode's row and tree, the kept token detail) as one HTML file.

    Returns counts (episodes, and those with token detail) for the caller to report."""
    run = reader.read()
    details: dict[str, Any] = {}
    for row in run.episodes:
        detail = reader.episode(row["step"], row["index"])
        if detail is not None:
            details[row["key"]] = detail
    Path(path).write_text(render_page({"run": run.summary(), "details": details}))
    return {"episodes": len(run.episodes), "with_tokens": sum(1 for d in details.values() if d["samples"])}
