"""Combined and stress scenarios: sub-agents, compaction, drift inside forks, merges, deep trees."""

from __future__ import annotations

import time

import numpy as np
from _traj_kit import Chat, Vocab, assert_sample, call, context, record

from rayrl.trajectory import TrajectoryTree
from rayrl.types import TurnRecord


def _trained(samples) -> int:
    return sum(s.num_trained_tokens for s in samples)


def test_sub_agent_interleaved_with_main_agent() -> None:
    v = Vocab()
    main = Chat(v, system="MAIN").user("task")
    sub = Chat(v, system="SUB").user("find x")
    tree = TrajectoryTree()
    tree.record_turn(main.respond("", [call("agent", "q=x")]))
    tree.record_turn(sub.respond("", [call("grep", "x")]))
    sub.tool("x.py")
    tree.record_turn(sub.respond("in x.py"))
    main.tool("in x.py")
    tree.record_turn(main.respond("fixed"))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert [s.metadata["turn_indices"] for s in samples] == [[0, 3], [1, 2]], info
    assert_sample(
        samples[0], v, "<sys> MAIN <eot> <user> task <eot> <asst>",
        "<call> agent q=x <eot> ~<tool> ~in ~x.py ~<eot> ~<asst> fixed <eot>", info=info,
    )
    assert_sample(
        samples[1], v, "<sys> SUB <eot> <user> find x <eot> <asst>",
        "<call> grep x <eot> ~<tool> ~x.py ~<eot> ~<asst> in x.py <eot>", info=info,
    )
    st = tree.stats()
    assert (st["root_branches"], st["leaves"], st["forks"]) == (2, 2, 0)


def test_compaction_mid_session() -> None:
    v = Vocab()
    c = Chat(v).user("task")
    tree = TrajectoryTree()
    tree.record_turn(c.respond("a", [call("ls", "d=.")]))
    c.tool("many files")
    tree.record_turn(c.respond("b"))
    compacted = Chat(v).user("summary: listed files")
    tree.record_turn(compacted.respond("c", [call("cat", "f")]))
    compacted.tool("text")
    tree.record_turn(compacted.respond("d"))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert [s.metadata["turn_indices"] for s in samples] == [[0, 1], [2, 3]], info
    assert_sample(
        samples[1], v, "<sys> S <eot> <user> summary: listed files <eot> <asst>",
        "c <call> cat f <eot> ~<tool> ~text ~<eot> ~<asst> d <eot>", info=info,
    )
    assert tree.stats()["forks"] == 1 and _trained(samples) == tree.stats()["generated_tokens"]


def test_tree_fork_plus_token_drift_on_one_branch() -> None:
    """Branch B re-renders the shared turn's response: B's first piece would only repeat turn 0."""
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("think a0", [call("ls", "d=.")]))
    a, b = c.fork().tool("ra"), c.fork().tool("rb")
    strip = lambda w: [x for x in w if x != "think"]  # noqa: E731
    tree.record_turn(a.respond("a1"))
    tree.record_turn(b.respond("b1", edit=strip))
    b.user("more")
    tree.record_turn(b.respond("b2", edit=strip))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    assert [s.metadata["turn_indices"] for s in samples] == [[0, 1], [2, 3]], info
    assert_sample(
        samples[1], v, "<sys> S <eot> <user> go <eot> <asst> a0 <call> ls d=. <eot> <tool> rb <eot> <asst>",
        "b1 <eot> ~<user> ~more ~<eot> ~<asst> b2 <eot>", info=info,
    )
    st = tree.stats()
    assert st["drift"]["response"] == 1 and st["forks"] == 1, info  # turn 3 extends turn 2: no drift
    assert _trained(samples) == st["generated_tokens"]


def test_rewrite_merge_then_drift_later() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree()
    tree.record_turn(c.respond("plan"))
    c.user("do")
    tree.record_turn(c.respond("", [call("ls", "a=1 b=2")]))
    c.messages[-1]["tool_calls"] = [call("ls", "b=2 a=1")]
    c.tool("out")
    tree.record_turn(c.respond("check"))
    c.user("end")
    tree.record_turn(c.respond("bye", edit=lambda w: ["PLAN" if x == "plan" else x for x in w]))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    # turn 3's edit hits turn 0's response; turn 2's own new tokens start after it: context drift.
    st = tree.stats()
    assert st["merged_rewrites"] == 1 and st["drift"]["context"] == 1, info
    assert [s.metadata["turn_indices"] for s in samples] == [[0, 2], [3]], info
    assert _trained(samples) == st["trainable_tokens"] == 2 + 2 + 2
    assert_sample(
        samples[1], v,
        "<sys> S <eot> <user> go <eot> <asst> PLAN <eot> <user> do <eot> <asst> <call> ls b=2 a=1 <eot> "
        "<tool> out <eot> <asst> check <eot> <user> end <eot> <asst>",
        "bye <eot>", info=info,
    )


def test_merge_then_fork_below_the_merged_node() -> None:
    v = Vocab()
    c = Chat(v).user("go")
    tree = record(TrajectoryTree(), c.respond("", [call("ls", "a=1 b=2")]))
    c.messages[-1]["tool_calls"] = [call("ls", "b=2 a=1")]
    x, y = c.fork().tool("rx"), c.fork().tool("ry")
    record(tree, x.respond("x1"), y.respond("y1"))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    st = tree.stats()
    assert (st["merged_rewrites"], st["forks"], st["leaves"]) == (1, 1, 2), info
    assert [s.metadata["turn_indices"] for s in samples] == [[1], [2]], info
    assert_sample(
        samples[1], v, "<sys> S <eot> <user> go <eot> <asst> <call> ls b=2 a=1 <eot> <tool> ry <eot> <asst>",
        "y1 <eot>", info=info,
    )


def test_every_drift_kind_in_one_session() -> None:
    """Each re-rendering starts at one turn and persists; the truncation is a one-off."""
    v = Vocab()
    c = Chat(v).user("go")
    tree = TrajectoryTree()
    edits = {
        2: lambda w: [x for x in w if x != "t1"],  # response: turn 1's reasoning word stripped
        4: lambda w: ["R2x" if x == "R2" else x for x in w],  # bridge: turn 3's tool result re-rendered
        6: lambda w: ["Sx" if x == "S" else x for x in w],  # context: system prompt re-rendered
    }

    def edit(w: list[str], i: int) -> list[str]:
        for k, fn in edits.items():
            if k <= i:
                w = fn(w)
        return w[: len(w) - 6] if i == 8 else w  # truncated: history cut inside turn 7's response

    for i in range(10):
        tree.record_turn(c.respond(f"t{i} w", [call("run", f"n={i}")], edit=lambda w, i=i: edit(w, i)))
        c.tool(f"R{i}")
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    st = tree.stats()
    # turn 9 renders the full history again: it differs from turn 8's (cut) sequence where turn 8's
    # response begins, so that is response drift too.
    assert st["drift"] == {"response": 2, "bridge": 1, "context": 1, "truncated": 1}, info
    assert [s.metadata["turn_indices"] for s in samples] == [[0, 1], [2, 3], [4, 5], [6, 7], [8], [9]], info
    kinds = [s.metadata["drift"]["kind"] for s in samples[1:]]
    assert kinds == ["response", "bridge", "context", "truncated", "response"], info
    assert _trained(samples) == st["generated_tokens"], info
    assert_sample(
        samples[4], v,
        "<sys> Sx <eot> <user> go <eot> <asst> t0 w <call> run n=0 <eot> <tool> R0 <eot> "
        "<asst> w <call> run n=1 <eot> <tool> R1 <eot> "
        "<asst> t2 w <call> run n=2 <eot> <tool> R2x <eot> "
        "<asst> t3 w <call> run n=3 <eot> <tool> R3 <eot> "
        "<asst> t4 w <call> run n=4 <eot> <tool> R4 <eot> "
        "<asst> t5 w <call> run n=5 <eot> <tool> R5 <eot> "
        "<asst> t6 w <call> run n=6 <eot> <tool> R6 <eot> "
        "<asst> t7 w <call> run",
        "t8 w <call> run n=8 <eot>", info=info,
    )


def test_deep_multi_leaf_tree_trains_each_turn_once() -> None:
    """Three levels of binary branching plus a sub-agent: 9 leaves, every generated token trained once."""
    v = Vocab()
    root = Chat(v).user("go")
    tree = record(TrajectoryTree(), root.respond("r", [call("f", "0")]))
    frontier = [root]
    for level in range(3):
        nxt = []
        for j, c in enumerate(frontier):
            for k in range(2):
                child = c.fork().tool(f"L{level}.{j}.{k}")
                tree.record_turn(child.respond(f"g{level}.{j}.{k}", [call("f", f"{level}{j}{k}")]))
                nxt.append(child)
        frontier = nxt
    sub = Chat(v, system="SUB").user("help")
    tree.record_turn(sub.respond("h"))
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    st = tree.stats()
    assert (st["turns"], st["leaves"], st["forks"], st["root_branches"]) == (16, 9, 7, 2), info
    assert len(samples) == 9 and all(s.reward == 1.0 for s in samples), info
    assert [s.metadata["trained_turns"] for s in samples] == [4, 1, 2, 1, 3, 1, 2, 1, 1], info
    assert _trained(samples) == st["generated_tokens"], info
    # every leaf sample holds its whole path: root turn + 3 levels, prefix turns masked after the first
    assert all(s.metadata["num_turns"] == 4 for s in samples[:8]), info
    last = samples[7]
    assert v.words(last.tokens[last.prompt_length :])[:4] == ["r", "<call>", "f", "0"]
    assert last.loss_mask[:4].tolist() == [0, 0, 0, 0]


def test_long_mixed_session() -> None:
    """60 main turns with sub-agents every 10, one compaction, periodic drift, rewrites and retries."""
    v = Vocab()
    main = Chat(v, system="MAIN").user("big task")
    tree = TrajectoryTree()
    expected_generated = 0
    stripped: set[str] = set()
    for i in range(60):
        edit = None
        if i % 15 == 14:  # the client starts stripping one earlier reasoning word: response drift
            stripped.add(f"why{i - 1}")
        if stripped:
            edit = lambda w, s=frozenset(stripped): [x for x in w if x not in s]  # noqa: E731
        t = main.respond(f"why{i} step{i}", [call("run", f"k={i} j={i}")], edit=edit)
        tree.record_turn(t)
        expected_generated += len(t.response_ids)
        if i % 20 == 7:  # a rewrite of this short call comes back with reordered arguments
            main.messages[-1]["tool_calls"] = [call("run", f"j={i} k={i}")]
        if i % 25 == 3:  # a retried call
            tree.record_turn(t)
            expected_generated += len(t.response_ids)
        main.tool(f"out{i}")
        if i % 10 == 5:
            sub = Chat(v, system="SUB").user(f"sub{i}")
            for j in range(3):
                st = sub.respond(f"s{i}.{j}")
                tree.record_turn(st)
                expected_generated += len(st.response_ids)
                sub.user("go on")
        if i == 40:  # compaction: the main agent restarts from a summary
            main = Chat(v, system="MAIN").user("summary so far")
            stripped.clear()
    samples = tree.samples(1.0)
    info = context(tree, samples, v)
    st = tree.stats()
    assert st["turns"] == 60 + 18 + 3, info
    assert st["generated_tokens"] == expected_generated
    assert st["merged_rewrites"] == 3 and st["retries"] == 3, info
    assert st["drift"]["response"] == 4, info  # i=14, 29, 44, 59 each strip one more reasoning word
    assert _trained(samples) == st["trainable_tokens"] == expected_generated - st["masked_tokens"], info
    assert st["masked_tokens"] == 3 * 7  # each merged call: why step <call> run k= j= <eot>
    for s in samples:  # TITO: each sample's tokens are exactly its last turn's prompt + response
        assert s.prompt_length > 0 and len(s.loss_mask) == len(s.tokens) - s.prompt_length


def test_large_session_is_linear_in_memory_and_fast() -> None:
    """100 turns x 2,000 tokens: each token stored once; samples() well under a second."""
    rng = np.random.default_rng(0)
    tree = TrajectoryTree()
    seq = rng.integers(0, 50_000, 500, dtype=np.int32)
    messages = [{"role": "system", "content": "S"}]
    for i in range(100):
        resp = rng.integers(0, 50_000, 400, dtype=np.int32)
        turn = TurnRecord(
            messages=list(messages), response_message={"role": "assistant", "content": f"a{i}"},
            prompt_ids=seq, response_ids=resp, response_logprobs=np.full(400, -0.5, np.float32),
        )
        tree.record_turn(turn)
        messages += [turn.response_message, {"role": "tool", "content": f"r{i}"}]
        seq = np.concatenate([seq, resp, rng.integers(0, 50_000, 1600, dtype=np.int32)])
    t0 = time.perf_counter()
    samples = tree.samples(1.0)
    elapsed = time.perf_counter() - t0
    st = tree.stats()
    assert len(samples) == 1 and st["stored_tokens"] == len(samples[0].tokens) == 500 + 99 * 2000 + 400
    assert samples[0].num_trained_tokens == 100 * 400
    assert elapsed < 1.0, elapsed
