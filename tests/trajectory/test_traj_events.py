"""The debug callback (seed 004): an event per recorded turn, fork-merge and drift, with the node and the
decision; the fork-merge WARNING line; ``on_drift="mask"`` (seed 004's realign) and its limits."""

from __future__ import annotations

import logging

import pytest
from _traj_kit import COLLECTED, Chat, Vocab, assert_sample, call, context, record

from rayrl.config import TrajectoryConfig
from rayrl.gateway.sessions import SessionRegistry
from rayrl.trajectory import TrajectoryTree, TreeEvent

P0 = "<sys> S <eot> <user> go <eot> <asst>"


def _log(events: list[TreeEvent]) -> list[tuple[str, str, int]]:
    return [(e.kind, e.decision, e.turn) for e in events]


def test_every_turn_reports_where_it_landed() -> None:
    v = Vocab()
    events: list[TreeEvent] = []
    tree = TrajectoryTree(session_id="s0-abc", debug_callback=events.append)
    main = Chat(v).user("go")
    tree.record_turn(main.respond("a", [call("ls", "d=.")]))  # first turn: a new top-level branch
    main.tool("f1")
    again = main.fork()
    tree.record_turn(main.respond("b"))  # extends turn 0
    tree.record_turn(again.fork().respond("b"))  # the same call again, the same answer: a retry
    other = again.fork()
    other.messages[-1] = {"role": "tool", "content": "f2", "tool_call_id": "c"}
    tree.record_turn(other.respond("c"))  # another tool result under turn 0: a fork
    tree.record_turn(Chat(v, system="SUB").user("find").respond("d"))  # a sub-agent: another root
    assert _log(events) == [("turn", "root", 0), ("turn", "extend", 1), ("turn", "retry", 2),
                            ("turn", "fork", 3), ("turn", "root", 4)], context(tree, None, v)
    assert all(e.session_id == "s0-abc" and e.node.gen is not None and e.node.gen.index == e.turn for e in events)
    assert events[1].node.message == {"role": "assistant", "content": "b"} and events[1].tokens == 2
    assert events[0].as_dict() == {"kind": "turn", "decision": "root", "session_id": "s0-abc", "turn": 0,
                                   "role": "assistant", "tokens": 5, "drift": None}


def test_merge_and_drift_events_and_the_merge_warning(caplog) -> None:
    v = Vocab()
    events: list[TreeEvent] = []
    tree = TrajectoryTree(session_id="s0-merge", debug_callback=events.append)
    c = Chat(v).user("go")
    tree.record_turn(c.respond("", [call("ls", "a=1 b=2")]))
    c.messages[-1]["tool_calls"] = [call("ls", "b=2 a=1")]  # the client re-renders the call
    c.tool("out")
    with caplog.at_level(logging.WARNING, logger="rayrl.trajectory.tree"):
        tree.record_turn(c.respond("check"))
    c.user("end")
    tree.record_turn(c.respond("bye", edit=lambda w: ["OUT" if x == "out" else x for x in w]))
    assert _log(events) == [("turn", "root", 0), ("merge", "merge", 0), ("turn", "extend", 1),
                            ("drift", "split", 2), ("turn", "extend", 2)], context(tree, None, v)
    merge, drift = events[1], events[3]
    assert merge.node.message["tool_calls"][0]["function"]["arguments"] == "b=2 a=1"  # the node took the rewrite
    assert merge.tokens == 5 and merge.node.gen is not None and merge.node.gen.merged
    # turn 1 joins no earlier turn (turn 0 was merged), so all of its prompt is context to turn 2
    assert drift.drift is not None and drift.drift.kind.value == "context" and drift.drift.prev_turn == 1
    assert drift.tokens == drift.drift.prev_length - drift.drift.position
    warnings = [r for r in caplog.records if "fork-merge" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert "s0-merge" in warnings[0].getMessage() and "turn 0" in warnings[0].getMessage()
    assert "5 response tokens now masked" in warnings[0].getMessage()


def test_a_failing_callback_never_breaks_recording(caplog) -> None:
    v = Vocab()

    def broken(event: TreeEvent) -> None:
        raise RuntimeError("user bug")

    tree = TrajectoryTree(session_id="s0-x", debug_callback=broken)
    c = Chat(v).user("go")
    with caplog.at_level(logging.DEBUG, logger="rayrl.trajectory.tree"):
        tree.record_turn(c.respond("a"))
        c.user("more")
        tree.record_turn(c.respond("b"))
    assert tree.stats()["turns"] == 2 and tree.callback_errors == 2
    assert len(tree.samples(1.0)) == 1
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) == 1 and "debug callback failed" in loud[0].getMessage() and loud[0].exc_info


def test_registry_wires_the_configured_callback_and_drift_mode() -> None:
    COLLECTED.clear()
    registry = SessionRegistry(TrajectoryConfig(on_drift="mask", fork_merge_max_response_tokens=7,
                                                debug_callback="_traj_kit:collect_event"))
    session = registry.open()
    assert session.tree.on_drift == "mask" and session.tree.fork_merge_max_response_tokens == 7
    session.tree.record_turn(Chat(Vocab()).user("go").respond("a"))
    assert [(e.kind, e.session_id) for e in COLLECTED] == [("turn", session.session_id)]
    with pytest.raises(ValueError, match="trajectory.debug_callback"):
        SessionRegistry(TrajectoryConfig(debug_callback="_traj_kit:no_such_function"))


# -- on_drift="mask" --------------------------------------------------------------------------------


def _two(edit, **tree_kwargs) -> tuple[TrajectoryTree, Vocab, list[TreeEvent]]:
    v = Vocab()
    events: list[TreeEvent] = []
    c = Chat(v).user("go")
    tree = TrajectoryTree(debug_callback=events.append, **tree_kwargs)
    tree.record_turn(c.respond("think a1", [call("ls", "d=.")]))
    c.tool("f1")
    tree.record_turn(c.respond("done", edit=edit))
    return tree, v, events


def test_mask_replaces_the_drifted_response_and_keeps_one_sample() -> None:
    """The client strips the first word of the previous response: the same Sample goes on from the
    mismatch with the new prompt's tokens as context; the dropped response tokens train nothing."""
    tree, v, events = _two(lambda w: [x for x in w if x != "think"], on_drift="mask")
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert len(samples) == 1, info
    assert_sample(samples[0], v, P0, "~a1 ~<call> ~ls ~d=. ~<eot> ~<tool> ~f1 ~<eot> ~<asst> done <eot>", info=info)
    meta = samples[0].metadata
    assert meta["turn_indices"] == [0, 1] and meta["trained_turns"] == 1
    assert meta["realigned_turns"] == 1 and meta["realigned_tokens"] == 6 and meta["drift"] is None
    assert ("drift", "mask", 1) in _log(events)
    assert tree.stats()["drift"]["response"] == 1  # still counted as drift


def test_mask_keeps_the_response_tokens_before_the_mismatch_trained() -> None:
    """Seed 004's case B1: a drift late in the previous response (its last argument re-rendered)."""
    tree, v, _ = _two(lambda w: ["d=," if x == "d=." else x for x in w], on_drift="mask")
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert len(samples) == 1, info
    assert_sample(samples[0], v, P0, "think a1 <call> ls ~d=, ~<eot> ~<tool> ~f1 ~<eot> ~<asst> done <eot>", info=info)
    assert samples[0].metadata["realigned_tokens"] == 2 and samples[0].metadata["trained_turns"] == 2


def test_mask_after_a_cut_inside_the_previous_response() -> None:
    tree, v, _ = _two(lambda w: w[:10], on_drift="mask")  # the history stops after "think a1 <call>"
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert tree.stats()["drift"]["truncated"] == 1 and len(samples) == 1, info
    assert_sample(samples[0], v, P0, "think a1 <call> done <eot>", info=info)


@pytest.mark.parametrize("edit, limit, why", [
    (lambda w: [x for x in w if x != "think"], 6, "6 tokens would be given up: not fewer than the limit"),
    (lambda w: [x for x in w if x != "think"], 0, "the limit 0 turns masking off"),
    (lambda w: ["S2" if x == "S" else x for x in w], 1024, "context drift would give up earlier turns"),
])
def test_mask_falls_back_to_split(edit, limit, why) -> None:
    tree, v, events = _two(edit, on_drift="mask", fork_merge_max_response_tokens=limit)
    samples = tree.samples(1.0)
    info = context(tree, samples, v) + "\n" + why
    assert [s.metadata["turn_indices"] for s in samples] == [[0], [1]], info
    assert samples[1].metadata["realigned_turns"] == 0 and samples[1].metadata["drift"] is not None
    assert ("drift", "split", 1) in _log(events), info


def test_bridge_drift_splits_under_mask() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree(on_drift="mask")
    tree.record_turn(c.respond("a0", [call("ls", "d=.")]))
    c.tool("f1")
    tree.record_turn(c.respond("a1", [call("cat", "f=f1")]))
    c.tool("body")
    tree.record_turn(c.respond("done", edit=lambda w: ["F1" if x == "f1" and i < 20 else x for i, x in enumerate(w)]))
    samples = tree.samples(1.0)
    assert [s.metadata["turn_indices"] for s in samples] == [[0, 1], [2]], context(tree, samples, v)


def test_mask_drift_in_a_longer_session_keeps_later_turns_joined() -> None:
    """A mask-join, then a clean turn: one Sample, exactly the last prompt + response, every
    generated token accounted for (trained, or given up and counted)."""
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree(on_drift="mask")
    tree.record_turn(c.respond("think a1", [call("ls", "d=.")]))
    c.tool("f1")

    def drop(words: list[str]) -> list[str]:  # the client never echoes "think"
        return [x for x in words if x != "think"]

    tree.record_turn(c.respond("b", edit=drop))
    c.user("more")
    tree.record_turn(c.respond("c", edit=drop))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert len(samples) == 1 and samples[0].metadata["turn_indices"] == [0, 1, 2], info
    assert_sample(samples[0], v, P0, "~a1 ~<call> ~ls ~d=. ~<eot> ~<tool> ~f1 ~<eot> ~<asst> b <eot> "
                  "~<user> ~more ~<eot> ~<asst> c <eot>", info=info)
    st = tree.stats()
    assert samples[0].num_trained_tokens + samples[0].metadata["realigned_tokens"] == st["generated_tokens"]


def test_record_helper_still_works_with_events() -> None:
    v = Vocab()
    events: list[TreeEvent] = []
    c = Chat(v).user("go")
    record(TrajectoryTree(debug_callback=events.append), c.respond("x"))
    assert _log(events) == [("turn", "root", 0)]
