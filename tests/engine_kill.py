"""Killing a real engine server process in the middle of a generation, and reading what came of it.

Shared by the router's and the gateway's engine-loss tests: the engines run as real processes
(rayrl.engines.launcher.EngineProcess) with different weight versions, so the per-token policy versions
of a continued generation say which engine made each token.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Sequence

from rayrl.engines.client import EngineClient
from rayrl.engines.launcher import EngineProcess


async def tokens_generated(proc: EngineProcess) -> int:
    """The engine's count of tokens generated since it started (its /get_server_info)."""
    client = EngineClient(proc.url)
    try:
        return int((await client.get_server_info())["internal_states"][0]["tokens_generated"])
    finally:
        await client.close()


async def kill_after_tokens(proc: EngineProcess, at_least: int = 24) -> None:
    """SIGKILL the engine's process group once it has generated ``at_least`` more tokens than when called
    (as a machine that dies gives no notice)."""
    start = await tokens_generated(proc)
    while await tokens_generated(proc) < start + at_least:
        await asyncio.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)


def kept_and_continued(versions: Sequence[int], victim: EngineProcess, survivor: EngineProcess) -> int:
    """How many tokens the killed engine made: the generation must be its tokens, then the survivor's."""
    versions = [int(v) for v in versions]
    kept = versions.count(int(victim.weight_version))
    expected = [int(victim.weight_version)] * kept + [int(survivor.weight_version)] * (len(versions) - kept)
    assert versions == expected, f"per-token versions {versions} are not the victim's, then the survivor's"
    return kept
