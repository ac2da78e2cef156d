"""A session's turn tree as a compact, JSON-safe description, for inspection (never for training).

The inspector (rayrl/inspect), the run records (rayrl/records.py) and the gateway's admin route
(rayrl/gateway/admin_trees.py) all read a tree through this one function, so they agree on what a
branch, a fork-merge and a drift point are. It only reads the tree: samples are built exactly as before.

Shape (``version`` 1)::

    {"version": 1, "stats": TrajectoryTree.stats(), "nodes": [node, ...]}

Nodes are listed in depth-first order (children in insertion order), flat, each naming its ``parent``
(an index into the list; None under the root), so a 1,000-turn session is not 1,000 levels of JSON
nesting. A node is::

    {"id", "parent", "role", "text", "chars", "call", "calls", "branch"?, "tool_calls"?, "tool_call_id"?,
     "gen"?}

* ``text`` is the message's text (content, text parts joined) cut to ``text_chars``; ``chars`` is its
  full length, so a reader knows when it was cut.
* ``call`` is the LLM call (turn index, 0-based, in recording order) that added the node: the first call
  whose request or response contained it. ``calls`` is how many calls' turns lie at or below it.
* ``branch`` marks where the tree splits: ``"root"`` for a second or later top-level branch (a sub-agent
  or a compacted context: another first message), ``"fork"`` for a later child of a node that already
  had one (a retry, or a history that went another way).
* ``gen`` is present on generated nodes (the response of an LLM call): ``turn`` (the call), token
  counts (``prompt_len``, ``response_len``, ``shared`` with ``base_turn``), ``pred_turn`` (the turn it
  joins onto in a sample), ``version`` (the policy version, or ``[first, last]`` when the weights changed
  mid-response), ``finish_reason``, ``merged`` (fork-merge rescue: a client's re-rendered form of this
  message was merged onto it; it trains nothing), ``retry`` (an equal response already existed beside
  it) and ``drift`` (the TITO drift point and its class, :class:`rayrl.trajectory.drift.DriftInfo`; None
  on a merged node, whose drift splits nothing, as the tree's counters say).

A sample's ``turn_indices`` name the ``gen.turn`` of its turns, which links every token of a Sample to
the LLM call and tree node that produced it. Cost: one pass over the nodes, O(nodes + text kept).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rayrl.trajectory.messages import messages_equal
from rayrl.trajectory.nodes import GenTurn, Node

DESCRIPTION_VERSION = 1
DEFAULT_TEXT_CHARS = 2000


def message_text(message: dict[str, Any]) -> str:
    """The readable text of a chat message: its content string, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "".join(parts)
    return ""


def _tool_calls(message: dict[str, Any], text_chars: int) -> list[dict[str, str]]:
    calls = []
    for call in message.get("tool_calls") or []:
        if not isinstance(call, dict):
            continue
        function = call.get("function") if isinstance(call.get("function"), dict) else {}
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = str(arguments)
        calls.append({"id": str(call.get("id", "")), "name": str(function.get("name", "")),
                      "arguments": arguments[:text_chars]})
    return calls


def _versions(g: GenTurn) -> int | list[int]:
    if isinstance(g.versions, np.ndarray) and len(g.versions):
        first, last = int(g.versions[0]), int(g.versions[-1])
        return first if first == last else [first, last]
    return g.bridge_version


def _gen(node: Node, parent: Node) -> dict[str, Any]:
    g = node.gen
    assert g is not None
    retry = any(s is not node and s.gen is not None and s.gen.index < g.index
                and messages_equal(s.message, node.message) for s in parent.candidates(node.message))
    return {
        "turn": g.index,
        "prompt_len": g.prompt_len,
        "response_len": g.response_len,
        "shared": g.shared,
        "base_turn": g.base.gen.index if g.base is not None and g.base.gen is not None else None,
        "pred_turn": g.pred.gen.index if g.pred is not None and g.pred.gen is not None else None,
        "version": _versions(g),
        "finish_reason": g.finish_reason,
        "merged": g.merged,
        "retry": retry,
        "drift": g.drift.as_dict() if g.drift is not None and not g.merged else None,
    }


def describe_tree(root: Node, stats: dict[str, Any], text_chars: int = DEFAULT_TEXT_CHARS) -> dict[str, Any]:
    """The description of the tree under ``root`` (see module docstring); ``stats`` are the tree's counters."""
    nodes: list[dict[str, Any]] = []
    first_call: list[int] = []  # per node: the smallest turn index at or below it
    counts: list[int] = []
    parents: list[int | None] = []
    stack: list[tuple[Node, int | None, Node, int]] = [
        (c, None, root, i) for i, c in reversed(list(enumerate(root.children)))]
    while stack:
        node, parent, parent_node, position = stack.pop()
        index = len(nodes)
        message = node.message
        text = message_text(message)
        entry: dict[str, Any] = {"id": index, "parent": parent, "role": node.role, "text": text[:text_chars],
                                 "chars": len(text)}
        if position > 0:
            entry["branch"] = "root" if parent is None else "fork"
        calls = _tool_calls(message, text_chars)
        if calls:
            entry["tool_calls"] = calls
        if message.get("tool_call_id"):
            entry["tool_call_id"] = str(message["tool_call_id"])
        if node.gen is not None:
            entry["gen"] = _gen(node, parent_node)
        nodes.append(entry)
        parents.append(parent)
        own = node.gen.index if node.gen is not None else None
        first_call.append(own if own is not None else -1)
        counts.append(1 if own is not None else 0)
        stack.extend((c, index, node, i) for i, c in reversed(list(enumerate(node.children))))
    for index in range(len(nodes) - 1, -1, -1):  # children come after their parent: fold upwards
        parent = parents[index]
        if parent is None:
            continue
        if first_call[index] >= 0 and (first_call[parent] < 0 or first_call[index] < first_call[parent]):
            first_call[parent] = first_call[index]
        counts[parent] += counts[index]
    for entry, call, count in zip(nodes, first_call, counts):
        entry["call"] = call if call >= 0 else None
        entry["calls"] = count
    return {"version": DESCRIPTION_VERSION, "stats": stats, "nodes": nodes}
