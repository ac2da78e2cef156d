"""Router against two real engine servers: session affinity, load fallback, add/remove, failover."""

from __future__ import annotations

import asyncio

import pytest
from _engine_kit import ServerThread

from rayrl.engines.client import EngineUnavailable
from rayrl.engines.cpu.engine import CPUEngine
from rayrl.engines.router import Router
from rayrl.ports import free_port

GREEDY = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def two_servers(tiny_model):
    engines = [CPUEngine(tiny_model, dtype="float32", max_batch_size=16).start() for _ in range(2)]
    servers = [ServerThread(e) for e in engines]
    yield servers
    for s, e in zip(servers, engines):
        s.close()
        e.shutdown()


def tokens_by_url(servers) -> dict[str, int]:
    return {s.url: s.engine.stats()["tokens_generated"] for s in servers}


def test_session_affinity(two_servers):
    router = Router([s.url for s in two_servers])

    async def run():
        before = tokens_by_url(two_servers)
        preferred = router.pick("session-A")
        for _ in range(4):  # sequential turns of one session
            out = await router.generate("session-A", [1, 2, 3], GREEDY)
            assert len(out.output_ids) == 3
        after = tokens_by_url(two_servers)
        assert after[preferred] - before[preferred] == 12
        assert all(after[u] == before[u] for u in after if u != preferred)
        # many sessions spread over both engines, each one stable
        picks = {f"s{i}": router.pick(f"s{i}") for i in range(40)}
        assert set(picks.values()) == set(router.urls)
        assert all(router.pick(k) == v for k, v in picks.items())
        assert router.in_flight == {u: 0 for u in router.urls}
        await router.close()

    asyncio.run(run())


def test_load_fallback(two_servers):
    router = Router([s.url for s in two_servers], imbalance_abs=2, imbalance_rel=1.5)

    async def run():
        preferred = router.pick("hot-session")
        long = dict(GREEDY, max_new_tokens=200)
        tasks = [asyncio.create_task(router.generate("hot-session", [4, 5, 6], long)) for _ in range(6)]
        await asyncio.sleep(0)  # every task has picked its engine
        inflight = router.in_flight
        other = next(u for u in router.urls if u != preferred)
        assert inflight[preferred] >= 2 and inflight[other] >= 1 and sum(inflight.values()) == 6
        assert router.routed["load_fallback"] >= 1
        outs = await asyncio.gather(*tasks)
        assert all(len(o.output_ids) == 200 for o in outs)
        assert router.in_flight == {u: 0 for u in router.urls}
        await router.close()

    asyncio.run(run())


def test_add_remove_and_failover(two_servers):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    router = Router([dead], reconnect_s=0.3)

    async def run():
        with pytest.raises(EngineUnavailable):
            await router.generate("k", [1], GREEDY)
        for s in two_servers:
            router.add(s.url)
        key = next(f"k{i}" for i in range(100) if router.ranking(f"k{i}")[0] == dead)
        # just refused: avoided for reconnect_s, so its sessions go elsewhere without a retry
        out = await router.generate(key, [1, 2], GREEDY)
        assert len(out.output_ids) == 3 and router.routed["retried"] == 0
        await asyncio.sleep(0.35)
        # no longer avoided: tried first, refused, retried elsewhere
        out = await router.generate(key, [1, 2], GREEDY)
        assert len(out.output_ids) == 3 and router.routed["retried"] == 1
        router.remove(dead)
        assert dead not in router.clients and len(router.clients) == 2
        assert all(router.pick(f"x{i}") != dead for i in range(20))
        assert router.pick(None) in router.urls  # no key: least loaded
        router.remove(two_servers[0].url)
        assert router.pick("anything") == two_servers[1].url
        await router.close()

    asyncio.run(run())


@pytest.mark.parametrize("block, rest", [
    (b'data: {"a": 1}\n\ndata: {"b": 2}\n\n', b""),
    (b'1}\n\ndata: [DONE]\n\n', b'data: {"a": '),
    (b"data:x \r\n: comment\n\nevent: e\ndata:\t y\t\r\ndat", b""),
    (b"data:\n\n data: no\ndata:  \x0b\x0c\n", b""),
    (b"no newline yet", b"data: 1"),
    (b"", b""),
])
def test_sse_data_lines(block, rest):
    """The data payloads of the complete lines (as ``line[5:].strip()`` of each ``data:`` line) and the
    incomplete line left over."""
    from rayrl.engines.router import _sse_data

    lines = (rest + block).split(b"\n")
    expected_rest = lines.pop()
    expected = [line[5:].strip() for line in lines if line.startswith(b"data:")]
    assert _sse_data(block, rest) == (expected, expected_rest)
