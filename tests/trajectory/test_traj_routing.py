"""Routing layer: where turns mount in the tree (forks, branches, retries, fork-merge rescue)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from _traj_kit import Chat, Vocab, call, context, record

from rayrl.trajectory import SessionClosedError, TrajectoryTree, messages_equal
from rayrl.types import TurnRecord


def _stats_subset(tree: TrajectoryTree, **want: int) -> None:
    got = tree.stats()
    diff = {k: (got[k], w) for k, w in want.items() if got[k] != w}
    assert not diff, f"stats differ (got, want): {diff}\n{tree.dump()}"


def test_single_turn_mounts_messages_then_response() -> None:
    v = Vocab()
    c = Chat(v).user("fix bug")
    tree = record(TrajectoryTree(), c.respond("ok"))
    _stats_subset(tree, turns=1, nodes=3, leaves=1, forks=0, root_branches=1, generated_tokens=2)
    assert "system: 'S'" in tree.dump() and "* assistant: 'ok'" in tree.dump()


def test_linear_session_stays_one_path() -> None:
    v = Vocab()
    c = Chat(v).user("fix bug")
    tree = TrajectoryTree()
    tree.record_turn(c.respond("look", [call("ls", "d=.")]))
    c.tool("a.py")
    tree.record_turn(c.respond("read", [call("cat", "f=a.py")]))
    c.tool("print(1)")
    tree.record_turn(c.respond("done"))
    # system, user, a0, tool, a1, tool, a2
    _stats_subset(tree, turns=3, nodes=7, leaves=1, forks=0, root_branches=1)


def test_key_order_is_ignored() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("a", [call("ls", "d=.")]))
    c.tool("x")
    turn = c.respond("b")
    turn.messages = [dict(reversed(list(m.items()))) for m in turn.messages]  # same messages, keys reversed
    tree.record_turn(turn)
    _stats_subset(tree, turns=2, leaves=1, forks=0, nodes=5)


def test_empty_content_none_absent_and_empty_string_route_the_same() -> None:
    """Gateways store content "" for tool-call responses; clients echo null or omit it."""
    v = Vocab()
    for echoed in ({"content": None}, {}, {"content": ""}):
        c = Chat(v).user("go")
        tree = TrajectoryTree(fork_merge_max_response_tokens=0)  # no rescue: routing alone must match
        tree.record_turn(c.respond("", [call("ls", "d=.")]))
        c.messages[-1] = {"role": "assistant", "tool_calls": [call("ls", "d=.")], **echoed}
        c.tool("x")
        tree.record_turn(c.respond("b"))
        _stats_subset(tree, turns=2, leaves=1, forks=0)


def test_tool_schemas_never_affect_routing() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("a", tools=[{"type": "function", "function": {"name": "ls"}}]))
    c.tool("x")
    tree.record_turn(c.respond("b", tools=[{"type": "function", "function": {"name": "cat"}}]))
    _stats_subset(tree, turns=2, leaves=1, forks=0)


def test_sub_agent_with_other_system_prompt_is_a_separate_root_branch() -> None:
    v = Vocab()
    main = Chat(v, system="MAIN").user("task")
    sub = Chat(v, system="SUB").user("search")
    tree = record(TrajectoryTree(), main.respond("delegate"), sub.respond("found"))
    _stats_subset(tree, turns=2, root_branches=2, leaves=2, forks=0, nodes=6)


def test_compaction_forks_at_the_system_message() -> None:
    v = Vocab()
    c = Chat(v).user("task")
    tree = record(TrajectoryTree(), c.respond("a"))
    c.user("more")
    tree.record_turn(c.respond("b"))
    compacted = Chat(v).user("summary of task a more b")
    tree.record_turn(compacted.respond("c"))
    _stats_subset(tree, turns=3, root_branches=1, leaves=2, forks=1)


def test_different_tool_results_fork_at_the_assistant() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("a", [call("ls", "d=.")]))
    c1, c2 = c.fork().tool("r1"), c.fork().tool("r2")
    record(tree, c1.respond("b1"), c2.respond("b2"))
    _stats_subset(tree, turns=3, leaves=2, forks=1, nodes=7)


def test_request_shorter_than_the_path_mounts_at_an_inner_node() -> None:
    """A resample from an earlier point (same history as turn 0, new answer) forks at the user message."""
    v = Vocab()
    c = Chat(v).user("go")
    again = c.fork()
    tree = record(TrajectoryTree(), c.respond("a"))
    c.user("more")
    record(tree, c.respond("b"), again.respond("z"))
    _stats_subset(tree, turns=3, leaves=2, forks=1, retries=0)


def test_retried_call_keeps_both_turns_and_routes_onto_the_newest() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    first = c.respond("a")
    retry = copy.deepcopy(first)
    c.user("next")
    later = c.respond("b")
    tree = record(TrajectoryTree(), first, retry, later)
    _stats_subset(tree, turns=3, retries=1, forks=1, leaves=2, generated_tokens=6)
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    # DFS order: the older retry is its own one-turn sample; the newest carries on with turn 2.
    assert [s.metadata["turn_indices"] for s in samples] == [[0], [1, 2]], info
    assert sum(s.num_trained_tokens for s in samples) == 6, info


def _rewrite_session(threshold: int = 1024) -> tuple[TrajectoryTree, Chat, Vocab]:
    """Turn 1 calls ls with "a=1 b=2"; the client echoes it back re-rendered as "b=2 a=1"."""
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree(fork_merge_max_response_tokens=threshold)
    tree.record_turn(c.respond("plan"))
    c.user("do it")
    tree.record_turn(c.respond("", [call("ls", "a=1 b=2")]))
    c.messages[-1]["tool_calls"] = [call("ls", "b=2 a=1")]
    c.tool("out")
    tree.record_turn(c.respond("done"))
    return tree, c, v


def test_rewritten_short_assistant_message_is_merged_not_forked() -> None:
    tree, c, v = _rewrite_session()
    # turn 1's response: <call> ls a=1 b=2 <eot> = 5 tokens, now masked
    _stats_subset(tree, turns=3, forks=0, leaves=1, merged_rewrites=1, masked_tokens=5, trainable_tokens=4)
    dump = tree.dump()
    assert "MERGED" in dump and "b=2 a=1" not in dump  # dump shows names only
    c.tool("out2")
    tree.record_turn(c.respond("bye"))  # routes onto the rewritten form: still no fork
    _stats_subset(tree, turns=4, forks=0, leaves=1, merged_rewrites=1)


def test_rewrite_of_a_long_response_forks() -> None:
    tree, _, _ = _rewrite_session(threshold=5)  # response is exactly 5 tokens: not shorter than 5
    _stats_subset(tree, turns=3, forks=1, leaves=2, merged_rewrites=0, masked_tokens=0)


def test_threshold_zero_disables_the_rescue() -> None:
    tree, _, _ = _rewrite_session(threshold=0)
    _stats_subset(tree, forks=1, leaves=2, merged_rewrites=0)


def test_rewrite_is_not_merged_when_two_assistant_siblings_exist() -> None:
    """A retried call leaves two assistant children: we cannot tell which one was re-rendered."""
    v = Vocab()
    c = Chat(v).user("go")
    t0 = c.respond("", [call("ls", "a=1 b=2")])
    tree = record(TrajectoryTree(), t0, copy.deepcopy(t0))
    c.messages[-1]["tool_calls"] = [call("ls", "b=2 a=1")]
    c.tool("out")
    tree.record_turn(c.respond("done"))
    _stats_subset(tree, turns=3, retries=1, merged_rewrites=0, leaves=3)


def test_rewrite_is_not_merged_onto_an_inner_node() -> None:
    """Once a turn was routed through an assistant node, its old form is part of other paths."""
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("", [call("ls", "a=1 b=2")]))
    c.tool("out")
    tree.record_turn(c.respond("next"))
    late = Chat(v, messages=c.messages[:2] + [{"role": "assistant", "tool_calls": [call("ls", "b=2 a=1")]}])
    late.tool("out")
    tree.record_turn(late.respond("other"))
    _stats_subset(tree, turns=3, merged_rewrites=0, forks=1, leaves=2)


def test_divergence_at_a_user_message_never_merges() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("a"))
    c.messages[1]["content"] = "go now"
    tree.record_turn(c.respond("b"))
    _stats_subset(tree, merged_rewrites=0, forks=1, leaves=2)


def test_messages_equal_rules() -> None:
    a = {"role": "assistant", "content": "x", "tool_calls": [call("f", "1")]}
    assert messages_equal(a, {"tool_calls": [call("f", "1")], "content": "x", "role": "assistant"})
    assert messages_equal({"role": "assistant", "content": None}, {"role": "assistant", "content": ""})
    assert messages_equal({"role": "assistant", "content": None}, {"role": "assistant"})
    assert messages_equal({"role": "user", "content": "x", "name": None}, {"role": "user", "content": "x"})
    thinking = {"role": "assistant", "content": "x", "reasoning_content": "hmm"}
    assert messages_equal(thinking, {"role": "assistant", "content": "x"})
    assert not messages_equal({"role": "user", "content": "x"}, {"role": "assistant", "content": "x"})
    assert not messages_equal(a, {**a, "tool_calls": [call("f", "2")]})  # nested values compared strictly
    assert not messages_equal({"role": "user", "content": "x"}, {"role": "user", "content": "x", "name": "b"})


def test_empty_tree_has_no_samples_and_zero_stats() -> None:
    tree = TrajectoryTree()
    assert tree.samples(1.0) == []
    _stats_subset(tree, turns=0, nodes=0, leaves=0, generated_tokens=0)


def test_closed_tree_refuses_turns_and_frees_memory() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("a"))
    tree.close()
    assert tree.closed and tree.stats()["turns"] == 1
    with pytest.raises(SessionClosedError):
        tree.record_turn(c.respond("b"))
    with pytest.raises(SessionClosedError):
        tree.samples(1.0)
    assert "<closed>" in tree.dump()


def test_empty_response_is_kept() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("", empty=True, finish="abort"))
    _stats_subset(tree, turns=1, nodes=3, leaves=1, generated_tokens=0)
    samples = tree.samples(1.0)
    assert len(samples) == 1 and samples[0].response_length == 0 and samples[0].status == "aborted"


def test_invalid_options_fail_clearly() -> None:
    with pytest.raises(ValueError, match="on_drift"):
        TrajectoryTree(on_drift="ignore")


def test_hot_child_does_not_shadow_other_branches() -> None:
    """Interleaved sub-agents: routing must find each branch whatever was routed last."""
    v = Vocab()
    chats = [Chat(v, system=f"S{i}").user("go") for i in range(3)]
    tree = TrajectoryTree()
    for step in range(3):
        for c in chats:
            tree.record_turn(c.respond(f"r{step}"))
            c.user(f"u{step}")
    _stats_subset(tree, turns=9, root_branches=3, leaves=3, forks=0)


def test_caller_buffers_are_not_kept_alive() -> None:
    """Stored tokens never hold views of the caller's arrays (they would pin whole prompts)."""
    v = Vocab()
    c = Chat(v).user("go")
    big = np.arange(1000, dtype=np.int32)
    turn = c.respond("a")
    turn.response_logprobs = np.zeros(1000, dtype=np.float32)[: len(turn.response_ids)]
    turn.prompt_ids = np.concatenate([turn.prompt_ids, big])[: len(turn.prompt_ids)]
    tree = record(TrajectoryTree(), turn)
    gen = tree._root.children[0].children[0].children[0].gen  # type: ignore[union-attr]
    assert gen.own.base is None and gen.logprobs.base is None
    assert isinstance(turn, TurnRecord)
