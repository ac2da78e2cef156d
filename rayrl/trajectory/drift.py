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

What happens next is ``trajectory.on_drift`` (:func:`drift_action`): ``split`` starts a new Sample,
``raise`` makes linearization an error, ``mask`` keeps a small drift inside the previous response in
the same Sample (docs/trajectory.md maps these to seed 004's drift cases).
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


DRIFT_ACTIONS = ("split", "raise", "mask")  # trajectory.on_drift


def drift_action(on_drift: str, info: DriftInfo, prev_prompt_length: int, mask_max_tokens: int) -> str:
    """What linearization does with one drift: ``split``, ``raise`` or ``mask``.

    ``on_drift="mask"`` (seed 004's realign) keeps the turn in its predecessor's Sample only when the
    first mismatch lies inside the predecessor's response (``response`` drift, or ``truncated`` cut
    there) and fewer than ``mask_max_tokens`` of that response follow it: those tokens are given up
    (replaced by the new prompt's own, as context). Anything else splits: a drift in the bridge or in
    earlier context would give up trained turns, and a long tail is worth keeping as its own Sample.
    """
    if on_drift != "mask":
        return on_drift
    inside_response = info.position >= prev_prompt_length
    given_up = info.prev_length - info.position
    return "mask" if inside_response and given_up < mask_max_tokens else "split"


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
