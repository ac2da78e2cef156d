"""Fixtures for the inspector tests: a run directory of scripted episodes (tests/inspect/scripted_run.py)
and the inspector served over it on loopback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rayrl.inspect.reader import RunReader
from rayrl.inspect.server import start
from tests.inspect.scripted_run import build_run
from tests.loop_support import LoopThread


@pytest.fixture(scope="session")
def scripted_run(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """(run directory, what build_run made): two steps of scripted episodes through the real gateway."""
    run_dir = tmp_path_factory.mktemp("runs") / "scripted"
    return run_dir, build_run(run_dir, tiny_model_dir)


class Served:
    """The inspector app on a loopback port (a real aiohttp server on a background loop)."""

    def __init__(self, run_dir: Path, host: str = "127.0.0.1", token: str | None = None) -> None:
        self.loop = LoopThread()
        self.runner, self.url = self.loop.run(start(RunReader(run_dir), host, 0, token))
        self.root = self.url.split("?")[0]

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        request = urllib.request.Request(self.root + path, headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as resp:
                body = resp.read()
                status = resp.status
        except urllib.error.HTTPError as err:
            body, status = err.read(), err.code
        try:
            return status, json.loads(body)
        except json.JSONDecodeError:
            return status, body.decode()

    def close(self) -> None:
        self.loop.run(self.runner.cleanup())
        self.loop.close()


@pytest.fixture
def serve() -> Iterator[Any]:
    """``serve(run_dir, host=..., token=...)`` -> Served; all stopped at the end of the test."""
    made: list[Served] = []

    def make(run_dir: Path, **kwargs: Any) -> Served:
        made.append(Served(run_dir, **kwargs))
        return made[-1]

    yield make
    for served in made:
        served.close()
