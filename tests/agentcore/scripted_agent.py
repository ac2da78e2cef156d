"""An AgentCore agent app for the launcher tests: its behaviour is chosen by the payload.

Run as a real process (``python tests/agentcore/scripted_agent.py``, port from $PORT); results go to S3
through plain boto3 (``AWS_ENDPOINT_URL_S3`` points it at the test's moto server).

- ``{"behaviour": "echo", ...}``: final answer = payload["answer"]; info carries the payload it got.
- ``{"behaviour": "sleep", "seconds": s, "group": g}``: sleeps, reporting the peak number of sessions of
  group ``g`` that were sleeping at once.
- ``{"behaviour": "crash"}``: raises, which must become a failed result in S3.
- ``{"behaviour": "mutate", ...}``: mutates its payload in place (the dataset must not change).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from rayrl.agents.agentcore import rollout_executor

_lock = threading.Lock()
_active: Counter = Counter()  # sessions sleeping now, by payload["group"]
_peak: Counter = Counter()


@rollout_executor
def scripted(payload: dict[str, Any], rollout: Any) -> Any:
    behaviour = payload.get("behaviour", "echo")
    if behaviour == "crash":
        raise RuntimeError("scripted crash")
    if behaviour == "sleep":
        group = str(payload.get("group", ""))
        with _lock:
            _active[group] += 1
            _peak[group] = max(_peak[group], _active[group])
        try:
            time.sleep(float(payload.get("seconds", 0.5)))
        finally:
            with _lock:
                _active[group] -= 1
        return {"final_answer": "slept", "peak_active": _peak[group]}
    if behaviour == "mutate":
        payload["answer"] = "changed by the agent"
        payload.clear()
        return "mutated"
    return {"final_answer": str(payload.get("answer")), "payload_seen": payload,
            "rollout_seen": {"model": rollout.model, "session_id": rollout.session_id, "sampling": rollout.sampling}}


if __name__ == "__main__":
    scripted.run()
