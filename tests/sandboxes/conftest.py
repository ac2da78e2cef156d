"""Fixtures for sandbox tests: a private sandbox root and a factory that closes what it made."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable, Iterator

import pytest

from rayrl.config import SandboxConfig
from rayrl.sandboxes.base import SandboxUnavailable
from rayrl.sandboxes.local import LocalSandbox


@pytest.fixture(scope="session")
def sandbox_root() -> Iterator[str]:
    """A root under /tmp every sandbox uid can traverse (pytest's own tmp dirs are 0700)."""
    root = tempfile.mkdtemp(prefix="rayrl-sbtest-", dir="/tmp")
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def make_sandbox(sandbox_root: str) -> Iterator[Callable[..., LocalSandbox]]:
    """Create sandboxes (skipping an isolation level this machine cannot provide); all closed after."""
    made: list[LocalSandbox] = []

    def make(isolation: str = "bwrap", max_output_bytes: int | None = None, **fields) -> LocalSandbox:
        config = SandboxConfig(isolation=isolation, **fields)
        kwargs = {} if max_output_bytes is None else {"max_output_bytes": max_output_bytes}
        try:
            sb = LocalSandbox(config, root=sandbox_root, **kwargs)
        except SandboxUnavailable as err:
            pytest.skip(f"isolation {isolation} unavailable here: {err}")
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()
