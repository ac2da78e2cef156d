"""Helpers for sandbox tests (a uniquely named module: other test folders have their own conftest)."""

from __future__ import annotations

import os

ISOLATED = ("bwrap", "unshare")


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
