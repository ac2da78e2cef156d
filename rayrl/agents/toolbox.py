"""The tools the python agent can be given, by name (``rollout.tools``)."""

from __future__ import annotations

from typing import Sequence

from rayrl.agents.file_tools import ListDirTool, ReadFileTool, SearchTool, WriteFileTool
from rayrl.agents.tools import CalculatorTool, Tool

TOOLS: dict[str, type[Tool]] = {
    t.name: t for t in (CalculatorTool, ListDirTool, ReadFileTool, SearchTool, WriteFileTool)
}


def make_tools(names: list[str], delay_s: Sequence[float] = ()) -> list[Tool]:
    """Tools by name. ``delay_s`` = (min, max): every call also takes a uniform random time in that range
    inside the sandbox (``rollout.tool_delay_s``), standing in for slow real tools (builds, tests, web)."""
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        raise ValueError(f"unknown tools {unknown}; available: {sorted(TOOLS)}")
    return [TOOLS[n](delay_s=delay_s) for n in names]
