"""The data contract shared by every component: Task, TurnRecord, Sample, Episode.

Token ids and log-probs are numpy arrays (int32 / float32) end to end. Lists are accepted at the
boundaries and converted once, in ``__post_init__``, so comparisons of long prefixes stay cheap
(``np.array_equal`` on a 1M-token prefix costs well under a millisecond; Python lists of fresh ints
cost tens of milliseconds).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

IdArray = np.ndarray  # 1-D int32
FloatArray = np.ndarray  # 1-D float32


def as_ids(values: Sequence[int] | np.ndarray | None) -> np.ndarray:
    """Return ``values`` as a 1-D int32 array without copying when it already is one."""
    if values is None:
        return np.zeros(0, dtype=np.int32)
    arr = np.asarray(values)
    if arr.dtype != np.int32:
        arr = arr.astype(np.int32)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    return arr


def as_floats(values: Sequence[float] | np.ndarray | None) -> np.ndarray:
    """Return ``values`` as a 1-D float32 array without copying when it already is one."""
    if values is None:
        return np.zeros(0, dtype=np.float32)
    arr = np.asarray(values)
    if arr.dtype != np.float32:
        arr = arr.astype(np.float32)
    if arr.ndim != 1:
        raise ValueError(f"log-probs must be 1-D, got shape {arr.shape}")
    return arr


@dataclass
class Task:
    """One dataset row: ``{"prompt": ..., "metadata": {...}}``.

    ``metadata`` is the agent payload verbatim; :meth:`payload` hands out a shallow copy so an agent
    that mutates its payload never changes the dataset. ``prompt`` drives length filtering only.
    """

    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    task_id: str = ""

    def payload(self) -> dict[str, Any]:
        """The agent's payload: a shallow copy of ``metadata`` ({} when metadata is not a dict)."""
        return dict(self.metadata) if isinstance(self.metadata, dict) else {}


@dataclass
class TurnRecord:
    """One LLM call exactly as the engine saw it.

    ``messages`` are the request's chat messages normalised to OpenAI shape; ``response_message`` is
    the assistant message returned. ``policy_version`` is the weight version that produced the
    response, or one version per response token when the weights changed mid-generation.
    """

    messages: list[dict[str, Any]]
    response_message: dict[str, Any]
    prompt_ids: IdArray
    response_ids: IdArray
    response_logprobs: FloatArray
    policy_version: int | np.ndarray = 0
    tools: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"

    def __post_init__(self) -> None:
        self.prompt_ids = as_ids(self.prompt_ids)
        self.response_ids = as_ids(self.response_ids)
        self.response_logprobs = as_floats(self.response_logprobs)
        if len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"response_logprobs has {len(self.response_logprobs)} entries for "
                f"{len(self.response_ids)} response tokens"
            )
        if not isinstance(self.policy_version, (int, np.integer)):
            versions = as_ids(self.policy_version)
            if len(versions) != len(self.response_ids):
                raise ValueError("per-token policy_version must have one entry per response token")
            self.policy_version = versions
        else:
            self.policy_version = int(self.policy_version)

    def response_versions(self) -> np.ndarray:
        """Per-token policy versions of the response as an int32 array."""
        if isinstance(self.policy_version, np.ndarray):
            return self.policy_version
        return np.full(len(self.response_ids), self.policy_version, dtype=np.int32)


class SampleStatus(str, enum.Enum):
    """Why a sample ended; the trainer can treat truncated or aborted samples differently."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One training sequence.

    ``tokens`` = prompt + response. ``loss_mask``, ``rollout_logprobs`` and ``policy_versions`` are
    aligned with ``tokens[prompt_length:]``. Mask 0 marks context the model did not generate here
    (tool output, bridge tokens between turns, a rewritten turn); mask 1 marks trained tokens.
    """

    tokens: IdArray
    prompt_length: int
    loss_mask: np.ndarray
    rollout_logprobs: FloatArray
    policy_versions: IdArray
    reward: float = 0.0
    group_id: str = ""
    session_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    status: str = SampleStatus.COMPLETED.value

    def __post_init__(self) -> None:
        self.tokens = as_ids(self.tokens)
        self.loss_mask = np.asarray(self.loss_mask, dtype=np.int8)
        self.rollout_logprobs = as_floats(self.rollout_logprobs)
        self.policy_versions = as_ids(self.policy_versions)
        n = len(self.tokens) - int(self.prompt_length)
        if n < 0:
            raise ValueError("prompt_length exceeds the number of tokens")
        for name in ("loss_mask", "rollout_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n} response tokens")
        if isinstance(self.status, SampleStatus):
            self.status = self.status.value

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    @property
    def num_trained_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def oldest_version(self) -> int | None:
        """The oldest policy version among the trained tokens (None when nothing is trained): how stale
        the sample is, once compared with the weights it would train."""
        trained = self.policy_versions[self.loss_mask.astype(bool)]
        return int(trained.min()) if len(trained) else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (lists instead of arrays), used by the gateway's HTTP API."""
        return {
            "tokens": self.tokens.tolist(),
            "prompt_length": int(self.prompt_length),
            "loss_mask": self.loss_mask.tolist(),
            "rollout_logprobs": self.rollout_logprobs.tolist(),
            "policy_versions": self.policy_versions.tolist(),
            "reward": float(self.reward),
            "group_id": self.group_id,
            "session_id": self.session_id,
            "metadata": self.metadata,
            "status": self.status,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        return cls(**data)


@dataclass
class Episode:
    """One agent run on one Task: its samples, reward, timings and error if any.

    A failed episode keeps whatever samples were recorded before the failure (for inspection) but is
    excluded from training; it is never dropped silently. ``failure`` says why, as a stable kind
    (rayrl/rl/failures.py), and ``error`` in words. ``tree`` is the session's turn tree as
    :func:`rayrl.trajectory.describe.describe_tree` describes it (JSON-safe, message texts cut short),
    when the run records inspection data (``logging.inspect_episodes_per_step`` > 0); the run records
    keep it (rayrl/records.py), training never reads it.
    """

    session_id: str
    task_id: str
    group_id: str
    samples: list[Sample] = field(default_factory=list)
    reward: float = 0.0
    status: str = "ok"  # "ok" | "failed"
    error: str | None = None
    failure: str | None = None  # why it failed: a kind of rayrl/rl/failures.py (infrastructure or the agent's)
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    tree: dict[str, Any] | None = None  # the session's turn tree for inspection (see above), or None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def generated_tokens(self) -> int:
        return int(sum(s.num_trained_tokens for s in self.samples))
