"""Linearization layer: exact tokens, masks, log-probs, versions, drift classification, dedup."""

from __future__ import annotations

import pytest
from _traj_kit import Chat, Vocab, assert_sample, call, context, record

from rayrl.trajectory import DriftKind, TITODriftError, TrajectoryTree

P0 = "<sys> S <eot> <user> go <eot> <asst>"


def _two_turns(edit=None, on_drift: str = "split") -> tuple[TrajectoryTree, Vocab]:
    """Turn 0 thinks and calls ls; turn 1 answers after the tool result (its prompt optionally edited)."""
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree(on_drift=on_drift)
    tree.record_turn(c.respond("think a1", [call("ls", "d=.")]))
    c.tool("f1")
    tree.record_turn(c.respond("done", edit=edit))
    return tree, v


def _three_turns(edit) -> tuple[TrajectoryTree, Vocab]:
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree()
    tree.record_turn(c.respond("a0", [call("ls", "d=.")]))
    c.tool("f1")
    tree.record_turn(c.respond("a1", [call("cat", "f=f1")]))
    c.tool("body")
    tree.record_turn(c.respond("done", edit=edit))
    return tree, v


def test_single_turn_sample() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("hello", version=7))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert len(samples) == 1, info
    assert_sample(samples[0], v, P0, "hello <eot>", versions=[7, 7], info=info)
    assert samples[0].status == "completed" and samples[0].prompt_length == 7
    assert samples[0].metadata["num_turns"] == 1 and samples[0].metadata["drift"] is None


def test_tito_turns_join_one_sample_with_masked_bridge() -> None:
    tree, v = _two_turns()
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert len(samples) == 1, info
    assert_sample(
        samples[0], v, P0,
        "think a1 <call> ls d=. <eot> ~<tool> ~f1 ~<eot> ~<asst> done <eot>",
        info=info,
    )
    assert samples[0].metadata["turn_indices"] == [0, 1]
    assert tree.stats()["drift"] == {"response": 0, "bridge": 0, "context": 0, "truncated": 0}


def test_per_token_versions_and_bridge_version() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree()
    tree.record_turn(c.respond("x y", version=[3, 4, 4]))  # weights changed mid-generation
    c.user("more")
    tree.record_turn(c.respond("z", version=5))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert_sample(
        samples[0], v, P0, "x y <eot> ~<user> ~more ~<eot> ~<asst> z <eot>",
        versions=[3, 4, 4, 5, 5, 5, 5, 5, 5], info=info,
    )


def test_response_drift_splits() -> None:
    """The client strips the reasoning word from the echoed response: first mismatch in turn 0's response."""
    tree, v = _two_turns(edit=lambda w: [x for x in w if x != "think"])
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert len(samples) == 2, info
    assert_sample(samples[0], v, P0, "think a1 <call> ls d=. <eot>", info=info)
    assert_sample(
        samples[1], v, P0 + " a1 <call> ls d=. <eot> <tool> f1 <eot> <asst>", "done <eot>", info=info
    )
    assert samples[1].metadata["drift"] == {
        "kind": "response", "turn": 1, "prev_turn": 0, "position": 7, "prev_length": 13, "prompt_length": 16,
    }
    assert tree.stats()["drift"]["response"] == 1


def test_bridge_drift_splits() -> None:
    """Turn 1's tool result re-renders differently once it is history: mismatch in turn 1's new tokens."""
    tree, v = _three_turns(edit=lambda w: ["F1" if x == "f1" and i < 20 else x for i, x in enumerate(w)])
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert tree.stats()["drift"] == {"response": 0, "bridge": 1, "context": 0, "truncated": 0}, info
    assert [s.metadata["turn_indices"] for s in samples] == [[0, 1], [2]], info
    assert samples[1].metadata["drift"]["kind"] == "bridge"
    assert_sample(
        samples[0], v, P0, "a0 <call> ls d=. <eot> ~<tool> ~f1 ~<eot> ~<asst> a1 <call> cat f=f1 <eot>",
        info=info,
    )
    assert_sample(
        samples[1], v,
        P0 + " a0 <call> ls d=. <eot> <tool> F1 <eot> <asst> a1 <call> cat f=f1 <eot>"
        " <tool> body <eot> <asst>",
        "done <eot>", info=info,
    )


def test_context_drift_splits() -> None:
    """The system prompt renders differently in turn 2: mismatch before turn 1's new tokens."""
    tree, v = _three_turns(edit=lambda w: ["S2" if x == "S" else x for x in w])
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert tree.stats()["drift"]["context"] == 1, info
    assert samples[1].metadata["drift"]["position"] == 1
    assert [s.metadata["turn_indices"] for s in samples] == [[0, 1], [2]], info


def test_truncated_prompt_splits() -> None:
    """The new prompt is a strict prefix of the previous sequence (history cut inside the response)."""
    tree, v = _two_turns(edit=lambda w: w[:10])
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert tree.stats()["drift"]["truncated"] == 1, info
    assert len(samples) == 2
    assert_sample(samples[1], v, P0 + " think a1 <call>", "done <eot>", info=info)


def test_drift_raises_when_configured() -> None:
    tree, _ = _two_turns(edit=lambda w: [x for x in w if x != "think"], on_drift="raise")
    assert tree.stats()["drift"]["response"] == 1  # recording never fails: nothing is lost
    with pytest.raises(TITODriftError) as err:
        tree.samples(1.0)
    assert err.value.info.kind is DriftKind.RESPONSE and err.value.info.turn == 1
    clean, _ = _two_turns(on_drift="raise")
    assert len(clean.samples(1.0)) == 1


def test_status_comes_from_the_last_turn_of_the_sample() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("a", finish="length"))
    assert tree.samples(1.0)[0].status == "truncated"
    c.user("again")
    tree.record_turn(c.respond("b", finish="abort"))
    assert tree.samples(1.0)[0].status == "aborted"
    c.user("last")
    tree.record_turn(c.respond("c", finish="tool_calls"))
    assert tree.samples(1.0)[0].status == "completed"


def test_every_sample_gets_the_episode_reward_and_metadata() -> None:
    v = Vocab()
    a, b = Chat(v, system="A").user("go"), Chat(v, system="B").user("go")
    tree = record(TrajectoryTree(), a.respond("x"), b.respond("y"))
    copied = tree.samples(2.0, {"task": "t1"}, session_id="s1", group_id="g1")
    assert [s.reward for s in copied] == [2.0, 2.0]
    assert all(s.session_id == "s1" and s.group_id == "g1" and s.metadata["task"] == "t1" for s in copied)
    assert [s.metadata["leaf"] for s in copied] == [0, 1]


def test_shared_turn_is_trained_once() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("a0", [call("ls", "d=.")]))
    c1, c2 = c.fork().tool("r1"), c.fork().tool("r2")
    record(tree, c1.respond("b1"), c2.respond("b2"))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert len(samples) == 2, info
    assert_sample(samples[0], v, P0, "a0 <call> ls d=. <eot> ~<tool> ~r1 ~<eot> ~<asst> b1 <eot>", info=info)
    assert_sample(
        samples[1], v, P0, "~a0 ~<call> ~ls ~d=. ~<eot> ~<tool> ~r2 ~<eot> ~<asst> b2 <eot>", info=info
    )
    assert [s.metadata["trained_turns"] for s in samples] == [2, 1]
    assert sum(s.num_trained_tokens for s in samples) == tree.stats()["generated_tokens"]


def test_sample_of_only_already_trained_turns_is_not_emitted() -> None:
    """Branch 2 drifts from the shared turn: its first piece would repeat turn 0 with nothing to train."""
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("a0"))
    c1, c2 = c.fork().user("u1"), c.fork().user("u2")
    tree.record_turn(c1.respond("b1"))
    tree.record_turn(c2.respond("b2", edit=lambda w: ["S9" if x == "S" else x for x in w]))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert [s.metadata["turn_indices"] for s in samples] == [[0, 1], [2]], info
    assert_sample(samples[1], v, "<sys> S9 <eot> <user> go <eot> <asst> a0 <eot> <user> u2 <eot> <asst>",
                  "b2 <eot>", info=info)


def test_merged_turn_is_transparent_and_masked() -> None:
    """The rewritten call appears only as context in the next prompt; turns 0 and 2 join one sample."""
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree()
    tree.record_turn(c.respond("plan"))
    c.user("do")
    tree.record_turn(c.respond("", [call("ls", "a=1 b=2")]))
    c.messages[-1]["tool_calls"] = [call("ls", "b=2 a=1")]
    c.tool("out")
    tree.record_turn(c.respond("done"))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert len(samples) == 1, info
    assert_sample(
        samples[0], v, P0,
        "plan <eot> ~<user> ~do ~<eot> ~<asst> ~<call> ~ls ~b=2 ~a=1 ~<eot>"
        " ~<tool> ~out ~<eot> ~<asst> done <eot>",
        info=info,
    )
    assert samples[0].metadata["turn_indices"] == [0, 2] and samples[0].metadata["merged_turns"] == 1
    st = tree.stats()
    assert (st["merged_rewrites"], st["masked_tokens"]) == (1, 5)
    assert samples[0].num_trained_tokens == st["trainable_tokens"] == 4


def test_shared_prefix_is_stored_once() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree()
    for i in range(10):
        tree.record_turn(c.respond(f"step{i} thinking words", [call("run", f"i={i}")]))
        c.tool(f"result{i} " * 5)
    samples = tree.samples(1.0)
    assert len(samples) == 1
    assert tree.stats()["stored_tokens"] == len(samples[0].tokens)  # every token exactly once


def test_linearize_is_repeatable() -> None:
    tree, _ = _two_turns()
    a, b = tree.samples(1.0), tree.samples(1.0)
    assert [s.to_dict() for s in a] == [s.to_dict() for s in b]
