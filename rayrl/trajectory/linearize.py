"""Linearization: root-to-leaf paths of a TrajectoryTree become training Samples, token for token.

Along each path the generated turns are walked in order. A turn joins the current Sample when its
prompt extends the previous turn's full sequence (prompt + response) exactly — token-in-token-out —
and the tokens in between (tool results, user messages, template glue) are context: mask 0, log-prob
0, version = that turn's version. When it does not (TITO drift, classified when the turn was recorded),
a new Sample starts, or ``TITODriftError`` is raised, or (``on_drift="mask"``, a small drift inside the
previous response: :func:`rayrl.trajectory.drift.drift_action`) the Sample goes on: it is cut back to
the first mismatching token, the new prompt's tokens from there on are context (mask 0), and the
previous response's tokens after the mismatch, which the new prompt no longer contains, train nothing
(``realigned_tokens``). The tokens before the mismatch keep mask 1: they were sampled in exactly that
context. The Sample is then exactly the new turn's prompt + response, as for a split, without losing
the earlier turns' shared context.

Why the tree decides joins at record time: the drift check needs the previous sequence, which the
tree already compared against when it stored the turn's tokens; repeating it here would cost a pass
over the whole context per turn. Linearization only concatenates stored segments.

A generated turn shared by several paths is trained once: mask 1 in the first Sample that contains
it in depth-first order (children in insertion order), context (mask 0, log-prob 0) in the others. A
Sample in which every turn was already trained elsewhere is pure duplication and is not emitted.
Merged turns (fork-merge rescue) are transparent: the next turn's prompt carries the client's
re-rendered form as context, so the merged turn's own tokens appear nowhere with mask 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from rayrl.trajectory.drift import DriftInfo, TITODriftError, drift_action
from rayrl.trajectory.nodes import GenTurn, Node, seq_slices
from rayrl.types import Sample, SampleStatus

_STATUS = {"length": SampleStatus.TRUNCATED.value, "abort": SampleStatus.ABORTED.value}


@dataclass
class _Group:
    """Consecutive turns of one path that form one Sample."""

    turns: list[Node] = field(default_factory=list)
    drift: DriftInfo | None = None
    merged: int = 0
    merged_tokens: int = 0
    leaf: int = 0
    realign: dict[int, int] = field(default_factory=dict)  # turn index -> first mismatching token (mask)


def _leaf_paths(root: Node) -> Iterator[list[Node]]:
    """Generated nodes on each root-to-leaf path, leaves in depth-first order (iterative: trees are deep)."""
    path: list[Node] = []
    stack: list[tuple[Node, int]] = [(c, 0) for c in reversed(root.children)]
    while stack:
        node, depth = stack.pop()
        del path[depth:]
        if node.gen is not None:
            path.append(node)
        if not node.children:
            yield list(path)
            continue
        stack.extend((c, len(path)) for c in reversed(node.children))


def _groups(path: list[Node], leaf: int, on_drift: str, mask_max_tokens: int) -> list[_Group]:
    groups: list[_Group] = []
    current: _Group | None = None
    pending_merged = pending_tokens = 0
    for node in path:
        g = node.gen
        assert g is not None
        if g.merged:
            pending_merged += 1
            pending_tokens += g.response_len
            continue
        action = "split"
        if g.drift is not None:
            pred = g.pred.gen if g.pred is not None else None
            action = drift_action(on_drift, g.drift, pred.prompt_len if pred is not None else 0, mask_max_tokens)
            if action == "raise":
                raise TITODriftError(g.drift)
        if current is None or (g.drift is not None and action != "mask"):
            current = _Group(drift=g.drift, leaf=leaf)
            groups.append(current)
        else:
            assert g.pred is current.turns[-1], "pred must be the previous live turn on the path"
            if g.drift is not None:
                current.realign[g.index] = g.drift.position
        current.turns.append(node)
        current.merged += pending_merged
        current.merged_tokens += pending_tokens
        pending_merged = pending_tokens = 0
    return groups


def _build(group: _Group, claimed: set[int]) -> dict[str, Any] | None:
    """Arrays of one Sample, or None when every turn in it is trained in an earlier Sample."""
    first = group.turns[0].gen
    assert first is not None
    tokens = seq_slices(group.turns[0], 0, first.prompt_len)
    masks: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    versions: list[np.ndarray] = []
    trained_turns = realigned_tokens = 0
    prev_end = first.prompt_len
    pred_trained = False
    for i, node in enumerate(group.turns):
        g: GenTurn = node.gen  # type: ignore[assignment]
        if i > 0:
            start = group.realign.get(g.index, prev_end)
            if start < prev_end:  # on_drift="mask": cut back to the first mismatching token
                _cut(tokens, start)
                for part in (masks, logprobs, versions):
                    _cut(part, start - first.prompt_len)
                realigned_tokens += prev_end - start
                pred = group.turns[i - 1].gen
                assert pred is not None
                if pred_trained and start <= pred.prompt_len:  # nothing of it is left to train
                    trained_turns -= 1
                prev_end = start
            n = g.prompt_len - prev_end
            tokens.extend(seq_slices(node, prev_end, g.prompt_len))
            masks.append(np.zeros(n, dtype=np.int8))
            logprobs.append(np.zeros(n, dtype=np.float32))
            versions.append(np.full(n, g.bridge_version, dtype=np.int32))
        trained = pred_trained = g.index not in claimed
        if trained:
            claimed.add(g.index)
            trained_turns += 1
        r = g.response_len
        tokens.append(g.response)
        masks.append(np.ones(r, dtype=np.int8) if trained else np.zeros(r, dtype=np.int8))
        logprobs.append(g.logprobs if trained else np.zeros(r, dtype=np.float32))
        versions.append(g.response_versions())
        prev_end = g.seq_len
    if trained_turns == 0:
        return None
    last = group.turns[-1].gen
    assert last is not None
    return {
        "tokens": _cat(tokens, np.int32),
        "prompt_length": first.prompt_len,
        "loss_mask": _cat(masks, np.int8),
        "rollout_logprobs": _cat(logprobs, np.float32),
        "policy_versions": _cat(versions, np.int32),
        "status": _STATUS.get(last.finish_reason, SampleStatus.COMPLETED.value),
        "metadata": {
            "num_turns": len(group.turns),
            "turn_indices": [n.gen.index for n in group.turns],  # type: ignore[union-attr]
            "trained_turns": trained_turns,
            "merged_turns": group.merged,
            "merged_tokens": group.merged_tokens,
            "drift": group.drift.as_dict() if group.drift is not None else None,
            "realigned_turns": len(group.realign),
            "realigned_tokens": realigned_tokens,
            "leaf": group.leaf,
        },
    }


def _cut(parts: list[np.ndarray], n: int) -> None:
    """Keep only the first ``n`` elements of the concatenation of ``parts`` (in place)."""
    total = 0
    for i, part in enumerate(parts):
        if total + len(part) >= n:
            parts[i] = part[: n - total]
            del parts[i + 1 :]
            return
        total += len(part)


def _cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def linearize(
    root: Node,
    *,
    reward: float,
    metadata: dict[str, Any] | None = None,
    session_id: str = "",
    group_id: str = "",
    on_drift: str = "split",
    mask_max_tokens: int = 0,
) -> list[Sample]:
    """All Samples of the tree under ``root`` (see module docstring); each carries the episode's ``reward``.

    ``on_drift`` and ``mask_max_tokens`` decide what a drift does (:func:`rayrl.trajectory.drift.drift_action`).
    """
    claimed: set[int] = set()
    built: list[dict[str, Any]] = []
    for leaf, path in enumerate(_leaf_paths(root)):
        for group in _groups(path, leaf, on_drift, mask_max_tokens):
            parts = _build(group, claimed)
            if parts is not None:
                built.append(parts)
    base_meta = dict(metadata or {})
    samples = []
    for parts in built:
        parts["metadata"] = {**base_meta, **parts["metadata"]}
        samples.append(Sample(reward=reward, group_id=group_id, session_id=session_id, **parts))
    return samples


def dump_samples(samples: list[Sample], decode: Callable[[np.ndarray], str] | None = None) -> str:
    """A readable listing of Samples: prompt, then response tokens with their mask (for test messages)."""
    dec = decode or (lambda ids: " ".join(str(int(t)) for t in ids))
    lines = [f"{len(samples)} samples"]
    for i, s in enumerate(samples):
        keys = ("turn_indices", "trained_turns", "merged_turns", "drift", "realigned_tokens", "leaf")
        meta = {k: s.metadata.get(k) for k in keys}
        lines.append(f"[{i}] status={s.status} reward={s.reward:g} len={len(s.tokens)} {meta}")
        lines.append(f"    prompt: {dec(s.tokens[: s.prompt_length])}")
        resp = s.tokens[s.prompt_length :]
        shown = []
        for j in range(len(resp)):
            tag = "" if s.loss_mask[j] else "~"
            shown.append(f"{tag}{dec(resp[j : j + 1])}")
        lines.append(f"    response (~ = mask 0): {' '.join(shown)}")
        lines.append(f"    logprobs: {np.round(s.rollout_logprobs.astype(np.float64), 3).tolist()}")
        lines.append(f"    versions: {s.policy_versions.tolist()}")
    return "\n".join(lines)
