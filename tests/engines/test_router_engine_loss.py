"""The router when engines die or are missing: two real CPU engine server processes (tiny model).

An engine SIGKILLed in the middle of a generation breaks its connection; the router continues the
generation on the other engine, once, from every token received so far: the router streams from the
engines whether or not its caller streams, so a plain call keeps its tokens as a stream does (and a
stream keeps the text it already delivered). The two engines hold different weight versions, so the
per-token versions of the result show which engine made each token. With no engine at all, a call
waits until one is added.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from rayrl.engines.client import EngineUnavailable
from rayrl.engines.launcher import EngineProcess
from rayrl.engines.router import Router
from tests.engine_kill import kept_and_continued, kill_after_tokens
from tests.engine_procs import start_together

# ~70 s (two engines restarted per test); fast: tests/gateway/test_engine_loss.py, the same loss seen through the
# gateway, plain and streamed
pytestmark = pytest.mark.slow

LONG = {"temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True}
N = LONG["max_new_tokens"]
PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture
def two_processes(two_engines):
    """Both engines up (a test before may have killed one or both: started again on their ports)."""
    start_together(two_engines)
    return two_engines


def _key_for(router: Router, url: str) -> str:
    return next(f"k{i}" for i in range(1000) if router.ranking(f"k{i}")[0] == url)


async def _kill_when_generating(proc: EngineProcess, router: Router) -> None:
    while router.in_flight.get(proc.url, 0) == 0:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # some tokens decoded, far from all
    os.killpg(proc.pid, signal.SIGKILL)


def test_plain_generation_keeps_its_tokens_on_another_engine(two_processes):
    victim, survivor = two_processes
    router = Router([p.url for p in two_processes])

    async def run():
        key = _key_for(router, victim.url)
        killer = asyncio.create_task(kill_after_tokens(victim))
        out = await router.generate(key, PROMPT, LONG)
        await killer
        assert router.routed["lost_continued"] == 1
        assert len(out.output_ids) == N and len(out.output_logprobs) == N
        assert out.meta_info.get("continued_parts") == 2
        # the tokens received before the kill are kept (made by the killed engine), the rest continued
        kept = kept_and_continued(out.versions.tolist(), victim, survivor)
        assert 24 <= kept < N
        alone = await router.generate(_key_for(router, survivor.url), PROMPT, LONG)  # same weights, greedy
        assert out.output_ids.tolist()[:kept] == alone.output_ids.tolist()[:kept]
        # the dead engine is avoided for a while: its sessions go to the survivor without another loss
        again = await router.generate(key, PROMPT, {**LONG, "max_new_tokens": 4})
        assert len(again.output_ids) == 4 and router.routed["lost_continued"] == 1
        await router.close()

    asyncio.run(run())


def test_stream_keeps_what_it_delivered_and_goes_on(two_processes):
    victim, survivor = two_processes
    router = Router([p.url for p in two_processes])

    async def run():
        seen: list[list[int]] = []

        async def on_text(text: str, ids: list[int], lps: list[float]) -> None:
            seen.append(list(ids))

        killer = asyncio.create_task(kill_after_tokens(victim))
        out = await router.generate_stream(_key_for(router, victim.url), PROMPT, LONG, on_text)
        await killer
        assert router.routed["lost_continued"] == 1
        assert len(out.output_ids) == N and len(out.output_logprobs) == N
        kept = kept_and_continued(out.versions.tolist(), victim, survivor)
        # what the stream delivered before the loss is exactly what was kept, and the stream went on from it
        delivered = next(s for s in reversed(seen) if len(s) <= kept)
        assert 24 <= kept < N and delivered == out.output_ids.tolist()[:kept]
        assert all(b[: len(a)] == a for a, b in zip(seen, seen[1:]))  # the stream only ever grew
        assert out.meta_info.get("continued_parts") == 2
        await router.close()

    asyncio.run(run())


def test_a_second_loss_fails_the_generation(two_processes):
    router = Router([p.url for p in two_processes], reconnect_s=0.5)

    async def run():
        async def kill_both() -> None:  # whichever engine the generation is on, then the other
            by_url = {p.url: p for p in two_processes}
            for _ in range(2):
                while not any(router.in_flight.get(u, 0) for u in by_url):
                    await asyncio.sleep(0.01)
                url = next(u for u in by_url if router.in_flight.get(u, 0))
                await _kill_when_generating(by_url.pop(url), router)

        killer = asyncio.create_task(kill_both())
        with pytest.raises(EngineUnavailable):
            await router.generate("any", PROMPT, {**LONG, "max_new_tokens": 3000})
        await killer
        assert router.routed["lost_continued"] == 1
        await router.close()

    asyncio.run(run())


def test_calls_wait_for_an_engine_to_be_added(two_processes):
    router = Router([], wait_timeout_s=60)

    async def run():
        call = asyncio.create_task(router.generate("s", PROMPT, {**LONG, "max_new_tokens": 5}))
        await asyncio.sleep(0.5)
        assert not call.done() and router.stats()["queue_depth"] == 1
        router.set_engines([two_processes[0].url])
        out = await asyncio.wait_for(call, 60)
        assert len(out.output_ids) == 5 and router.routed["engine_waits"] == 1
        router.set_engines([])
        short = Router([], wait_timeout_s=0.3)
        with pytest.raises(EngineUnavailable, match="no engine to route to"):
            await short.generate("s", PROMPT, LONG)
        await router.close()
        await short.close()

    asyncio.run(run())
