"""Property: random sessions (forks, sub-agents, retries, rewrites, random token drift) never lose a
generated token. Every generated token appears exactly once with mask 1 across the Samples, with its
own log-prob and version, unless its turn was merged (then it is counted in ``masked_tokens``), and
every Sample is exactly its last turn's prompt + response (token-in-token-out).
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rayrl.trajectory import TITODriftError, TrajectoryTree, dump_samples
from rayrl.types import TurnRecord

GEN, SYS, USER, TOOL = 1, 2, 3, 4
GENERATED_FROM = 1_000_000  # generated ids are unique and above this; prompt-only ids are below

Msg = tuple[dict[str, Any], list[int]]  # a message and its rendered tokens


def _msg(role: str, tokens: list[int], text: str | None = None) -> Msg:
    return {"role": role, "content": text if text is not None else " ".join(map(str, tokens))}, tokens


def _build_session(data: st.DataObject) -> list[TurnRecord]:
    """Draw a random session: a list of turns as a gateway would record them."""
    fresh = itertools.count(GENERATED_FROM)
    noise = itertools.count(500)
    convs: list[list[Msg]] = []
    turns: list[TurnRecord] = []
    for _ in range(data.draw(st.integers(1, 18), label="ops")):
        ops = ["new", "continue", "continue", "continue", "fork", "retry"]
        op = data.draw(st.sampled_from(ops)) if convs else "new"
        if op == "retry":
            src = data.draw(st.sampled_from(turns))
            n = len(src.response_ids)
            ids = [next(fresh) for _ in range(n)]
            turns.append(TurnRecord(
                messages=[dict(m) for m in src.messages], response_message=dict(src.response_message),
                prompt_ids=src.prompt_ids.copy(), response_ids=ids,
                response_logprobs=[-(i % 97) / 10 for i in ids],
                policy_version=data.draw(st.integers(0, 3)),
            ))
            continue
        if op == "new":
            system = data.draw(st.integers(0, 2), label="system")
            conv = [_msg("system", [SYS, 100 + system]), _msg("user", [USER, data.draw(st.integers(5, 7))])]
            convs.append(conv)
        else:
            src = convs[data.draw(st.integers(0, len(convs) - 1), label="conv")]
            if op == "fork":
                conv = list(src[: data.draw(st.integers(2, len(src)), label="cut")])
                convs.append(conv)
            else:
                conv = src
            if conv[-1][0]["role"] == "assistant" and data.draw(st.booleans(), label="rewrite"):
                m, _ = conv[-1]
                conv[-1] = _msg("assistant", [GEN, next(noise)], text="rw " + str(m["content"]))
            role, tag = data.draw(st.sampled_from([("tool", TOOL), ("user", USER)]))
            conv.append(_msg(role, [tag] + data.draw(st.lists(st.integers(10, 12), min_size=1, max_size=3))))
        prompt = [t for _, toks in conv for t in toks] + [GEN]
        drift = data.draw(st.sampled_from([None, None, None, "replace", "truncate"]), label="drift")
        if drift == "replace":
            prompt[data.draw(st.integers(0, len(prompt) - 1))] = next(noise)
        elif drift == "truncate":
            prompt = prompt[: data.draw(st.integers(1, len(prompt)))]
        resp = [next(fresh) for _ in range(data.draw(st.integers(0, 4), label="resp_len"))]
        message = {"role": "assistant", "content": "g" + ",".join(map(str, resp))}
        turns.append(TurnRecord(
            messages=[dict(m) for m, _ in conv],
            response_message=message,
            prompt_ids=prompt,
            response_ids=resp,
            response_logprobs=[-(i % 97) / 10 for i in resp],
            policy_version=data.draw(st.integers(0, 3)),
            finish_reason=data.draw(st.sampled_from(["stop", "length", "abort"])),
        ))
        conv.append(({**message}, [GEN] + resp))
    return turns


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_sessions_never_lose_a_generated_token(data: st.DataObject) -> None:
    turns = _build_session(data)
    tree = TrajectoryTree(fork_merge_max_response_tokens=3)
    for t in turns:
        tree.record_turn(t)
    samples = tree.samples(1.0)
    st_ = tree.stats()
    info = "\n" + tree.dump() + "\n" + dump_samples(samples)
    for key in ("merged_rewrites", "retries", "forks"):
        event(f"{key}>0: {st_[key] > 0}")
    event(f"drift>0: {sum(st_['drift'].values()) > 0}")

    assert st_["turns"] == len(turns)
    assert st_["generated_tokens"] == sum(len(t.response_ids) for t in turns), info

    # TITO: a Sample is its last turn's prompt + response; each of its turns sits where its prompt says
    seen_turns: set[int] = set()
    for s in samples:
        idx = s.metadata["turn_indices"]
        seen_turns.update(idx)
        first, last = turns[idx[0]], turns[idx[-1]]
        assert s.prompt_length == len(first.prompt_ids), info
        assert np.array_equal(s.tokens, np.concatenate([last.prompt_ids, last.response_ids])), info
        for i in idx:
            t = turns[i]
            p, r = len(t.prompt_ids), len(t.response_ids)
            assert np.array_equal(s.tokens[:p], t.prompt_ids), info
            assert np.array_equal(s.tokens[p : p + r], t.response_ids), info
            off = p - s.prompt_length
            assert np.array_equal(s.policy_versions[off : off + r], t.response_versions()), info

    # merged turns are exactly the ones no Sample mentions; they are counted, never trained
    merged = set(range(len(turns))) - seen_turns
    assert len(merged) == st_["merged_rewrites"], info
    assert sum(len(turns[i].response_ids) for i in merged) == st_["masked_tokens"], info

    # every other generated token: exactly once with mask 1, with its own log-prob
    trained: Counter[int] = Counter()
    logprob_of: dict[int, float] = {}
    for s in samples:
        resp = s.tokens[s.prompt_length :]
        on = s.loss_mask.astype(bool)
        assert (resp[on] >= GENERATED_FROM).all(), info  # prompt-only tokens are never trained
        assert (s.rollout_logprobs[~on] == 0).all(), info
        trained.update(resp[on].tolist())
        logprob_of.update(zip(resp[on].tolist(), s.rollout_logprobs[on].tolist()))
    expected = [int(x) for i, t in enumerate(turns) if i not in merged for x in t.response_ids]
    assert sorted(trained.elements()) == sorted(expected), info
    for i, t in enumerate(turns):
        if i not in merged:
            for tok, lp in zip(t.response_ids.tolist(), t.response_logprobs.tolist()):
                assert abs(logprob_of[tok] - lp) < 1e-6, info
    assert sum(s.num_trained_tokens for s in samples) == st_["trainable_tokens"], info

    # the raise policy raises exactly when drift was counted
    strict = TrajectoryTree(fork_merge_max_response_tokens=3, on_drift="raise")
    for t in turns:
        strict.record_turn(t)
    if sum(st_["drift"].values()):
        try:
            strict.samples(1.0)
        except TITODriftError:
            pass
        else:
            raise AssertionError("drift was counted but samples() did not raise" + info)
    else:
        assert len(strict.samples(1.0)) == len(samples)
