"""The strict SGLang 0.5.9 stand-in (``python -m rayrl.engines.cpu --strict-sglang``,
rayrl/engines/cpu/sglang_standin.py), a real
engine subprocess, and rayrl's senders against it: what SGLang refuses is refused, and what would be
silently wrong on SGLang is counted.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from _engine_kit import post_json

from rayrl.config import EngineConfig
from rayrl.engines.client import EngineClient, EngineError
from rayrl.engines.launcher import EngineProcess
from rayrl.weights import bucket as own_bucket
from rayrl.weights.broadcast import BroadcastSender
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
def recorded(tmp_path_factory):
    return tmp_path_factory.mktemp("requests")


@pytest.fixture(scope="module")
def strict(tiny_model, tmp_path_factory, recorded):
    cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=4096, num_threads=1, startup_timeout_s=180,
                       extra_args=["--strict-sglang", "--record-requests", str(recorded)])
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


def test_an_update_waits_for_a_running_generation(strict, tmp_path, weights):
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
            await client.update_weights_from_disk(str(ckpt), "21")
            order.append("update")

        start = await client.get_weight_version()
        await asyncio.gather(generation(), update())
        await client.close()
        return [start, *order]

    start, *order = asyncio.run(run())
    assert order == [f"generation v{start}", "update"]  # the writer lock waited for the generation


@pytest.mark.parametrize("flattened", [False, True], ids=["named", "flattened_bucket"])
def test_the_broadcast_sender_sends_what_sglang_resolves(strict, weights, flattened):
    """What BroadcastSender itself sends (names, dtype strings, shapes) goes through SGLang's request class
    and its getattr(torch, dtype); the weights arrive and the version is the one sent."""
    before = _contract(strict.url)["contract_violations"]
    version = f"bcast-{int(flattened)}"

    async def run() -> str:
        client = EngineClient(strict.url)
        sender = BroadcastSender([EngineTarget(client)], bucket_bytes=1 << 20, flattened=flattened, timeout_s=30)
        await sender.connect()
        try:
            await sender.send(iter(weights), version)
        finally:
            await sender.close()
        try:
            return await client.get_weight_version()
        finally:
            await client.close()

    assert asyncio.run(run()) == version
    assert _contract(strict.url)["contract_violations"] == before


def _generate_status(url: str) -> tuple[int, dict]:
    return post_json(url, "/generate",
                     {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})


REFUSED = [  # (path, body, what the refusal says): each a request SGLang 0.5.9 would refuse
    ("/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["torch.bfloat16"],
                                          "shapes": [[4, 4]]}, "getattr(torch, dtype)"),
    ("/release_memory_occupation", {"tags": ["cuda_graphs"]}, "memory tags ['cuda_graphs']"),
    ("/resume_memory_occupation", {"tags": ["weights", "cuda_graphs"]}, "memory tags ['cuda_graphs']"),
    ("/pause_generation", {"mode": "drain"}, "PauseGenerationReqInput"),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "flush": False}, "['flush']"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_tokens": 2}}, "max_tokens"),
    ("/set_weight_format", {"weight_format": "float32"}, "not a route of SGLang"),
]


@pytest.mark.parametrize("path, body, says", REFUSED, ids=["torch-dtype-name", "release-tag", "resume-tag",
                                                         "pause-mode", "unknown-field", "sampling-key",
                                                         "cpu-engine-route"])
def test_a_request_sglang_would_refuse_is_refused_by_its_own_classes_and_counted(strict, path, body, says):
    before = _contract(strict.url)["contract_violations"]
    status, answer = post_json(strict.url, path, body)
    assert 400 <= status < 500 and says in answer["message"], (status, answer)
    assert _contract(strict.url)["contract_violations"] == before + 1
    assert _contract(strict.url)["scheduler_died"] is None


def test_weights_released_without_a_cpu_backup_come_back_unusable_until_all_are_loaded(strict, tiny_model):
    """SGLang 0.5.9's default (enable_weights_cpu_backup off): resume maps the weights back without their
    contents. A /generate before every parameter is loaded again fails, loudly (on SGLang: garbage)."""
    from transformers import AutoModelForCausalLM

    full = [(n, t.detach().clone()) for n, t in
            AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict().items()]
    before = _contract(strict.url)["lost_weight_generations"]
    assert _generate_status(strict.url)[0] == 200
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert post_json(strict.url, path, {"tags": None})[0] == 200
    status, answer = _generate_status(strict.url)
    assert status == 500 and "without a CPU backup" in answer["message"]

    async def push(named: list, version: str) -> None:
        client = EngineClient(strict.url)
        try:
            await HandleSender([EngineTarget(client)], bucket_bytes=1 << 20).send(iter(named), version)
        finally:
            await client.close()

    asyncio.run(push(full[:2], "51"))  # some of them: still lost
    assert _generate_status(strict.url)[0] == 500
    asyncio.run(push(full, "52"))
    status, answer = _generate_status(strict.url)
    assert status == 200 and answer["meta_info"]["weight_version"] == "52"
    contract = _contract(strict.url)
    assert contract["lost_weight_generations"] == before + 2 and contract["lost_weights"] == 0
    assert contract["scheduler_died"] is None and contract["offload_tags"] == []


def _start(tiny_model, where, *extra: str) -> EngineProcess:
    cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=4096, num_threads=1, startup_timeout_s=180,
                       extra_args=["--strict-sglang", *extra])
    return EngineProcess(cfg, str(tiny_model), where / "engine.log").start()


DEATHS = {  # what kills SGLang 0.5.9's scheduler, done to a fresh stand-in: (pause mode, calls)
    "release-while-running": (None, [("/release_memory_occupation", {})]),
    "resume-not-released": ("abort", [("/release_memory_occupation", {"tags": ["kv_cache"]}),
                                      ("/resume_memory_occupation", {"tags": ["weights"]})]),
    "update-flushing-in-place": ("in_place", [("/update_weights_from_disk", {"model_path": "MODEL",
                                                                             "flush_cache": True})]),
}


@pytest.mark.parametrize("death", [
    "release-while-running",
    pytest.param("resume-not-released", marks=pytest.mark.slow),  # ~20 s each: a fresh engine
    pytest.param("update-flushing-in-place", marks=pytest.mark.slow),
])
def test_what_kills_sglangs_scheduler_fails_this_and_every_later_request(tiny_model, tmp_path, death):
    """SGLang's own scheduler code raises (its idle assertion, a KeyError on an unknown offload tag): on
    0.5.9 the scheduler dies there. The stand-in answers 500, then 500 to everything but /server_info."""
    proc = _start(tiny_model, tmp_path)
    mode, calls = DEATHS[death]
    try:
        async def run() -> int:
            client = EngineClient(proc.url)
            running = asyncio.ensure_future(client.generate(PROMPT, LONG))
            await _until_running(proc.url)
            if mode is not None:
                await client.pause_generation(mode)
            loop = asyncio.get_running_loop()
            statuses = [await loop.run_in_executor(None, post_json, proc.url, path,
                                                   {k: str(tiny_model) if v == "MODEL" else v for k, v in body.items()})
                        for path, body in calls]
            running.cancel()
            await client.close()
            return statuses[-1][0]

        assert asyncio.run(run()) == 500
        contract = _contract(proc.url)
        assert contract["scheduler_died"] and contract["contract_violations"] >= 1
        assert _generate_status(proc.url)[0] == 500
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(proc.url + "/health", timeout=10)
        assert err.value.code == 500
    finally:
        proc.stop()


@pytest.mark.slow  # ~20 s: an engine of its own
def test_with_the_cpu_backup_flag_released_weights_come_back_whole(tiny_model, tmp_path):
    proc = _start(tiny_model, tmp_path, "--enable-weights-cpu-backup")
    try:
        first = _generate_status(proc.url)
        for path in ("/release_memory_occupation", "/resume_memory_occupation"):
            assert post_json(proc.url, path, {})[0] == 200
        again = _generate_status(proc.url)
        assert first[0] == again[0] == 200 and again[1]["output_ids"] == first[1]["output_ids"]
        assert _contract(proc.url)["lost_weights"] == 0
    finally:
        proc.stop()


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


def test_versions_per_token_across_an_abort_and_continue_on_sglangs_response_shape(strict, weights):
    """Issue 41 (round 2's open point): SGLang 0.5.9 sends one ``meta_info.weight_version`` per response and no
    per-token versions. A generation the router streams, aborted by a pause (abort mode), the weights updated
    while paused, then continued: each token's version comes from the weight_version of the part that made
    it, as the gateway records the turn (rayrl/gateway/sessions.py versions_from), and no response carried a
    per-token field."""
    from rayrl.engines.router import Router
    from rayrl.gateway.sessions import versions_from

    seen_meta: list[dict] = []

    async def run():
        client = EngineClient(strict.url)
        before = await client.get_weight_version()
        router = Router([strict.url])
        original = router._stream_on

        async def recording(url, input_ids, params, rid, on_text):  # what each part's response carried
            out = await original(url, input_ids=input_ids, params=params, rid=rid, on_text=on_text)
            seen_meta.append(dict(out.meta_info))
            return out

        router._stream_on = recording
        try:
            task = asyncio.ensure_future(router.generate("s1", PROMPT, MEDIUM))
            await _until_running(strict.url)
            router.pause()  # the gateway holds (GatewayShard.hold_llm_calls)
            await client.pause_generation("abort")
            await client.wait_idle(30.0)
            handles = HandleSender([EngineTarget(client)], bucket_bytes=1 << 20)
            await handles.send(iter(weights), 57)
            await client.continue_generation()
            router.resume()
            out = await asyncio.wait_for(task, 120)
        finally:
            await router.close()
            await client.close()
        return before, out

    before, out = asyncio.run(run())
    assert len(out.output_ids) == MEDIUM["max_new_tokens"] and router_continued(seen_meta)
    assert all("output_token_versions" not in m and "weight_version" in m for m in seen_meta)
    recorded = versions_from(out.weight_version, out.versions)  # the turn's policy_version, as the gateway keeps it
    assert isinstance(recorded, np.ndarray) and len(recorded) == len(out.output_ids)
    k = int((recorded == int(before)).sum())
    assert 1 <= k < len(recorded)
    assert np.array_equal(recorded, np.array([int(before)] * k + [57] * (len(recorded) - k)))
    assert _contract(strict.url)["unseen_version_spans"] == 0


def router_continued(metas: list[dict]) -> bool:
    """Two parts: the first ended by the pause's abort, the second finished on its length."""
    return (len(metas) == 2 and (metas[0].get("finish_reason") or {}).get("type") == "abort"
            and (metas[1].get("finish_reason") or {}).get("type") == "length")


def test_the_record_holds_every_request_and_the_check_finds_exactly_the_refused_ones(strict, recorded, request):
    """Last in the module: every request the tests above sent was recorded; held again to SGLang's classes,
    the ones they sent on purpose to be refused are the problems found, and nothing else is."""
    from rayrl.engines.cpu.sglang_control import check_recorded_requests

    ran = {item.originalname for item in request.session.items if item.module is request.module}
    if len(ran) < 9:  # the counts below are those of the whole module
        pytest.skip("run with the whole module")

    calls, problems = check_recorded_requests(recorded)
    assert calls["POST /generate"] >= 5 and calls["POST /update_weights_from_tensor"] >= 3
    assert calls["POST /update_weights_from_distributed"] >= 2 and calls["GET /model_info"] >= 3
    assert calls["POST /release_memory_occupation"] >= 2 and calls["POST /pause_generation"] >= 1
    said = "\n".join(problems)
    for _, _, needle in REFUSED:
        assert needle in said, (needle, said)
    for needle in ("GET /get_weight_version: answered 404", "GET /weight_version: answered 404",
                   "POST /update_weights_from_tensor: answered 400", "POST /generate: answered 500"):
        assert needle in said, (needle, said)
    # the two removed version routes, the refused bucket, the table, the two generations on lost weights
    assert len(problems) == 2 + 1 + len(REFUSED) + 2, said
