"""A local Ray for tests whose node exports metrics in Prometheus format on a known port."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def scrape_metrics(port: int, names: list[str], timeout_s: float = 60.0) -> str:
    """Poll the node's metrics endpoint until every name appears (Ray exports every few seconds)."""
    deadline = time.monotonic() + timeout_s
    text = ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        if all(n in text for n in names):
            break
        time.sleep(2)
    return text
