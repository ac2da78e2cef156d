"""Recording a turn does not scan the session's earlier turns: a node with many children finds a message
by its routing key. Counted in comparisons (``messages_equal`` calls), never in time; and checked
against the plain scan (the index never changes where a turn mounts or what it trains)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_traj_property import _build_session

import rayrl.trajectory.describe as describe_mod
import rayrl.trajectory.nodes as nodes_mod
import rayrl.trajectory.tree as tree_mod
from rayrl.trajectory import TrajectoryTree, dump_samples, messages_equal
from rayrl.trajectory.messages import routing_key
from rayrl.types import TurnRecord

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}


def _turn(messages: list[dict[str, Any]], response: dict[str, Any], prompt_len: int = 12) -> TurnRecord:
    return TurnRecord(messages=[dict(m) for m in messages], response_message=response,
                      prompt_ids=np.arange(prompt_len, dtype=np.int32), response_ids=np.arange(4, dtype=np.int32),
                      response_logprobs=np.zeros(4, np.float32), policy_version=0)


def _retry_sampled(i: int) -> TurnRecord:
    """The same prompt again, a different sampled answer each time."""
    return _turn([SYSTEM, {"role": "user", "content": "Name a city."}], {"role": "assistant", "content": f"City {i}"})


def _retry_same(i: int) -> TurnRecord:
    """The overhead bench's shape: the same prompt and the same answer every time."""
    return _turn([SYSTEM, {"role": "user", "content": "Name a city."}], {"role": "assistant", "content": "Paris."})


def _fresh_conversation(i: int) -> TurnRecord:
    """A new conversation under the one system prompt on every call (side calls of a coding agent)."""
    return _turn([SYSTEM, {"role": "user", "content": f"Summarise file {i}."}],
                 {"role": "assistant", "content": f"Summary {i}"})


def _tool_call_retry(i: int) -> TurnRecord:
    """Sampled retries whose answers are all tool calls with empty content."""
    call = {"id": f"c{i}", "type": "function", "function": {"name": "ls", "arguments": f'{{"d": "{i}"}}'}}
    return _turn([SYSTEM, {"role": "user", "content": "List files."}],
                 {"role": "assistant", "content": None, "tool_calls": [call]})


def _count_comparisons(monkeypatch: pytest.MonkeyPatch, module: Any) -> list[int]:
    """Make ``module``'s ``messages_equal`` count its calls, in the returned one-element list."""
    calls = [0]

    def counted(a: dict[str, Any], b: dict[str, Any]) -> bool:
        calls[0] += 1
        return messages_equal(a, b)

    monkeypatch.setattr(module, "messages_equal", counted)
    return calls


def _comparisons_for_turn(monkeypatch: pytest.MonkeyPatch, make: Callable[[int], TurnRecord], earlier: int) -> int:
    """``messages_equal`` calls made recording one more turn into a session of ``earlier`` turns."""
    tree = TrajectoryTree()
    for i in range(earlier):
        tree.record_turn(make(i))
    calls = _count_comparisons(monkeypatch, tree_mod)
    tree.record_turn(make(earlier))
    monkeypatch.setattr(tree_mod, "messages_equal", messages_equal)
    assert tree.stats()["turns"] == earlier + 1
    return calls[0]


@pytest.mark.parametrize("make", [_retry_sampled, _retry_same, _fresh_conversation, _tool_call_retry])
def test_recording_a_turn_compares_as_much_after_1000_turns_as_after_10(
        monkeypatch: pytest.MonkeyPatch, make: Callable[[int], TurnRecord]) -> None:
    at_10 = _comparisons_for_turn(monkeypatch, make, 10)
    at_1000 = _comparisons_for_turn(monkeypatch, make, 1000)
    assert at_1000 == at_10 <= 4, (at_10, at_1000)


def test_describing_many_retries_compares_each_node_with_its_equals_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The inspector's retry flag looked at every sibling of every node: quadratic in a retried prompt."""
    tree = TrajectoryTree()
    for i in range(400):
        tree.record_turn(_retry_sampled(i))
    calls = _count_comparisons(monkeypatch, describe_mod)
    nodes = tree.describe()["nodes"]
    assert len(nodes) == 402 and calls[0] == 0  # 400 distinct answers: nothing shares a key
    assert not any(n["gen"]["retry"] for n in nodes if "gen" in n)


@pytest.mark.parametrize("a, b", [
    ({"role": "assistant", "content": None}, {"role": "assistant", "content": ""}),
    ({"role": "assistant", "content": None}, {"role": "assistant"}),
    ({"role": "user", "content": "x", "name": None}, {"role": "user", "content": "x"}),
    ({"role": "assistant", "content": "x", "reasoning_content": "r"}, {"role": "assistant", "content": "x"}),
    ({"content": "x", "role": "assistant", "tool_calls": [{"function": {"arguments": "{}", "name": "f"}}]},
     {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}], "content": "x"}),
    ({"role": "user", "content": [{"type": "text", "text": "hi"}]},
     {"role": "user", "content": [{"text": "hi", "type": "text"}]}),
    ({"role": "tool", "content": "1", "extra": {"n": 1, "l": [1, {"a": None}]}},
     {"role": "tool", "content": "1", "extra": {"l": [1.0, {"a": None}], "n": True}}),
])
def test_equal_messages_share_a_routing_key(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert messages_equal(a, b)
    assert routing_key(a) == routing_key(b) and hash(routing_key(a)) == hash(routing_key(b))


def test_unhashable_values_fall_into_one_bucket() -> None:
    a = {"role": "user", "content": "x", "blob": bytearray(b"1")}
    assert routing_key(a) == routing_key({"role": "user", "content": "x", "blob": bytearray(b"1")})


def _replay(turns: list[TurnRecord], index_from: int) -> tuple[str, dict[str, Any], dict[str, Any], str]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(nodes_mod, "INDEX_FROM", index_from)
        tree = TrajectoryTree(fork_merge_max_response_tokens=3)
        for t in turns:
            tree.record_turn(t)
        return tree.dump(), tree.stats(), tree.describe(), dump_samples(tree.samples(1.0))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_index_never_changes_the_tree(data: st.DataObject) -> None:
    """Random sessions (forks, retries, rewrites merged onto indexed nodes, drift) recorded with every node
    indexed from its first child and with none indexed: the same tree, stats, description and samples."""
    turns = _build_session(data)
    assert _replay(turns, 1) == _replay(turns, 10**9)


def test_a_merge_under_an_indexed_node_moves_the_child_to_its_new_key() -> None:
    user = {"role": "user", "content": "go"}
    tree = TrajectoryTree(fork_merge_max_response_tokens=100)
    answer = {"role": "assistant", "content": "a", "tool_calls": [{"function": {"name": "f", "arguments": '{"x":1}'}}]}
    tree.record_turn(_turn([SYSTEM, user], answer))
    for i in range(nodes_mod.INDEX_FROM):  # more children of the user node (follow-up user messages)
        tree.record_turn(_turn([SYSTEM, user, {"role": "user", "content": f"more {i}"}],
                               {"role": "assistant", "content": f"b{i}"}))
    rewritten = {**answer, "tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]}
    result = {"role": "tool", "content": "ok"}
    tree.record_turn(_turn([SYSTEM, user, rewritten, result], {"role": "assistant", "content": "c"}))
    assert tree.stats()["merged_rewrites"] == 1
    more = {"role": "user", "content": "more 0"}
    tree.record_turn(_turn([SYSTEM, user, more], {"role": "assistant", "content": "d"}))  # hot moves away
    before = tree.stats()
    tree.record_turn(_turn([SYSTEM, user, rewritten, result, {"role": "assistant", "content": "c"},
                            {"role": "user", "content": "next"}], {"role": "assistant", "content": "e"}))
    after = tree.stats()
    assert after["forks"] == before["forks"] and after["merged_rewrites"] == 1, tree.dump()


def test_an_indexed_tree_routes_the_same_after_pickling_and_keys_unhashable_values_by_type():
    """A copied tree (pickle: a checkpoint or a process boundary) keeps finding its children; a value JSON never
    gives (a bytearray) is keyed by its type, so equal messages still meet after the copy."""
    import pickle

    odd = {"role": "user", "content": "blob", "data": bytearray(b"x")}
    assert routing_key(odd) == routing_key(pickle.loads(pickle.dumps(odd)))
    assert routing_key({"role": "user", "tags": {1, 2}}) == routing_key({"role": "user", "tags": frozenset({1, 2})})
    tree = TrajectoryTree()
    for i in range(12):
        tree.record_turn(_turn([SYSTEM, dict(odd, content=f"blob {i}")], {"role": "assistant", "content": f"ok {i}"}))
    copy = pickle.loads(pickle.dumps(tree))
    system = copy._root.children[0]
    assert system.index is not None and len(system.children) == 12
    again = dict(odd, content="blob 3")
    assert [c.message["content"] for c in system.candidates(again) if messages_equal(c.message, again)] == ["blob 3"]
