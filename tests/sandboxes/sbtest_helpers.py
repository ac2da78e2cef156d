"""Helpers for sandbox tests (a uniquely named module: other test folders have their own conftest)."""

from __future__ import annotations

import os

import pytest

# bwrap is what isolation "auto" picks wherever it is installed; unshare, the fallback, runs every test
# too, in the slow suite (make test-slow), to keep make test under CI's 15 minutes
UNSHARE = pytest.param("unshare", marks=pytest.mark.slow)
ISOLATED = ("bwrap", UNSHARE)


def processes_matching(text: str) -> list[int]:
    """Host pids whose command line contains ``text`` (how tests prove a process tree is gone)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(name))
        except OSError:
            pass
    return found
