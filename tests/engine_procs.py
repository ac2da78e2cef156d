"""Starting several real engine server processes at once (rayrl.engines.launcher.EngineProcess).

A start is mostly the new interpreter importing torch and transformers (seconds, on one core), so a fixture
that starts two engines one after the other waits twice as long as it needs to on a machine with two cores.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from rayrl.engines.launcher import EngineProcess


def start_together(procs: Sequence[EngineProcess]) -> None:
    """``start()`` every process (those already running are left as they are), each from a thread of its own;
    returns once all are healthy. If any fails, all are stopped and the first error is raised."""
    # a die-with-parent child is killed when the thread that forked it exits: those must start here
    assert not any(p.die_with_parent for p in procs), "start die_with_parent engines from the calling thread"
    with ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
        futures = [pool.submit(p.start) for p in procs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        for p in procs:
            p.stop()
        raise errors[0]
