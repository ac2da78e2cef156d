"""The HTTP server speaks SGLang's native API: every endpoint, bad input, abort, disconnect, streaming."""

from __future__ import annotations

import asyncio
import base64
import json
import time

import aiohttp
import numpy as np
import pytest
import torch
from _engine_kit import forward_logprobs, random_weights

from rayrl.engines.client import EngineClient, EngineError, EngineUnavailable, parse_generate_response
from rayrl.weights.wire import push_safetensors

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


async def post(url: str, path: str, payload=None, raw: bytes | None = None, method: str = "POST"):
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else (json.dumps(payload) if payload is not None else None)
        async with s.request(method, url + path, data=data) as r:
            body = await r.read()
            try:
                return r.status, json.loads(body) if body else None, r.headers.get("Content-Type", "")
            except json.JSONDecodeError:
                return r.status, body.decode(), r.headers.get("Content-Type", "")


def call(coro):
    return asyncio.run(coro)


def test_generate_single_with_logprobs(server, reference_model):
    status, body, _ = call(
        post(
            server.url,
            "/generate",
            {"input_ids": [1, 2, 3], "sampling_params": GREEDY, "return_logprob": True, "rid": "r1"},
        )
    )
    assert status == 200
    meta = body["meta_info"]
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == server.engine.weight_version and meta["e2e_latency"] > 0
    assert "output_token_versions" not in meta and meta["input_token_logprobs"] == []
    lps = [e[0] for e in meta["output_token_logprobs"]]
    assert [e[1] for e in meta["output_token_logprobs"]] == body["output_ids"]
    assert all(e[2] is None for e in meta["output_token_logprobs"])
    torch.testing.assert_close(
        torch.tensor(lps), forward_logprobs(reference_model, [1, 2, 3], body["output_ids"]), atol=1e-4, rtol=0
    )
    assert body["text"] == server.engine.tokenizer.decode(body["output_ids"])
    # PUT works too; text input; no logprobs unless asked
    status, body, _ = call(
        post(server.url, "/generate", {"text": "hello", "sampling_params": GREEDY}, method="PUT")
    )
    assert status == 200 and "output_token_logprobs" not in body["meta_info"] and len(body["output_ids"]) == 6


def test_generate_batch_and_n(server):
    payload = {
        "input_ids": [[1, 2], [3, 4, 5]],
        "sampling_params": [GREEDY, dict(GREEDY, max_new_tokens=2)],
        "rid": "b",
    }
    status, body, _ = call(post(server.url, "/generate", payload))
    assert status == 200 and isinstance(body, list) and len(body) == 2
    assert [b["meta_info"]["id"] for b in body] == ["b_0", "b_1"]
    assert [len(b["output_ids"]) for b in body] == [6, 2]
    alone = call(
        post(
            server.url,
            "/generate",
            {"input_ids": [3, 4, 5], "sampling_params": dict(GREEDY, max_new_tokens=2)},
        )
    )[1]
    assert alone["output_ids"] == body[1]["output_ids"]
    # n > 1 expands inputs * n
    status, body, _ = call(
        post(
            server.url,
            "/generate",
            {"text": ["a", "b"], "sampling_params": dict(GREEDY, n=2), "rid": ["w", "x", "y", "z"]},
        )
    )
    assert status == 200 and [b["meta_info"]["id"] for b in body] == ["w", "x", "y", "z"]
    assert body[0]["output_ids"] == body[2]["output_ids"] and body[1]["output_ids"] == body[3]["output_ids"]


def test_stream(server):
    async def run():
        chunks = []
        async with aiohttp.ClientSession() as s:
            payload = {
                "input_ids": [5, 6, 7],
                "sampling_params": dict(GREEDY, max_new_tokens=5),
                "stream": True,
                "return_logprob": True,
            }
            async with s.post(server.url + "/generate", json=payload) as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    line = line.decode().strip()
                    if line.startswith("data: "):
                        chunks.append(line[6:])
        return chunks

    chunks = call(run())
    assert chunks[-1] == "[DONE]"
    objs = [json.loads(c) for c in chunks[:-1]]
    assert all(o["meta_info"]["finish_reason"] is None for o in objs[:-1])
    final = objs[-1]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    ids = [o["output_ids"] for o in objs]
    assert all(ids[i] == ids[-1][: len(ids[i])] for i in range(len(ids)))  # cumulative
    assert [len(i) for i in ids] == sorted(len(i) for i in ids)
    assert len(final["meta_info"]["output_token_logprobs"]) == 5

    async def run_batch():
        async with aiohttp.ClientSession() as s:
            payload = {
                "input_ids": [[5, 6], [7]],
                "sampling_params": dict(GREEDY, max_new_tokens=3),
                "stream": True,
            }
            async with s.post(server.url + "/generate", json=payload) as r:
                return [
                    line.decode().strip()[6:]
                    for line in [raw async for raw in r.content]
                    if line.startswith(b"data: ")
                ]

    chunks = call(run_batch())
    objs = [json.loads(c) for c in chunks[:-1]]
    assert {o["index"] for o in objs} == {0, 1}
    finals = [o for o in objs if o["meta_info"]["finish_reason"] is not None]
    assert sorted(o["index"] for o in finals) == [0, 1]


BAD_REQUESTS = [
    ("malformed json", b"{not json", 400),
    ("not an object", b"[1, 2]", 400),
    ("empty body", b"", 400),
    ("missing input", json.dumps({"sampling_params": {}}).encode(), 400),
    ("both inputs", json.dumps({"text": "a", "input_ids": [1]}).encode(), 400),
    ("empty input_ids", json.dumps({"input_ids": []}).encode(), 400),
    ("empty inner input_ids", json.dumps({"input_ids": [[1], []]}).encode(), 400),
    ("string ids", json.dumps({"input_ids": ["a"]}).encode(), 400),
    (
        "negative max_new_tokens",
        json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}).encode(),
        400,
    ),
    ("bad temperature", json.dumps({"input_ids": [1], "sampling_params": {"temperature": -1}}).encode(), 400),
    (
        "temperature string",
        json.dumps({"input_ids": [1], "sampling_params": {"temperature": "x"}}).encode(),
        400,
    ),
    ("bad top_p", json.dumps({"input_ids": [1], "sampling_params": {"top_p": 1.5}}).encode(), 400),
    ("out of vocab", json.dumps({"input_ids": [1, 10**7]}).encode(), 400),
    ("negative id", json.dumps({"input_ids": [-1]}).encode(), 400),
    ("too long", json.dumps({"input_ids": [1] * 5000}).encode(), 400),
    (
        "prompt + max_new too long",
        json.dumps({"input_ids": [1] * 100, "sampling_params": {"max_new_tokens": 4050}}).encode(),
        400,
    ),
    ("unknown field", json.dumps({"input_ids": [1], "frobnicate": True}).encode(), 400),
    (
        "unknown sampling field",
        json.dumps({"input_ids": [1], "sampling_params": {"temprature": 1}}).encode(),
        400,
    ),
    ("sampling list length", json.dumps({"input_ids": [[1], [2]], "sampling_params": [{}]}).encode(), 400),
    ("rid list length", json.dumps({"input_ids": [[1], [2]], "rid": ["a"]}).encode(), 400),
    ("duplicate rids", json.dumps({"input_ids": [[1], [2]], "rid": ["a", "a"]}).encode(), 400),
    ("input_embeds", json.dumps({"input_embeds": [[0.1]]}).encode(), 400),
    ("top_logprobs", json.dumps({"input_ids": [1], "top_logprobs_num": 3}).encode(), 400),
    ("stream not bool", json.dumps({"input_ids": [1], "stream": "yes"}).encode(), 400),
    (
        "logprob_start_len too big",
        json.dumps({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 5}).encode(),
        400,
    ),
]


@pytest.mark.parametrize("name, raw, status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_generate_requests(server, name, raw, status):
    code, body, ctype = call(post(server.url, "/generate", raw=raw))
    assert code == status, body
    assert ctype.startswith("application/json")
    assert body["object"] == "error" and body["code"] == status and body["type"] == "Bad Request"
    assert body["param"] is None and isinstance(body["message"], str) and body["message"]


def test_bad_control_requests(server):
    cases = [
        ("/update_weights_from_disk", {"model_path": 5}),
        ("/update_weights_from_disk", b"nope"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"], "load_format": "direct"}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"]}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": [], "load_format": "safetensors"}),
        ("/update_weight_version", {}),
        ("/pause_generation", {"mode": "sideways"}),
        ("/release_memory_occupation", {"tags": ["gpu_magic"]}),
        ("/abort_request", {"rid": 5}),
    ]
    for path, payload in cases:
        raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        code, body, _ = call(post(server.url, path, raw=raw))
        assert code == 400, (path, body)
        assert body["object"] == "error" and body["message"], (path, body)
    code, body, _ = call(
        post(
            server.url,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": ["AAAA"], "load_format": "direct"},
        )
    )
    assert "safetensors" in body["message"]
    # a payload that is not safetensors: the endpoint's own failure shape
    bad = base64.b64encode(b"garbage").decode()
    code, body, _ = call(
        post(
            server.url,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [bad], "load_format": "safetensors"},
        )
    )
    assert code == 400 and body["success"] is False and "safetensors" in body["message"]
    code, body, _ = call(post(server.url, "/update_weights_from_disk", {"model_path": "/no/such/dir"}))
    assert code == 400 and body["success"] is False
    code, body, _ = call(post(server.url, "/nope", {}))
    assert code == 404 and body["code"] == 404
    code, body, _ = call(post(server.url, "/generate", method="GET"))
    assert code == 405 and body["object"] == "error"


def test_status_endpoints(server):
    async def run():
        async with aiohttp.ClientSession() as s:
            out = {}
            for path in (
                "/health",
                "/health_generate",
                "/get_model_info",
                "/model_info",
                "/get_server_info",
                "/server_info",
                "/get_weight_version",
                "/get_load",
                "/flush_cache",
            ):
                async with s.get(server.url + path) as r:
                    out[path] = (r.status, await r.text())
            async with s.post(server.url + "/flush_cache") as r:
                out["POST /flush_cache"] = (r.status, await r.text())
            return out

    out = call(run())
    assert all(status == 200 for status, _ in out.values()), out
    assert out["/health"][1] == "" and out["/health_generate"][1] == ""
    info = json.loads(out["/get_model_info"][1])
    assert info["is_generation"] is True and info["weight_version"] == server.engine.weight_version
    assert set(info) >= {
        "model_path",
        "tokenizer_path",
        "is_generation",
        "preferred_sampling_params",
        "weight_version",
    }
    assert json.loads(out["/model_info"][1]) == info
    sinfo = json.loads(out["/get_server_info"][1])
    assert sinfo["max_running_requests"] == 8 and sinfo["internal_states"][0]["running"] == 0
    assert sinfo["version"].startswith("rayrl-cpu") and "weight_version" in sinfo
    assert json.loads(out["/get_weight_version"][1]) == {"weight_version": server.engine.weight_version}
    assert "Cache flushed" in out["/flush_cache"][1]


def test_control_endpoints_and_client(server, reference_model):
    client = EngineClient(server.url)

    async def run():
        assert await client.health()
        assert (await client.get_model_info())["is_generation"] is True
        assert await client.release_memory_occupation(["kv_cache"]) is None
        assert server.engine.stats()["released_memory"] == ["kv_cache"]
        assert await client.resume_memory_occupation() is None
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            status, body, _ = await post(server.url, path, raw=b"")
            assert status == 200 and body is None
        assert (await client.pause_generation("in_place"))["status"] == "ok"
        status, body, _ = await post(server.url, "/pause_generation", raw=b"")  # empty body works too
        assert status == 200 and body == {"message": "Generation paused successfully.", "status": "ok"}
        assert (await client.continue_generation())["message"] == "Generation continued successfully."
        assert "Cache flushed" in await client.flush_cache()
        r = await client.update_weight_version("v9")
        assert r == {"success": True, "message": "Weight version updated to v9", "new_version": "v9"}
        assert await client.get_weight_version() == "v9"

        # weights from tensors (safetensors payload) and from disk
        new = random_weights(reference_model, seed=21)
        r = await push_safetensors(client, new, "10")
        assert r["success"] is True and await client.get_weight_version() == "10"
        out = await client.generate([1, 2, 3], GREEDY)
        assert out.weight_version == "10" and out.versions is None
        assert out.output_ids.dtype == np.int32 and out.output_logprobs.dtype == np.float32
        # back to the original weights: the server's own model directory
        r = await client.update_weights_from_disk(server.engine.model_path, "11")
        assert r["success"] and "Weight version updated to 11" in r["message"]
        out2 = await client.generate([1, 2, 3], GREEDY)
        assert out2.weight_version == "11"
        expected = forward_logprobs(reference_model, [1, 2, 3], out2.output_ids.tolist())
        torch.testing.assert_close(torch.from_numpy(out2.output_logprobs), expected, atol=1e-4, rtol=0)

        with pytest.raises(EngineError) as err:
            await client.generate([], GREEDY)
        assert err.value.status == 400 and "empty" in err.value.message
        await client.close()

    call(run())


def test_abort_request_and_abort_all(server):
    async def run():
        client = EngineClient(server.url)
        task = asyncio.create_task(
            client.generate([1, 2, 3], dict(GREEDY, max_new_tokens=3000), rid="to-abort")
        )
        await wait_for_tokens(server.engine, "to-abort", 1)
        status, body, _ = await post(server.url, "/abort_request", {"rid": "to-abort"})
        assert status == 200 and body is None
        out = await task
        assert out.finish_reason["type"] == "abort" and 0 < len(out.output_ids) < 3000
        assert len(out.output_logprobs) == len(out.output_ids)
        status, _, _ = await post(server.url, "/abort_request", {"rid": "unknown-rid"})
        assert status == 200
        tasks = [
            asyncio.create_task(client.generate([4, 5], dict(GREEDY, max_new_tokens=3000), rid=f"all-{i}"))
            for i in range(3)
        ]
        for i in range(3):
            await wait_for_tokens(server.engine, f"all-{i}", 1)
        await post(server.url, "/abort_request", {"abort_all": True})
        outs = await asyncio.gather(*tasks)
        assert all(o.finish_reason["type"] == "abort" for o in outs)
        await client.close()

    call(run())


async def wait_for_tokens(engine, rid: str, n: int, timeout: float = 30.0) -> None:
    """Until request ``rid`` is running on ``engine`` and has produced ``n`` tokens."""
    await wait_until(lambda: rid in engine._active and len(engine._active[rid].output_ids) >= n, timeout)


async def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_client_disconnect_and_cancel_abort(server):
    engine = server.engine

    async def run():
        # raw disconnect: close the connection while /generate runs
        session = aiohttp.ClientSession()
        task = asyncio.create_task(
            session.post(
                server.url + "/generate",
                json={
                    "input_ids": [9, 9],
                    "sampling_params": dict(GREEDY, max_new_tokens=3000),
                    "rid": "gone",
                },
            )
        )
        await wait_for_tokens(engine, "gone", 1)
        handle = engine._active["gone"]
        task.cancel()
        await session.close()
        await wait_until(lambda: handle.finished)
        assert handle.result().finish_reason["type"] == "abort" and len(handle.output_ids) < 3000
        # EngineClient: cancelling generate aborts on the engine
        client = EngineClient(server.url)
        task = asyncio.create_task(
            client.generate([8, 8], dict(GREEDY, max_new_tokens=3000), rid="cancelled")
        )
        await wait_for_tokens(engine, "cancelled", 1)
        handle = engine._active["cancelled"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: handle.finished)
        assert handle.result().finish_reason["type"] == "abort" and len(handle.output_ids) < 3000
        assert engine.stats()["running"] == 0
        await client.close()

    call(run())


def test_versions_change_mid_generation_over_http(server, reference_model):
    async def run():
        client = EngineClient(server.url)
        start = await client.get_weight_version()
        task = asyncio.create_task(client.generate([1, 2, 3, 4], dict(GREEDY, max_new_tokens=400), rid="ver"))
        await wait_for_tokens(server.engine, "ver", 1)
        await client.pause_generation("in_place")
        r = await push_safetensors(client, random_weights(reference_model, seed=31), "100")
        assert r["success"]
        await client.continue_generation()
        out = await task
        assert out.finish_reason == {"type": "length", "length": 400}
        assert out.versions is not None and out.versions.dtype == np.int32 and len(out.versions) == 400
        assert out.versions[-1] == 100 and out.weight_version == "100"
        assert set(out.versions.tolist()) == {int(start), 100}
        assert out.meta_info["output_token_versions"][0] == start
        await client.close()

    call(run())


def test_client_errors_when_engine_is_down():
    async def run():
        client = EngineClient("http://127.0.0.1:9")  # discard port: nothing listens
        assert await client.health(timeout_s=2) is False
        with pytest.raises(EngineUnavailable) as err:
            await client.generate([1], GREEDY)
        assert err.value.connect_failed
        await client.close()

    call(run())


def test_parse_generate_response_shapes():
    body = {
        "text": "x",
        "output_ids": [1, 2],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": "4",
            "output_token_logprobs": [[-0.5, 1, None], [-1.5, 2, None]],
            "output_token_versions": ["3", "4"],
        },
    }
    out = parse_generate_response(body)
    assert out.output_ids.tolist() == [1, 2] and out.output_logprobs.tolist() == [-0.5, -1.5]
    assert out.versions.tolist() == [3, 4] and out.rid == "r" and out.weight_version == "4"


def test_fuzzed_generate_bodies_never_5xx(server):
    """Random (mostly malformed) /generate bodies get 200 or a 4xx JSON error, never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**40), 2**40),
        st.floats(allow_nan=False),
        st.text(max_size=5),
    )
    values = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    )
    ids = st.lists(st.integers(-5, 60000), max_size=6)
    params = st.dictionaries(
        st.sampled_from(
            ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "n", "stop_token_ids"]
        ),
        values | st.integers(-3, 4),
        max_size=3,
    ).map(lambda d: {**d, "max_new_tokens": 2} if "max_new_tokens" not in d else d)
    bodies = st.fixed_dictionaries(
        {},
        optional={
            "input_ids": ids | st.lists(ids, max_size=2) | values,
            "text": st.text(max_size=8) | values,
            "sampling_params": params | values,
            "rid": st.text(max_size=4) | values,
            "return_logprob": st.booleans() | values,
            "logprob_start_len": st.integers(-2, 8) | values,
            "stream": st.booleans(),
        },
    )

    async def send(body):
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/generate", data=json.dumps(body)) as r:
                return r.status, await r.read(), r.headers.get("Content-Type", "")

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(bodies)
    def check(body):
        status, raw, ctype = call(send(body))
        assert status in (200, 400), (body, status, raw[:200])
        if status == 400:
            err = json.loads(raw)
            assert err["object"] == "error" and err["code"] == 400 and err["message"]

    check()
    assert server.engine.alive() and server.engine.stats()["last_error"] is None


def test_release_and_flush_wait_for_an_idle_engine(tiny_model):
    """Issue 41 F: as SGLang 0.5.9, an engine holding a request refuses a memory release (SGLang's scheduler
    asserts and dies) and a cache flush (400): a pause ``in_place`` keeps the request in the batch, so
    ``wait_idle`` (polling /flush_cache, as slime does) times out with a clear error; after an ``abort``
    pause it returns, and the release goes through."""
    from _engine_kit import ServerThread

    from rayrl.engines.cpu.engine import CPUEngine

    engine = CPUEngine(tiny_model, dtype="float32", max_batch_size=8, weight_version="0").start()
    st = ServerThread(engine)
    client = EngineClient(st.url)

    async def run():
        long = asyncio.ensure_future(client.generate([1, 2, 3], {**GREEDY, "max_new_tokens": 4000}))
        while engine.stats()["running"] == 0:
            await asyncio.sleep(0.01)
        await client.pause_generation("in_place")
        status, body, _ = await post(st.url, "/release_memory_occupation", {"tags": None})
        assert status == 400 and "no ongoing request" in body["message"] and "1 running" in body["message"]
        with pytest.raises(EngineError) as refused:
            await client.flush_cache()
        assert refused.value.status == 400
        with pytest.raises(EngineError, match="still running or waiting 0 s after the pause"):
            await client.wait_idle(0.3, poll_s=0.05)
        await client.pause_generation("abort")
        assert await client.wait_idle(10.0, poll_s=0.05) >= 0
        await client.release_memory_occupation()
        await client.resume_memory_occupation()
        await client.continue_generation()
        out = await long
        assert len(out.output_ids) < 4000  # aborted at the pause
        return engine.stats()["released_memory"]

    try:
        assert call(run()) == []
        calls = st.server.control_calls
        assert [c for c in calls if c in ("flush_cache", "release_memory_occupation")][-2:] == [
            "flush_cache", "release_memory_occupation"]
    finally:
        st.close()
        engine.shutdown()
