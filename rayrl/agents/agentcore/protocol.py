"""The contract between the trainer and an agent hosted on AgentCore Runtime.

The trainer invokes the runtime with the task's payload (the JSONL row's ``metadata``, a shallow copy)
plus one extra key, ``payload["rollout_config"]``, which says where the agent's LLM is (the gateway,
with this session's bearer token) and where its result goes (S3). The agent answers the invoke at
once and writes one JSON result object to S3 when it is done; the trainer polls for it. Token ids never
travel this way: the gateway recorded them as the agent called it.

Both sides import this module, so a key is spelled in exactly one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

ROLLOUT_CONFIG_KEY = "rollout_config"

# runtimeSessionId: AgentCore requires 33..256 characters.
_SESSION_ID = re.compile(r"^[A-Za-z0-9_\-.:]{33,256}$")
_KEY_PART = re.compile(r"[^A-Za-z0-9_\-.=]+")


class AgentRolloutConfigError(ValueError):
    """``payload["rollout_config"]`` is missing or malformed (the agent answers HTTP 400)."""


@dataclass
class AgentRolloutConfig:
    """What one session needs to know; serialised into ``payload["rollout_config"]``."""

    base_url: str  # the gateway's OpenAI base URL (…/v1)
    api_key: str  # the session's bearer token at the gateway
    model: str  # model name to send
    exp_id: str
    session_id: str  # AgentCore runtimeSessionId = gateway session id
    s3_bucket: str
    result_key: str  # s3://<s3_bucket>/<result_key> receives the result JSON
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, max_tokens
    max_turns: int = 8
    timeout_s: float = 900.0  # the agent should give up (and still write a result) before this

    def to_dict(self) -> dict[str, Any]:
        return {
            "base_url": self.base_url,
            "api_key": self.api_key,
            "model": self.model,
            "exp_id": self.exp_id,
            "session_id": self.session_id,
            "s3_bucket": self.s3_bucket,
            "result_key": self.result_key,
            "sampling": dict(self.sampling),
            "max_turns": self.max_turns,
            "timeout_s": self.timeout_s,
        }

    @classmethod
    def from_payload(cls, payload: Any) -> "AgentRolloutConfig":
        """Read and check ``payload["rollout_config"]``; AgentRolloutConfigError names what is wrong."""
        if not isinstance(payload, dict):
            raise AgentRolloutConfigError("the payload must be a JSON object")
        raw = payload.get(ROLLOUT_CONFIG_KEY)
        if not isinstance(raw, dict):
            raise AgentRolloutConfigError(f"payload[{ROLLOUT_CONFIG_KEY!r}] is missing or not an object")
        required = ("base_url", "api_key", "model", "exp_id", "session_id", "s3_bucket", "result_key")
        missing = [k for k in required if not isinstance(raw.get(k), str) or not raw.get(k)]
        if missing:
            raise AgentRolloutConfigError(
                f"payload[{ROLLOUT_CONFIG_KEY!r}] lacks string field(s): {', '.join(missing)}"
            )
        sampling = raw.get("sampling") or {}
        if not isinstance(sampling, dict):
            raise AgentRolloutConfigError(f"payload[{ROLLOUT_CONFIG_KEY!r}].sampling must be an object")
        try:
            max_turns = int(raw.get("max_turns", 8))
            timeout_s = float(raw.get("timeout_s", 900.0))
        except (TypeError, ValueError):
            raise AgentRolloutConfigError("max_turns and timeout_s must be numbers") from None
        return cls(
            base_url=raw["base_url"], api_key=raw["api_key"], model=raw["model"], exp_id=raw["exp_id"],
            session_id=raw["session_id"], s3_bucket=raw["s3_bucket"], result_key=raw["result_key"],
            sampling=dict(sampling), max_turns=max_turns, timeout_s=timeout_s,
        )


def check_session_id(session_id: str) -> str:
    """AgentCore's rule for runtimeSessionId (33 to 256 characters), checked before any request."""
    if not _SESSION_ID.match(session_id):
        raise ValueError(f"runtimeSessionId must be 33-256 characters of [A-Za-z0-9_-.:], got {session_id!r}")
    return session_id


def result_key(prefix: str, exp_id: str, task_id: str, session_id: str) -> str:
    """``<prefix>/<exp_id>/<task_id>/<session_id>.json``: one object per session, grouped by task."""
    parts = [p.strip("/") for p in (prefix, exp_id, _KEY_PART.sub("_", task_id) or "task") if p.strip("/")]
    return "/".join([*parts, f"{session_id}.json"])


# The result object an agent writes (see executor.RolloutExecutor):
#   {"session_id", "exp_id", "status": "completed" | "failed", "final_answer": str | None,
#    "error": str | None, "rewards": float | [float] (optional, agent-computed), "info": {...},
#    "timings": {"agent_s", "started_at", "finished_at"}}
RESULT_STATUSES = ("completed", "failed")
