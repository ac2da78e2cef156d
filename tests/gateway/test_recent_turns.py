"""A session's remembered turns (cumulative token mode's candidates) share their messages.

Every request of an agent's conversation sends the whole history again, decoded into fresh dicts. Kept
as sent, the remembered turns of an n-turn session held 1 + 2 + ... + n message dicts: objects every full
garbage collection walks, with the event loop stopped (docs/operations.md, capacity). Each remembered
turn now reuses the previous turn's message dicts and its response, so they add one list per turn.
What the tests pin: the behaviour (every turn after the first reuses the recorded tokens; a resent
request still matches), and the sharing itself, over real HTTP through the gateway (scripted engine).
"""

from __future__ import annotations

import json

import pytest

from tests.gateway.scripted_engine import last_role

TURNS = 6
CALC = {"type": "function", "function": {"name": "calc", "description": "evaluate an expression",
                                         "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}


def script(prompt: str) -> str:
    n = prompt.count("<tool_response>") if last_role(prompt) == "tool" else 0
    return f'Step {n}.\n<tool_call>{{"name": "calc", "arguments": {{"e": "{n}+1"}}}}</tool_call>'


@pytest.fixture
def stack(scripted):
    return scripted(script)


def _conversation(stack, info, turns: int = TURNS) -> list[dict]:
    """An agent's tool loop over HTTP: each request carries the whole history, as the agent holds it."""
    messages = [{"role": "system", "content": "You can call calc."}, {"role": "user", "content": "Count up."}]
    headers = {"Authorization": f"Bearer {info.token}"}
    for i in range(turns):
        r = stack.http.post(stack.root + "/v1/chat/completions", headers=headers, timeout=60,
                            json={"model": "tiny", "messages": messages, "tools": [CALC]})
        assert r.status_code == 200, r.text
        reply = r.json()["choices"][0]["message"]
        assert reply["tool_calls"], reply
        messages.append({k: v for k, v in reply.items() if v is not None})
        messages.append({"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": str(i + 1)})
    return messages


def test_each_turn_reuses_the_recorded_tokens_and_a_resent_request_still_matches(stack):
    info = stack.open()
    messages = _conversation(stack, info)
    session = stack.gateway.sessions.get(info.session_id)
    stats = stack.stats(info)
    assert stats["turns"] == TURNS and stats["cumulative_hits"] == TURNS - 1
    assert sum(stats["drift"].values()) == 0
    # the agent's history, freshly decoded, matches the newest turn; one turn shorter, the one before it
    fresh = json.loads(json.dumps(messages))
    assert session.history_match(fresh) is session.recent[-1]
    assert session.history_match(fresh[:-2]) is session.recent[-2]
    assert [len(t.messages) for t in session.recent] == [2 + 2 * i for i in range(TURNS)]
    samples = stack.loop.run(stack.gateway.finish_session(info.session_id, 1.0))
    assert len(samples) == 1  # one token-faithful sample for the whole conversation


def test_remembered_turns_share_their_message_dicts(stack):
    info = stack.open()
    _conversation(stack, info)
    recent = stack.gateway.sessions.get(info.session_id).recent
    newest = recent[-1]
    for turn in recent[:-1]:
        k = len(turn.messages)
        assert all(a is b for a, b in zip(turn.messages, newest.messages[:k]))
        assert turn.response_message is newest.messages[k]
        assert turn.tools is newest.tools
    distinct = {id(m) for turn in recent for m in (*turn.messages, turn.response_message)}
    assert len(distinct) == len(newest.messages) + 1  # linear in the turns, not 1 + 2 + ... + n
