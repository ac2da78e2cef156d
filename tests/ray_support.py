"""Helpers for tests on a real Ray: scraping a node's Prometheus metrics, waiting out an actor's kill."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import ray

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


def wait_until_dead(actor: "ray.actor.ActorHandle", timeout_s: float = 30.0) -> None:
    """Return once calls to a killed actor fail: ``ray.kill`` only asks for the kill, and a call sent right
    after it can still be answered by the process before it goes."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the killed actor still answers {timeout_s:.0f} s after ray.kill")
