"""Wire details real clients depend on, checked on the raw HTTP exchange (scripted engine).

Exact SSE event sequences (Anthropic and Responses), Claude Code's habits (``HEAD /``,
``?beta=true``, both auth headers, a system message in the middle of ``messages``, adaptive thinking,
``cache_control``), reasoning streamed as thinking/reasoning deltas and dropped from echoed history
without breaking cumulative token mode, count_tokens, and auth/finished-session errors in each dialect.
"""

from __future__ import annotations

import json

import httpx
import pytest

from rayrl.config import GatewayConfig
from tests.gateway.scripted_engine import last_role

THINK = "<think>\nFirst 1, then 2.\n</think>\n\nCounting: 1 2 3."


def sse_events(resp: httpx.Response) -> list[tuple[str | None, dict | str]]:
    events, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((name, data if data == "[DONE]" else json.loads(data)))
            name = None
    return events


@pytest.fixture
def stack(scripted):
    return scripted(lambda prompt: THINK if last_role(prompt) != "tool" else "ok",
                    cfg=GatewayConfig(tool_parser="hermes", reasoning_parser="think"), token_delay_s=0.001)


def test_claude_code_request_shape_and_event_sequence(stack):
    info = stack.open()
    assert httpx.head(stack.root + "/").status_code == 200  # Claude Code's connectivity check, no auth
    body = {
        "model": "claude-opus-4-8", "max_tokens": 64000, "stream": True,
        "system": [{"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>ctx</system-reminder>\n\n"},
                                         {"type": "text", "text": "Count to 3",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "A mid-conversation system message."},
        ],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"session_id": "x"})},
    }
    headers = {"x-api-key": info.token, "Authorization": f"Bearer {info.token}", "anthropic-version": "2023-06-01",
               "anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07"}
    with httpx.stream("POST", stack.root + "/v1/messages?beta=true", json=body, headers=headers) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    names = [n for n, _ in events]
    assert all(n == d["type"] for n, d in events)  # `event:` line and `type` field agree
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    blocks = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert blocks == ["thinking", "text"]
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    thinking = "".join(d.get("thinking", "") for d in deltas if d["type"] == "thinking_delta")
    text = "".join(d["text"] for d in deltas if d["type"] == "text_delta")
    assert thinking == "First 1, then 2." and text == "Counting: 1 2 3."
    assert sum(d["type"] == "text_delta" for d in deltas) > 3  # streamed, not one block
    start = events[0][1]["message"]
    final = events[-2][1]
    assert start["usage"]["input_tokens"] > 0 and final["delta"]["stop_reason"] == "end_turn"
    assert final["usage"]["output_tokens"] > 0
    # the mid-list system message reached the model where Claude Code put it
    prompt = stack.engine.prompts[-1]
    assert prompt.index("Count to 3") < prompt.index("A mid-conversation system message.")

    # Claude Code echoes the thinking block back (or drops it): either way the history matches the
    # recorded turn, so the next prompt reuses its exact tokens
    for echoed in ([{"type": "thinking", "thinking": thinking, "signature": ""}, {"type": "text", "text": text}],
                   [{"type": "text", "text": text}]):
        follow = {**body, "stream": False,
                  "messages": body["messages"] + [{"role": "assistant", "content": echoed},
                                                  {"role": "user", "content": "again"}]}
        r = stack.http.post(stack.root + "/v1/messages?beta=true", json=follow, headers=headers)
        assert r.status_code == 200, r.text
        assert r.json()["content"][0] == {"type": "thinking", "thinking": "First 1, then 2.", "signature": ""}
    stats = stack.stats(info)
    assert stats["turns"] == 3 == stats["api_calls"] and stats["cumulative_hits"] == 2

    count = stack.http.post(stack.root + "/v1/messages/count_tokens?beta=true", json=body, headers=headers)
    assert count.status_code == 200 and count.json()["input_tokens"] == start["usage"]["input_tokens"]


def test_responses_event_sequence_with_reasoning(stack):
    info = stack.open()
    body = {"model": "m", "stream": True, "store": False, "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Count to 3"}]}],
        "tools": [], "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k"}
    headers = {"Authorization": f"Bearer {info.token}", "accept": "text/event-stream", "originator": "codex_exec"}
    with httpx.stream("POST", info.base_url + "/responses", json=body, headers=headers) as resp:
        events = sse_events(resp)
    kinds = [d["type"] for _, d in events]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert collapsed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    done = events[-1][1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] > 0
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][1]["content"][0]["text"] == "Counting: 1 2 3."


def test_auth_and_finished_sessions_in_each_dialect(stack):
    info = stack.open()
    msg = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    r = stack.http.post(stack.root + "/v1/messages", json=msg, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    r = stack.http.post(stack.root + "/v1/messages", json=msg, headers={"Authorization": f"Bearer {info.token}"})
    assert r.status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    r = stack.http.post(info.base_url + "/chat/completions", json=chat)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    stack.loop.run(stack.gateway.finish_session(info.session_id, 0.0))
    for url, body, hdr in [(info.base_url + "/chat/completions", chat, "Authorization"),
                           (info.base_url + "/responses", {"input": "hi"}, "Authorization"),
                           (stack.root + "/v1/messages", msg, "x-api-key")]:
        value = f"Bearer {info.token}" if hdr == "Authorization" else info.token
        r = stack.http.post(url, json=body, headers={hdr: value})
        assert r.status_code == 409 and "finished" in r.text
    models = stack.http.get(info.base_url + "/models").json()
    assert models["data"][0]["id"] == "tiny"


def test_served_model_names_restrict_when_set(scripted):
    stack = scripted(lambda p: "ok", cfg=GatewayConfig(tool_parser="hermes", served_model_names=["tiny", "claude-x"]))
    info = stack.open()
    hdr = {"Authorization": f"Bearer {info.token}"}
    ok = stack.http.post(info.base_url + "/chat/completions", headers=hdr,
                    json={"model": "claude-x", "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200
    bad = stack.http.post(stack.root + "/v1/messages", headers=hdr,
                     json={"model": "claude-opus-4-8", "max_tokens": 4,
                           "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 404 and bad.json()["error"]["type"] == "not_found_error"
