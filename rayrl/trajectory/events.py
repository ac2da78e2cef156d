"""Tree events: what a TrajectoryTree decided, handed to a user's debug callback as it happens.

Why: a user who trains an agent wants to see, per LLM call, where the call landed in the session's
tree and why a trajectory became the samples it became — with their own logging, next to their own
request data (seed 004's ``debug_callback``). The tree calls the callback synchronously, on the thread
that records (the gateway's event loop), so a callback must be quick and must not keep the node: the
tree may free it when the session finishes.

Events, in the order they happen within one ``record_turn``:

* ``merge`` — fork-merge rescue: a client's re-rendered earlier assistant message was merged onto the
  node we generated (decision ``merge``; ``tokens`` = the response tokens that now train nothing);
* ``drift`` — the new turn's prompt does not extend its predecessor's tokens (``drift`` says where);
  the decision is what linearization will do with it: ``split`` (a new Sample), ``mask`` (the same
  Sample: the predecessor's tokens after the mismatch are replaced by the new prompt's, as context) or
  ``raise`` (``samples()`` raises); ``tokens`` = tokens of the previous sequence after the mismatch;
* ``turn`` — the turn was recorded (always last); decision ``root`` (a new top-level branch: the
  session's first turn, a sub-agent, a compacted context), ``fork`` (its path leaves an existing node
  beside another child), ``retry`` (an equal response already hung there) or ``extend``; ``tokens`` =
  its response tokens.

A callback that raises never breaks recording: the tree counts it (``callback_errors``) and logs the
first failure with its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rayrl.trajectory.drift import DriftInfo
from rayrl.trajectory.nodes import Node

EVENT_KINDS = ("turn", "merge", "drift")


@dataclass(frozen=True)
class TreeEvent:
    """One decision of a tree (module docstring): ``node`` is the generated node the event is about."""

    kind: str  # turn | merge | drift
    decision: str  # turn: root | fork | retry | extend; merge: merge; drift: split | mask | raise
    session_id: str
    turn: int  # the index of the turn (LLM call) the node holds
    node: Node
    tokens: int
    drift: DriftInfo | None = None

    def as_dict(self) -> dict[str, object]:
        """A JSON-safe summary (the node reduced to its role), for logging."""
        return {"kind": self.kind, "decision": self.decision, "session_id": self.session_id,
                "turn": self.turn, "role": self.node.role, "tokens": self.tokens,
                "drift": self.drift.as_dict() if self.drift is not None else None}


TreeCallback = Callable[[TreeEvent], None]


def load_callback(spec: str | None) -> TreeCallback | None:
    """The function named ``package.module:function`` (``trajectory.debug_callback``), or None; a
    ConfigError naming the field when it cannot be imported or called with one event."""
    if not spec:
        return None
    from rayrl.extensions import check_call, load_reference

    fn = load_reference(spec, "trajectory.debug_callback")
    check_call(fn, "trajectory.debug_callback", spec, ("event",), "callback(event)")
    return fn
