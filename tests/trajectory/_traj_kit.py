"""Readable test data for trajectory trees: a word vocabulary, a toy chat template and a scripted chat.

Every token is a word ("<user>", "fix", "a1"), so expected Samples are written as text:
``"a1 <eot> ~<tool> ~ok ~<eot> ~<asst> a2 <eot>"`` where ``~`` marks a mask-0 token. Generated tokens get
log-prob ``-id / 100`` so expected log-probs follow from the tokens themselves.

The template: each message renders as ``<role> words... <eot>`` (assistant tool calls as
``<call> name args...``), a prompt ends with the generation prompt ``<asst>``, and a response is the
assistant message's words followed by ``<eot>`` — so an exactly echoed history re-renders to exactly
``previous prompt + response`` (token-in-token-out).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np

from rayrl.trajectory import TrajectoryTree, dump_samples
from rayrl.types import Sample, TurnRecord


class Vocab:
    """Words <-> ids, assigned on first use (ids start at 10 so 0 never appears by accident)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: dict[int, str] = {}

    def id(self, word: str) -> int:
        if word not in self._ids:
            i = 10 + len(self._ids)
            self._ids[word] = i
            self._words[i] = word
        return self._ids[word]

    def ids(self, words: str | list[str]) -> np.ndarray:
        seq = words.split() if isinstance(words, str) else words
        return np.array([self.id(w) for w in seq], dtype=np.int32)

    def words(self, ids: np.ndarray | list[int]) -> list[str]:
        return [self._words.get(int(i), f"#{int(i)}") for i in ids]

    def decode(self, ids: np.ndarray) -> str:
        return " ".join(self.words(ids))

    def logprobs(self, words: str | list[str]) -> np.ndarray:
        return (-self.ids(words) / 100.0).astype(np.float32)


def render_message(m: dict[str, Any]) -> list[str]:
    role = m["role"]
    tag = {"system": "<sys>", "user": "<user>", "tool": "<tool>", "assistant": "<asst>"}[role]
    words = [tag] + str(m.get("content") or "").split()
    for call in m.get("tool_calls") or []:
        fn = call["function"]
        words += ["<call>", fn["name"]] + fn["arguments"].split()
    return words + ["<eot>"]


def render_prompt(messages: list[dict[str, Any]]) -> list[str]:
    out: list[str] = []
    for m in messages:
        out += render_message(m)
    return out + ["<asst>"]


def call(name: str, args: str) -> dict[str, Any]:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": args}}


class Chat:
    """A scripted agent conversation that produces TurnRecords the way a gateway would."""

    def __init__(self, vocab: Vocab, system: str = "S", messages: list[dict[str, Any]] | None = None) -> None:
        self.v = vocab
        self.messages: list[dict[str, Any]] = (
            copy.deepcopy(messages) if messages is not None else [{"role": "system", "content": system}]
        )

    def user(self, text: str) -> "Chat":
        self.messages.append({"role": "user", "content": text})
        return self

    def tool(self, text: str) -> "Chat":
        self.messages.append({"role": "tool", "content": text, "tool_call_id": "c"})
        return self

    def fork(self) -> "Chat":
        return Chat(self.v, messages=self.messages)

    def respond(
        self,
        text: str,
        calls: list[dict[str, Any]] | None = None,
        *,
        version: int | list[int] = 0,
        finish: str = "stop",
        edit: Callable[[list[str]], list[str]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        empty: bool = False,
    ) -> TurnRecord:
        """One LLM call on the current history; the response is appended to the history (echoed).

        ``edit`` rewrites the prompt words (simulates a template that re-renders history differently:
        TITO drift). ``empty`` gives a response with no tokens at all.
        """
        prompt = render_prompt(self.messages)
        if edit is not None:
            prompt = edit(list(prompt))
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["tool_calls"] = calls
        response = [] if empty else render_message(message)[1:]
        turn = TurnRecord(
            messages=copy.deepcopy(self.messages),  # a request is parsed afresh each time
            response_message=message,
            prompt_ids=self.v.ids(prompt),
            response_ids=self.v.ids(response),
            response_logprobs=self.v.logprobs(response),
            policy_version=np.array(version, dtype=np.int32) if isinstance(version, list) else version,
            tools=tools,
            finish_reason=finish,
        )
        self.messages.append(copy.deepcopy(message))
        return turn


def record(tree: TrajectoryTree, *turns: TurnRecord) -> TrajectoryTree:
    for t in turns:
        tree.record_turn(t)
    return tree


def context(tree: TrajectoryTree, samples: list[Sample] | None, v: Vocab) -> str:
    text = "\n" + tree.dump(decode=v.decode)
    if samples is not None:
        text += "\n" + dump_samples(samples, v.decode)
    return text


def assert_sample(
    s: Sample,
    v: Vocab,
    prompt: str,
    response: str,
    *,
    versions: list[int] | None = None,
    info: str = "",
) -> None:
    """Exact check of one Sample: prompt words, response words with masks (``~`` = mask 0), log-probs.

    Log-probs must be ``-id/100`` where mask is 1 and 0 where mask is 0 (context or trained elsewhere).
    """
    want_words = [w.lstrip("~") if w != "~" else w for w in response.split()]
    want_mask = [0 if w.startswith("~") and w != "~" else 1 for w in response.split()]
    got_prompt = v.words(s.tokens[: s.prompt_length])
    got_resp = v.words(s.tokens[s.prompt_length :])
    assert got_prompt == prompt.split(), f"prompt differs:\n got  {got_prompt}\n want {prompt.split()}{info}"
    assert got_resp == want_words, f"response differs:\n got  {got_resp}\n want {want_words}{info}"
    got_mask = s.loss_mask.tolist()
    assert got_mask == want_mask, f"mask differs:\n got  {got_mask}\n want {want_mask}{info}"
    ids = s.tokens[s.prompt_length :]
    want_lp = np.where(np.array(want_mask, dtype=bool), -ids / 100.0, 0.0).astype(np.float32)
    assert np.allclose(s.rollout_logprobs, want_lp), f"logprobs {s.rollout_logprobs} != {want_lp}{info}"
    if versions is not None:
        got_versions = s.policy_versions.tolist()
        assert got_versions == versions, f"versions {got_versions} != {versions}{info}"


COLLECTED: list = []  # events received by collect_event


def collect_event(event: Any) -> None:
    """A debug callback importable by name (``trajectory.debug_callback: _traj_kit:collect_event``)."""
    COLLECTED.append(event)
