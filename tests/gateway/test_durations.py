"""The gateway's own durations: the histogram's percentiles, and ``GET /rayrl/stats`` counting every
recorded turn and finished session (real gateway, scripted engine, real HTTP). No timing is asserted:
only what is counted and how percentiles are read."""

from __future__ import annotations

import math
import random

import pytest

from rayrl.gateway.durations import GROWTH, MIN_S, DurationHistogram


def test_percentiles_are_within_one_bucket_of_the_true_ones():
    rng = random.Random(7)
    values = [rng.lognormvariate(math.log(2e-4), 1.5) for _ in range(20_000)]
    hist = DurationHistogram()
    for v in values:
        hist.add(v)
    ordered = sorted(values)
    for q in (0.5, 0.9, 0.99, 0.999):
        true = ordered[math.ceil(q * len(ordered)) - 1]
        assert true <= hist.quantile(q) <= true * GROWTH, q
    assert hist.quantile(1.0) == hist.max_s == max(values)
    summary = hist.summary()
    assert summary["count"] == 20_000 and summary["max_ms"] == round(max(values) * 1e3, 4)
    assert summary["mean_ms"] == pytest.approx(sum(values) / len(values) * 1e3, rel=1e-3)


def test_edges_tiny_huge_and_empty():
    hist = DurationHistogram()
    assert hist.quantile(0.99) == 0.0 and hist.summary()["count"] == 0
    hist.add(0.0)
    hist.add(MIN_S / 2)
    assert hist.quantile(1.0) == MIN_S / 2  # never above the largest seen
    hist.add(10_000.0)  # past the last bucket: counted there, its maximum exact
    assert hist.count == 3 and hist.quantile(1.0) == 10_000.0
    with pytest.raises(ValueError):
        hist.quantile(1.5)


def _tool_then_text(prompt: str) -> str:
    if "<|im_start|>tool" in prompt:
        return "Done."
    return '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


def test_stats_route_counts_each_recorded_turn_and_finish(scripted):
    stack = scripted(_tool_then_text)
    admin = {"Authorization": f"Bearer {stack.gateway.admin_token}"}
    assert stack.http.get(stack.root + "/rayrl/stats").status_code == 401
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
    for _ in range(2):
        info = stack.open()
        hdr = {"Authorization": f"Bearer {info.token}"}
        messages = [{"role": "user", "content": "list the files"}]
        first = stack.http.post(stack.root + "/v1/chat/completions", headers=hdr,
                                json={"model": "m", "messages": messages, "tools": tools}).json()
        call = first["choices"][0]["message"]
        assert call["tool_calls"][0]["function"]["name"] == "bash"
        messages += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "a.txt"}]
        second = stack.http.post(stack.root + "/v1/chat/completions", headers=hdr,
                                 json={"model": "m", "messages": messages, "tools": tools}).json()
        assert second["choices"][0]["message"]["content"] == "Done."
        stats = stack.http.get(stack.root + "/rayrl/stats", headers=admin).json()
        assert stats["open_sessions"] == 1
        stack.loop.run(stack.gateway.finish_session(info.session_id, 1.0))
    stats = stack.http.get(stack.root + "/rayrl/stats", headers=admin).json()
    assert stats["durations"]["record_turn"]["count"] == 4
    assert stats["durations"]["finish_session"]["count"] == 2
    assert stats["open_sessions"] == 0 and stats["sessions_opened"] == stats["sessions_closed"] == 2
    assert stats["requests"] == 4
    record = stats["durations"]["record_turn"]
    assert 0 < record["p50_ms"] <= record["p99_ms"] <= record["max_ms"] * GROWTH

