"""TrajectoryTree: one per session. Routes every recorded turn into a tree of chat messages.

Routing (why a tree): an agent session is not one conversation. Sub-agents start from another system
prompt, context compaction restarts from a summary, a client may retry a call or branch. Walking each
request's messages from the root and mounting the turn at the deepest node whose root path equals a
prefix of the request makes all of these separate branches without any special casing.

* Matching is structural (:func:`messages_equal`); tool schemas never affect routing.
* Each node remembers the child it routed through last (``hot``) and checks it first, so an agent that
  keeps extending one conversation costs one ``dict ==`` per history message: less than parsing it.
  A node with many children (a prompt retried hundreds of times, a fresh conversation under one
  system prompt on every call) finds a message by its routing key (:meth:`Node.candidates`), so routing
  and the retry check never scan the turns recorded before it (the fork-merge check still looks through
  a node's children for its assistant child, stopping at the second).
* Request messages past the mount point become routing-only nodes; the response becomes a generated
  node carrying the turn's tokens (see :mod:`rayrl.trajectory.nodes` for the shared-prefix store).
* A retried call (same response message at the same place) is kept as a new sibling: both responses
  are real samples of the policy, and no generated token is ever dropped. Later turns route through the
  newest of equal siblings; the older one stays a leaf and becomes its own sample.
* Fork-merge rescue: see :meth:`TrajectoryTree._merge_candidate`. Each merge is logged at WARNING with
  the session, the node and the token counts: it is rare, and a run that merges often has a client
  re-rendering history in a way worth knowing about.
* ``debug_callback`` (:mod:`rayrl.trajectory.events`) sees every recorded turn, merge and drift with the
  node and the decision taken, for users' own logging.

What is kept: the first-seen dict of every distinct message (by reference: do not mutate recorded
messages), and per generated turn its token delta, log-probs, versions and finish reason. A turn's
``messages`` list, its ``tools`` and its full ``prompt_ids`` are not kept (they would make memory
quadratic in the session length). Not thread-safe: one tree per session, driven by one event loop.

Linearization into Samples lives in :mod:`rayrl.trajectory.linearize`; the description the inspector
reads (:meth:`TrajectoryTree.describe`) in :mod:`rayrl.trajectory.describe`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable

import numpy as np

from rayrl.trajectory.describe import DEFAULT_TEXT_CHARS, describe_tree
from rayrl.trajectory.drift import (
    DRIFT_ACTIONS,
    DriftInfo,
    DriftKind,
    SessionClosedError,
    classify_drift,
    drift_action,
)
from rayrl.trajectory.events import TreeCallback, TreeEvent
from rayrl.trajectory.linearize import linearize
from rayrl.trajectory.messages import messages_equal, routing_key
from rayrl.trajectory.nodes import GenTurn, Node, common_prefix
from rayrl.types import Sample, TurnRecord

logger = logging.getLogger(__name__)


def _owned(arr: np.ndarray) -> np.ndarray:
    """``arr`` if it owns its memory, else a copy: a stored view would keep a caller's big buffer alive."""
    return arr if arr.base is None else arr.copy()


class TrajectoryTree:
    """Per-session turn tree: record turns as they happen, turn them into Samples at the end.

    ``fork_merge_max_response_tokens``: a re-rendered earlier assistant message whose original response
    was shorter than this is merged onto the existing node instead of forking (0 disables the rescue).
    ``on_drift``: ``"split"`` starts a new Sample at a TITO drift; ``"raise"`` makes ``samples()`` raise
    :class:`TITODriftError`; ``"mask"`` keeps a drift inside the previous response in the same Sample
    when fewer than ``fork_merge_max_response_tokens`` tokens are given up
    (:func:`rayrl.trajectory.drift.drift_action`). ``session_id`` names the tree in logs and events;
    ``debug_callback`` receives a :class:`TreeEvent` per recorded turn, merge and drift.
    """

    def __init__(self, fork_merge_max_response_tokens: int = 1024, on_drift: str = "split", *,
                 session_id: str = "", debug_callback: TreeCallback | None = None) -> None:
        if on_drift not in DRIFT_ACTIONS:
            raise ValueError(f"on_drift must be one of {DRIFT_ACTIONS}, got {on_drift!r}")
        self.fork_merge_max_response_tokens = int(fork_merge_max_response_tokens)
        self.on_drift = on_drift
        self.session_id = session_id
        self.debug_callback = debug_callback
        self.callback_errors = 0
        self._root: Node | None = Node(message={"role": "<root>"})
        self._closed = False
        self._turns = 0
        self._nodes = 0
        self._leaves = 0
        self._forks = 0
        self._root_branches = 0
        self._retries = 0
        self._drift = {k.value: 0 for k in DriftKind}
        self._merged_rewrites = 0
        self._masked_tokens = 0
        self._generated_tokens = 0
        self._stored_tokens = 0
        self._tool_calls = 0  # tool calls in the recorded responses: what the model asked for

    # ------------------------------------------------------------------ recording

    def record_turn(self, turn: TurnRecord) -> None:
        """Mount one LLM call: route its request messages, add the rest, then the generated response.

        The tree keeps the message dicts it mounts and indexes them by value (a node with many children
        looks its children up by routing key), so they must not be changed after this call: the gateway
        builds fresh dicts per request; a caller of its own passes copies if it reuses them."""
        root = self._require_open()
        messages = turn.messages
        node, base, live = root, None, None
        depth, n = 0, len(messages)
        while depth < n:
            child = self._find_child(node, messages[depth])
            if child is None:
                break
            node.hot = child
            node = child
            if child.gen is not None:
                base = child
                if not child.gen.merged:
                    live = child
            depth += 1
        if depth < n and messages[depth].get("role") == "assistant":
            candidate = self._merge_candidate(node)
            if candidate is not None:
                self._merge(node, candidate, messages[depth])
                node.hot = candidate
                node, base = candidate, candidate
                depth += 1
        roots, forks = self._root_branches, self._forks
        for message in messages[depth:]:
            node = self._add_child(node, Node(message=message))
        gen = self._make_gen(turn, base, live)
        response = turn.response_message
        key = routing_key(response) if node.index is not None else None  # once for the lookup and the add
        retry = any(c.gen is not None and messages_equal(c.message, response) for c in node.candidates(response, key))
        if retry:
            self._retries += 1
        added = self._add_child(node, Node(message=response, gen=gen), key)
        self._turns += 1
        self._generated_tokens += gen.response_len
        calls = response.get("tool_calls")
        self._tool_calls += len(calls) if isinstance(calls, list) else 0
        if self.debug_callback is not None:
            self._emit_turn(added, retry, roots, forks)

    def _emit_turn(self, node: Node, retry: bool, roots: int, forks: int) -> None:
        """The drift event (if any) and the turn event of a node just recorded (``roots``, ``forks``: the
        branch counters before it was mounted)."""
        g = node.gen
        assert g is not None
        if g.drift is not None and g.pred is not None and g.pred.gen is not None:
            action = drift_action(self.on_drift, g.drift, g.pred.gen.prompt_len, self.fork_merge_max_response_tokens)
            self._emit(TreeEvent("drift", action, self.session_id, g.index, node,
                                 g.drift.prev_length - g.drift.position, g.drift))
        decision = ("retry" if retry else "root" if self._root_branches > roots
                    else "fork" if self._forks > forks else "extend")
        self._emit(TreeEvent("turn", decision, self.session_id, g.index, node, g.response_len, g.drift))

    def _emit(self, event: TreeEvent) -> None:
        """Hand ``event`` to the debug callback; a failing callback is counted, and logged the first time."""
        callback = self.debug_callback
        if callback is None:
            return
        try:
            callback(event)
        except Exception:
            self.callback_errors += 1
            level = logging.WARNING if self.callback_errors == 1 else logging.DEBUG
            logger.log(level, "trajectory debug callback failed on a %s event (session %s, turn %d); "
                       "recording goes on", event.kind, self.session_id or "-", event.turn, exc_info=True)

    def _find_child(self, node: Node, message: dict[str, Any]) -> Node | None:
        """The child equal to ``message``: the hot child first, then the newest equal sibling (among those
        under its routing key once the node has many children: no scan of a long list)."""
        hot = node.hot
        if hot is not None and messages_equal(hot.message, message):
            return hot
        for child in reversed(node.candidates(message)):
            if child is not hot and messages_equal(child.message, message):
                return child
        return None

    def _merge_candidate(self, node: Node) -> Node | None:
        """The node a re-rendered assistant message below ``node`` should be merged onto, if any.

        A request whose history diverges from the tree exactly at an assistant message usually means
        the client re-rendered an assistant message we generated (tool-argument key order, whitespace):
        forking would leave the original as a one-turn stub sample and route every later turn into a
        new branch. We merge only when the target is unambiguous and cheap to give up:

        * ``node`` has exactly one assistant child (two would be a retry or a branch: we cannot tell
          which one was re-rendered — stricter than "one leaf among the assistant children");
        * that child is a leaf (nothing was routed through its old form) and a generated turn that is
          not already merged;
        * its response is shorter than ``fork_merge_max_response_tokens`` (a long response is worth
          keeping as its own sample rather than giving up its training signal).
        """
        limit = self.fork_merge_max_response_tokens
        if limit <= 0:
            return None
        candidate = None
        for child in node.children:  # stops at a second assistant child (retries pile up many)
            if child.role == "assistant":
                if candidate is not None:
                    return None
                candidate = child
        if candidate is None:
            return None
        gen = candidate.gen
        if candidate.children or gen is None or gen.merged or gen.response_len >= limit:
            return None
        return candidate

    def _merge(self, parent: Node, node: Node, rewritten: dict[str, Any]) -> None:
        """Adopt the rewritten message so later turns route onto ``node`` (a child of ``parent``); it trains
        nothing now."""
        gen = node.gen
        assert gen is not None
        parent.replace_message(node, rewritten)
        gen.merged = True
        if gen.drift is not None:  # a merged turn is transparent: its drift no longer splits anything
            self._drift[gen.drift.kind.value] -= 1
        self._merged_rewrites += 1
        self._masked_tokens += gen.response_len
        logger.warning("fork-merge: session %s merged a re-rendered assistant message onto turn %d "
                       "(%d response tokens now masked, %d masked in this session)",
                       self.session_id or "-", gen.index, gen.response_len, self._masked_tokens)
        self._emit(TreeEvent("merge", "merge", self.session_id, gen.index, node, gen.response_len))

    def _add_child(self, parent: Node, child: Node, key: Hashable = None) -> Node:
        root = self._root
        if parent is root:
            self._root_branches += 1
            self._leaves += 1
        elif parent.children:
            self._forks += 1
            self._leaves += 1
        parent.add(child, key)
        parent.hot = child
        self._nodes += 1
        return child

    def _make_gen(self, turn: TurnRecord, base: Node | None, live: Node | None) -> GenTurn:
        """Store the turn's tokens relative to ``base`` and classify it against ``live`` (its predecessor)."""
        prompt = turn.prompt_ids
        shared = common_prefix(prompt, base)
        own = np.concatenate([prompt[shared:], turn.response_ids])  # a fresh array: owns its memory
        self._stored_tokens += len(own)
        common = shared if live is base else common_prefix(prompt, live)
        drift = None
        new_start = len(prompt)  # a turn with no predecessor: its whole prompt is initial context
        if live is not None:
            p = live.gen
            assert p is not None
            kind = classify_drift(common, len(prompt), p.seq_len, p.prompt_len, p.new_start)
            new_start = p.seq_len if kind is None else common
            if kind is not None:
                drift = DriftInfo(kind, self._turns, p.index, common, p.seq_len, len(prompt))
                self._drift[kind.value] += 1
                logger.debug("TITO drift (%s) at turn %d: first mismatch at token %d",
                             kind.value, drift.turn, common)
        versions = turn.policy_version
        return GenTurn(
            index=self._turns,
            own=own,
            logprobs=_owned(turn.response_logprobs),
            versions=_owned(versions) if isinstance(versions, np.ndarray) else int(versions),
            finish_reason=turn.finish_reason,
            prompt_len=len(prompt),
            shared=shared,
            base=base,
            pred=live,
            new_start=new_start,
            drift=drift,
        )

    # ------------------------------------------------------------------ output

    def samples(
        self,
        reward: float,
        metadata: dict[str, Any] | None = None,
        *,
        session_id: str = "",
        group_id: str = "",
    ) -> list[Sample]:
        """Linearize every root-to-leaf path into Samples (``[]`` for an empty tree).

        Every sample gets the episode's ``reward`` (its GRPO advantage is the episode's). ``metadata`` is
        copied into every sample's metadata, under the
        linearizer's own keys (``num_turns``, ``turn_indices``, ``trained_turns``, ``merged_turns``,
        ``merged_tokens``, ``drift``, ``leaf``), which win on a clash. Raises :class:`TITODriftError`
        on drift when ``on_drift="raise"`` (recording never raises, so nothing is lost before that).
        Under ``on_drift="mask"`` the keys ``realigned_turns`` / ``realigned_tokens`` count what was cut.
        """
        root = self._require_open()
        return linearize(
            root,
            reward=reward,
            metadata=metadata,
            session_id=session_id,
            group_id=group_id,
            on_drift=self.on_drift,
            mask_max_tokens=self.fork_merge_max_response_tokens,
        )

    def stats(self) -> dict[str, Any]:
        """Counts for metrics; every turn and every generated token is accounted for here."""
        return {
            "turns": self._turns,
            "tool_calls": self._tool_calls,
            "nodes": self._nodes,
            "leaves": self._leaves,
            "forks": self._forks,
            "root_branches": self._root_branches,
            "retries": self._retries,
            "drift": dict(self._drift),
            "merged_rewrites": self._merged_rewrites,
            "masked_tokens": self._masked_tokens,
            "generated_tokens": self._generated_tokens,
            "trainable_tokens": self._generated_tokens - self._masked_tokens,
            "stored_tokens": self._stored_tokens,
            "closed": self._closed,
        }

    def describe(self, text_chars: int = DEFAULT_TEXT_CHARS) -> dict[str, Any]:
        """The tree as a compact JSON-safe dict for inspection (:mod:`rayrl.trajectory.describe`)."""
        return describe_tree(self._require_open(), self.stats(), text_chars)

    def close(self) -> None:
        """Free the tree. Counters stay readable; recording or linearizing afterwards raises."""
        self._root = None
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def _require_open(self) -> Node:
        if self._root is None:
            raise SessionClosedError("this trajectory tree is closed")
        return self._root

    # ------------------------------------------------------------------ debugging

    def dump(self, decode: Callable[[np.ndarray], str] | None = None, width: int = 48) -> str:
        """A readable picture of the tree (for test failure messages and debugging).

        ``decode`` turns token arrays into text; when given, each generated node shows its stored
        tokens (bridge | response).
        """
        lines = [f"TrajectoryTree {self.stats()}"]
        if self._root is None:
            return "\n".join(lines + ["  <closed>"])
        stack: list[tuple[Node, int]] = [(c, 1) for c in reversed(self._root.children)]
        while stack:
            node, depth = stack.pop()
            lines.append("  " * depth + _describe(node, decode, width))
            stack.extend((c, depth + 1) for c in reversed(node.children))
        return "\n".join(lines)


def _describe(node: Node, decode: Callable[[np.ndarray], str] | None, width: int) -> str:
    msg = node.message
    text = str(msg.get("content") or "")
    calls = msg.get("tool_calls") or []
    if calls:
        names = ",".join(
            str((c.get("function") or {}).get("name", "?")) for c in calls if isinstance(c, dict)
        )
        text += f" calls[{names}]"
    if len(text) > width:
        text = text[: width - 3] + "..."
    line = f"{node.role}: {text!r}"
    g = node.gen
    if g is None:
        return line
    flags = [f"turn {g.index}", f"prompt {g.prompt_len}"]
    if g.base is not None:
        assert g.base.gen is not None
        flags.append(f"shares {g.shared} of turn {g.base.gen.index}")
    flags.append(f"resp {g.response_len}")
    flags.append(g.finish_reason)
    if g.merged:
        flags.append("MERGED")
    if g.drift is not None:
        flags.append(f"DRIFT {g.drift.kind.value}@{g.drift.position}")
    line = f"* {line} [{', '.join(flags)}]"
    if decode is not None:
        bridge = g.own[: len(g.own) - g.response_len]
        line += f"  tokens: {decode(bridge)} | {decode(g.response)}"
    return line
