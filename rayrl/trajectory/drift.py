"""TITO drift: when a turn's prompt tokens do not extend the tokens the model saw and produced before.

Drift is classified by where the first mismatching token lies, because each place has a different
usual cause and a different fix:

* ``response``: inside the previous turn's response. The client re-rendered what the model generated
  (reasoning stripped, tool-call JSON re-serialised).
* ``bridge``: inside the tokens the previous turn's prompt added (tool results, a user message,
  template glue) — the template renders them differently once they are history.
* ``context``: in earlier context (the system prompt, earlier turns) — the history was edited.
* ``truncated``: no token differs but the new prompt is shorter than the previous sequence (the
  client cut the history, or dropped the end of the previous response).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DriftKind(str, enum.Enum):
    """Where the first mismatching token of a drifted turn lies (see module docstring)."""

    RESPONSE = "response"
    BRIDGE = "bridge"
    CONTEXT = "context"
    TRUNCATED = "truncated"


@dataclass(frozen=True)
class DriftInfo:
    """One drift event: turn ``turn`` does not extend turn ``prev_turn``'s sequence.

    ``position`` is the first mismatching token index (or the new prompt's length for ``truncated``);
    ``prev_length`` is the length of the previous sequence (prompt + response).
    """

    kind: DriftKind
    turn: int
    prev_turn: int
    position: int
    prev_length: int
    prompt_length: int

    def as_dict(self) -> dict[str, int | str]:
        return {
            "kind": self.kind.value,
            "turn": self.turn,
            "prev_turn": self.prev_turn,
            "position": self.position,
            "prev_length": self.prev_length,
            "prompt_length": self.prompt_length,
        }


def classify_drift(
    common: int, prompt_length: int, prev_length: int, prev_prompt_length: int, prev_new_start: int
) -> DriftKind | None:
    """Classify a turn against its predecessor from their longest common token prefix.

    ``common`` is the length of the common prefix of the new prompt and the previous sequence;
    ``prev_new_start`` is where the previous turn's own new tokens (its bridge) begin. Returns None
    when the new prompt extends the previous sequence exactly (no drift).
    """
    if common >= prev_length:
        return None
    if common >= prompt_length:
        return DriftKind.TRUNCATED
    if common >= prev_prompt_length:
        return DriftKind.RESPONSE
    if common >= prev_new_start:
        return DriftKind.BRIDGE
    return DriftKind.CONTEXT


class TITODriftError(RuntimeError):
    """Raised by ``samples()`` when ``on_drift="raise"`` and a turn does not extend its predecessor."""

    def __init__(self, info: DriftInfo) -> None:
        super().__init__(
            f"TITO drift ({info.kind.value}) at turn {info.turn}: its prompt ({info.prompt_length} tokens) "
            f"differs from turn {info.prev_turn}'s sequence ({info.prev_length} tokens) "
            f"at token {info.position}"
        )
        self.info = info


class SessionClosedError(RuntimeError):
    """The tree was closed (its memory freed); nothing can be recorded or linearized any more."""
