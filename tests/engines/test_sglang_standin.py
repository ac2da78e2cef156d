"""The strict SGLang 0.5.9 stand-in (``cpu_server --strict-sglang``, rayrl/engines/sglang_standin.py), a real
engine subprocess, and rayrl's senders against it: what SGLang refuses is refused, and what would be
silently wrong on SGLang is counted.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch

from rayrl.config import EngineConfig
from rayrl.engines.client import EngineClient, EngineError
from rayrl.engines.launcher import EngineProcess
from rayrl.weights import bucket as own_bucket
from rayrl.weights.disk import DiskSender
from rayrl.weights.handles import HandleSender
from rayrl.weights.transfer import EngineTarget
from rayrl.weights.wire import serialize_for_engine

pytest.importorskip("sglang.srt.utils", reason="the pinned sglang wheel (make test installs it)")

PROMPT = [5, 17, 42, 99, 7, 3]
# long enough that no machine finishes it before the test pauses, aborts or updates around it
LONG = {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True}
MEDIUM = {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True}  # one an update waits out


@pytest.fixture(scope="module")
def strict(tiny_model, tmp_path_factory):
    cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=4096, num_threads=1, startup_timeout_s=180,
                       extra_args=["--strict-sglang"])
    proc = EngineProcess(cfg, str(tiny_model), tmp_path_factory.mktemp("strict") / "engine.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def weights(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return [(n, t.detach().clone()) for n, t in model.state_dict().items() if n != "lm_head.weight"]


async def _until_running(url: str) -> None:
    """Wait until the engine reports a request in flight (/get_load), instead of guessing with a sleep."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while loop.time() < deadline:
        with urllib.request.urlopen(f"{url}/get_load", timeout=10) as resp:
            load = json.load(resp)[0]
        if load["num_reqs"] - load["num_waiting_reqs"] > 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the long generation never started running")


def _contract(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/server_info", timeout=10) as resp:
        return json.load(resp)["sglang_contract"]


def test_removed_version_route_answers_404_and_every_transport_verifies_through_model_info(strict, weights, tmp_path):
    for path in ("/get_weight_version", "/weight_version"):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(strict.url + path, timeout=10)
        assert err.value.code == 404

    async def run() -> None:
        disk = DiskSender([EngineTarget(EngineClient(strict.url))], tmp_path / "w")
        await disk.connect()
        await disk.send(iter(weights), 11)  # verifies the version afterwards (main: GET /get_weight_version)
        await disk.close()
        handles = HandleSender([EngineTarget(EngineClient(strict.url))], bucket_bytes=1 << 20)
        stats = await handles.send(iter(weights), 12)
        await handles.close()
        assert stats.buckets > 1
        client = EngineClient(strict.url)
        assert await client.get_weight_version() == "12"
        await client.close()

    asyncio.run(run())
    assert _contract(strict.url)["contract_violations"] == 0


def test_a_bucket_sglang_refuses_is_refused_and_counted(strict, weights):
    before = _contract(strict.url)["contract_violations"]
    ours = own_bucket.FlattenedTensorBucket(named_tensors=weights[:2])
    payload = serialize_for_engine({"flattened_tensor": ours.get_flattened_tensor(), "metadata": ours.get_metadata()})

    async def run() -> dict:
        client = EngineClient(strict.url)
        try:
            return await client.update_weights_from_serialized([payload], load_format="flattened_bucket")
        finally:
            await client.close()

    with pytest.raises(EngineError) as err:
        asyncio.run(run())
    assert err.value.status == 400 and "Blocked unsafe class loading" in err.value.message
    assert _contract(strict.url)["contract_violations"] == before + 1


def test_release_refuses_while_a_generation_runs_and_an_update_waits_for_it(strict, tmp_path, weights):
    from safetensors.torch import save_file

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file(dict(weights), str(ckpt / "model.safetensors"))

    async def run() -> list[str]:
        client = EngineClient(strict.url)
        order: list[str] = []

        async def generation() -> None:
            out = await client.generate(PROMPT, MEDIUM)
            order.append(f"generation v{out.weight_version}")

        async def update() -> None:
            await _until_running(strict.url)
            with pytest.raises(EngineError, match="no ongoing request"):
                await client.release_memory_occupation(None)
            await client.update_weights_from_disk(str(ckpt), "21")
            order.append("update")

        start = await client.get_weight_version()
        await asyncio.gather(generation(), update())
        await client.close()
        return [start, *order]

    start, *order = asyncio.run(run())
    assert order == [f"generation v{start}", "update"]  # the writer lock waited for the generation


def test_a_generation_admitted_between_two_buckets_is_counted_as_mixed(strict, weights):
    async def run() -> None:
        client = EngineClient(strict.url)
        sender = HandleSender([EngineTarget(client)])
        first = serialize_for_engine(sender._bucket_object(weights[:1]))
        await client.update_weights_from_serialized([first], load_format="flattened_bucket", flush_cache=False)
        await client.generate(PROMPT, {"max_new_tokens": 2})  # on half-updated weights
        rest = serialize_for_engine(sender._bucket_object(weights[1:]))
        await client.update_weights_from_serialized([rest], load_format="flattened_bucket", weight_version="31")
        await client.generate(PROMPT, {"max_new_tokens": 2})  # whole again
        await client.close()

    before = _contract(strict.url)["mixed_weight_generations"]
    asyncio.run(run())
    assert _contract(strict.url)["mixed_weight_generations"] == before + 1


def test_while_paused_an_update_applies_at_once_and_abort_mode_returns_running_generations(strict, weights):
    async def run() -> tuple[dict, str]:
        client = EngineClient(strict.url)
        running = asyncio.ensure_future(client.generate(PROMPT, LONG))
        await _until_running(strict.url)
        await client.pause_generation("abort")  # returns once the generation has given up the lock
        out = await running
        handles = HandleSender([EngineTarget(client)], bucket_bytes=1 << 20)
        await handles.send(iter(weights), 41)
        await client.continue_generation()
        after = await client.generate(PROMPT, {"max_new_tokens": 2})
        await client.close()
        return out.finish_reason, after.weight_version

    finish, version = asyncio.run(run())
    assert finish["type"] == "abort" and version == "41"
    assert _contract(strict.url)["unseen_version_spans"] == 0
