"""The e2b backend fails clearly when its SDK or API key is missing (no live e2b calls here)."""

from __future__ import annotations

import importlib.util

import pytest

from rayrl.config import SandboxConfig
from rayrl.sandboxes import SandboxHandle, SandboxUnavailable, create_sandbox, open_sandbox


def test_missing_sdk_or_key_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    expected = "E2B_API_KEY" if importlib.util.find_spec("e2b") else "pip install"
    config = SandboxConfig(backend="e2b", image="base")
    with pytest.raises(SandboxUnavailable, match=expected):
        create_sandbox(config)
    with pytest.raises(SandboxUnavailable, match=expected):
        open_sandbox(SandboxHandle("e2b", "sbx-123", None, config))


def test_unknown_backend_is_refused():
    from rayrl.sandboxes import SandboxError

    with pytest.raises(SandboxError, match="unknown"):
        open_sandbox(SandboxHandle("docker", "x", None, SandboxConfig()))
