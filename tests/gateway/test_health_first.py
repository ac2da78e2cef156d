"""``/health`` is answered ahead of generation work, and that work is taken in turn, none lost.

The gateway runs each piece of an LLM call's work on its event loop (decoding and rendering the
request, parsing and recording the answer) under one fair lock (``Gateway.cpu``), one piece at a time;
``/health`` takes no lock. Here the test holds that lock itself, as a long piece of work would, while
many calls arrive: ``/health`` is answered while every call waits, and once the lock is let go every
call is answered and recorded exactly once. An order of events, not a timing (bench/gateway_soak.py
measures the latencies with 1,000 sessions).
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx

CALLS = 24


def test_health_is_answered_while_generation_work_waits(scripted):
    stack = scripted(lambda prompt: "Noted.")
    sessions = [stack.open() for _ in range(CALLS)]
    held = asyncio.run_coroutine_threadsafe(stack.gateway.cpu.acquire(), stack.loop.loop)
    held.result(10)

    def call(info) -> int:
        r = httpx.post(f"{info.base_url}/chat/completions", timeout=60,
                       headers={"Authorization": f"Bearer {info.token}"},
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
        return r.status_code

    with concurrent.futures.ThreadPoolExecutor(CALLS) as pool:
        calls = [pool.submit(call, info) for info in sessions]
        # every call has reached the gateway and waits for the lock (none can have been answered)
        while sum(s.api_calls for s in stack.gateway.sessions._by_id.values()) < CALLS:
            concurrent.futures.wait(calls, timeout=0.05)
        assert not any(c.done() for c in calls)
        health = httpx.get(stack.root + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["open_sessions"] == CALLS
        assert not any(c.done() for c in calls)  # still waiting: /health went ahead of them
        stack.loop.loop.call_soon_threadsafe(stack.gateway.cpu.release)
        assert [c.result(60) for c in calls] == [200] * CALLS
    for info in sessions:  # each call recorded exactly once
        assert stack.stats(info)["turns"] == 1
