"""Tree nodes and the shared-prefix token store.

Each node is one chat message. A *generated* node (the response of a recorded turn) carries a
:class:`GenTurn`; routing-only nodes (system, user, tool, history assistant messages we did not
generate) carry none.

Why tokens are stored as deltas: in an agent session every prompt repeats the whole history, so keeping
each turn's ``prompt_ids`` costs O(turns x context) memory (quadratic). A generated turn instead stores
``own`` = the prompt tokens beyond the longest common prefix with its *base* (the nearest generated
ancestor's full sequence) followed by its response tokens. A turn that extends its base exactly
(token-in-token-out) stores only its bridge and response: the shared prefix exists once in the tree.
A drifted turn shares as much as actually matches. Sequences are read back as a list of array views
(:func:`seq_slices`) and concatenated only when a Sample is built.

No parent pointers: the tree has no reference cycles, so dropping it frees it at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable

import numpy as np

from rayrl.trajectory.drift import DriftInfo
from rayrl.trajectory.messages import routing_key


@dataclass(eq=False, slots=True)
class GenTurn:
    """The token side of one recorded turn, stored relative to its base.

    ``shared`` prompt tokens are ``base``'s first ``shared`` sequence tokens; ``own`` holds the rest of
    the prompt followed by the response. ``pred`` is the turn linearization joins onto (the nearest
    ancestor turn that is not merged); ``drift`` is set when this prompt does not extend ``pred``'s
    sequence. ``new_start`` is where this turn's own new prompt tokens begin (used to tell bridge drift
    from context drift in the *next* turn).
    """

    index: int
    own: np.ndarray  # int32: prompt tokens after `shared`, then the response
    logprobs: np.ndarray  # float32, one per response token
    versions: int | np.ndarray  # scalar, or int32 per response token
    finish_reason: str
    prompt_len: int
    shared: int
    base: "Node | None"
    pred: "Node | None"
    new_start: int
    drift: DriftInfo | None = None
    merged: bool = False

    @property
    def response_len(self) -> int:
        return len(self.logprobs)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def response(self) -> np.ndarray:
        return self.own[len(self.own) - self.response_len :]

    @property
    def bridge_version(self) -> int:
        """Version recorded for context tokens first seen in this turn's prompt: the turn's first version."""
        if isinstance(self.versions, np.ndarray):
            return int(self.versions[0]) if len(self.versions) else 0
        return int(self.versions)

    def response_versions(self) -> np.ndarray:
        if isinstance(self.versions, np.ndarray):
            return self.versions
        return np.full(self.response_len, self.versions, dtype=np.int32)


INDEX_FROM = 8  # children a node scans as a list; from this many on it looks them up by routing key


@dataclass(eq=False, slots=True)
class Node:
    """One chat message in the tree. ``hot`` is the child routed through most recently (checked first).

    ``index`` (built once a node has :data:`INDEX_FROM` children) maps :func:`routing_key` to the
    children under that key in insertion order, so finding a message among a node's children costs the
    same with ten children or ten thousand (a session retrying one prompt, or opening a new conversation
    under one system prompt on every call). Children are added with :meth:`add` and a child's message is
    replaced with :meth:`replace_message`, which keep it up to date.
    """

    message: dict[str, Any]
    gen: GenTurn | None = None
    children: list["Node"] = field(default_factory=list)
    hot: "Node | None" = None
    index: "dict[Hashable, list[Node]] | None" = None

    @property
    def role(self) -> str:
        return str(self.message.get("role", ""))

    def add(self, child: "Node", key: Hashable = None) -> None:
        """Append ``child`` (the newest child) and index it (under ``key`` when the caller has its
        :func:`routing_key` already)."""
        children = self.children
        children.append(child)
        index = self.index
        if index is not None:
            index.setdefault(routing_key(child.message) if key is None else key, []).append(child)
        elif len(children) >= INDEX_FROM:
            index = self.index = {}
            for c in children:
                index.setdefault(routing_key(c.message), []).append(c)

    def candidates(self, message: dict[str, Any], key: Hashable = None) -> list["Node"]:
        """The children that may equal ``message``, oldest first: all of them, or (once indexed) those
        under its routing key (``key``, when the caller has it). Callers still compare with
        :func:`messages_equal`."""
        index = self.index
        if index is None:
            return self.children
        return index.get(routing_key(message) if key is None else key, [])

    def replace_message(self, child: "Node", message: dict[str, Any]) -> None:
        """Give ``child`` (one of this node's children) a new message, moving it to its new key."""
        index = self.index
        if index is not None:
            old = routing_key(child.message)
            bucket = index[old]
            bucket.remove(child)
            if not bucket:
                del index[old]
            new = index.setdefault(routing_key(message), [])
            new.append(child)
            if len(new) > 1:  # keep insertion order within the bucket (a merge is rare: this may scan)
                new.sort(key=self.children.index)
        child.message = message


def seq_slices(node: Node, start: int, end: int) -> list[np.ndarray]:
    """Views covering tokens ``[start, end)`` of ``node``'s full sequence (prompt + response), in order.

    Walks the base chain: each turn contributes the part of ``own`` that falls in the range, then the
    range shrinks to the turn's shared prefix, which lives in its base.
    """
    out: list[np.ndarray] = []
    current: Node | None = node
    while current is not None and start < end:
        g = current.gen
        assert g is not None
        k = g.shared
        if end > k:
            out.append(g.own[max(start, k) - k : end - k])
            end = k
        current = g.base
    out.reverse()
    return out


def common_prefix(tokens: np.ndarray, node: Node | None) -> int:
    """Length of the longest common prefix of ``tokens`` and ``node``'s full sequence.

    Compares segment by segment (no concatenation of the stored sequence), so verifying that a
    1M-token prompt extends the previous sequence is one memcmp-speed pass over the stored segments.
    Equality is tested on raw bytes (``tobytes() ==`` is a memcmp and costs about half of
    ``np.array_equal`` per call); numpy finds the exact position only in the segment that differs.
    """
    if node is None:
        return 0
    assert node.gen is not None
    limit = min(len(tokens), node.gen.seq_len)
    if tokens.dtype != np.int32:
        tokens = tokens.astype(np.int32)
    offset = 0
    for seg in seq_slices(node, 0, limit):
        n = len(seg)
        mine = tokens[offset : offset + n]
        if mine.tobytes() != seg.tobytes():
            return offset + int(np.argmax(mine != seg))
        offset += n
    return offset
