"""One payload per tensor-parallel rank (issue 25 point 2), against real engine processes standing for tp=2.

SGLang 0.5.9's TP rank r deserializes ``serialized_named_tensors[r]`` and opens its handles on the GPU
they name (rayrl/weights/tp_payloads.py). Here the engine (``python -m rayrl.engines.cpu --tp-size 2``, the plain CPU
engine and the strict SGLang stand-in) stands for two ranks on logical GPUs 4 and 7
(``CUDA_VISIBLE_DEVICES``, as an EngineActor sets it), and two HandleSenders stand for the trainer ranks
on those GPUs, meeting in a real TCP store: each makes its own payload, the one on TP rank 0's GPU posts
both in TP order. A payload marked with the wrong GPU, too few entries, or entries with different
weights are refused with a 400 (the stand-in counts each as a contract violation: SGLang would fail).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rayrl.config import EngineConfig
from rayrl.engines.client import EngineClient
from rayrl.engines.launcher import EngineProcess
from rayrl.weights.handles import HandleSender
from rayrl.weights.tp_payloads import PayloadExchange, check_tp_entries
from rayrl.weights.transfer import EngineTarget, WeightTransferError
from rayrl.weights.wire import WeightUpdateError
from tests.engines._engine_kit import forward_logprobs, random_weights

PROMPT = [5, 17, 42, 99, 7, 3]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
GPUS = ("4", "7")  # the engine's TP ranks read these logical GPUs, in TP order


@pytest.fixture(scope="module")
def tp2_engines(tiny_model, tmp_path_factory):
    """Both kinds of engine, started together (each start is seconds of imports); the strict stand-in only
    where the pinned sglang wheel is installed."""
    from tests.engine_procs import start_together

    kinds = ["cpu-engine"]
    try:
        import sglang.srt.utils  # noqa: F401
        kinds.append("strict-sglang")
    except ImportError:
        pass
    procs = {}
    for kind in kinds:
        extra = ["--strict-sglang"] if kind == "strict-sglang" else []
        cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=256, num_threads=1,
                           startup_timeout_s=180, tp_size=2, extra_args=extra,
                           weight_format="float32")  # exact numbers after an update
        procs[kind] = EngineProcess(cfg, str(tiny_model), tmp_path_factory.mktemp("tp2") / "engine.log",
                                    env={"CUDA_VISIBLE_DEVICES": ",".join(GPUS)})
    start_together(list(procs.values()))
    yield procs
    for proc in procs.values():
        proc.stop()


@pytest.fixture(scope="module", params=["cpu-engine", "strict-sglang"])
def tp2_engine(request, tp2_engines):
    if request.param not in tp2_engines:
        pytest.skip("the pinned sglang wheel (make test installs it)")
    return request.param, tp2_engines[request.param]


@pytest.fixture(scope="module")
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)


def _info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/server_info", timeout=10) as resp:
        return json.load(resp)


def _violations(url: str) -> int:
    return _info(url).get("sglang_contract", {}).get("contract_violations", 0)


def _client(store) -> dist.TCPStore:
    """A connection of its own to the store, as each trainer rank process has."""
    return dist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=30))


def _pair(url: str, store, session: str, gpus=GPUS, timeout_s: float = 30.0) -> tuple[HandleSender, HandleSender]:
    """The sender on TP rank 0's GPU (posts) and the one on TP rank 1's (contributes), as plan.py makes them."""
    poster = HandleSender([EngineTarget(EngineClient(url), 2, exchange_key=0)], bucket_bytes=1 << 20,
                          exchange=PayloadExchange(_client(store), session, timeout_s), gpu_id=gpus[0],
                          timeout_s=timeout_s)
    member = HandleSender([], bucket_bytes=1 << 20, exchange=PayloadExchange(_client(store), session, timeout_s),
                          contributes=[(0, 1)], gpu_id=gpus[1], timeout_s=timeout_s)
    return poster, member


async def _send_both(poster, member, first, second, version) -> list:
    try:
        return await asyncio.gather(poster.send(iter(first), version), member.send(iter(second), version),
                                    return_exceptions=True)
    finally:
        await poster.close()
        await member.close()


def test_each_tp_rank_gets_its_own_payload_and_the_weights_arrive_equal(tp2_engine, tiny_model, store):
    from transformers import AutoModelForCausalLM

    kind, proc = tp2_engine
    reference = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    new = random_weights(reference, seed=5)
    reference.load_state_dict(new, strict=False)
    named = list(new.items())
    before = _violations(proc.url)
    poster, member = _pair(proc.url, store, f"ok-{kind}")
    results = asyncio.run(_send_both(poster, member, named, [(n, t.clone()) for n, t in named], 3))
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert results[0].buckets == results[1].buckets > 1  # the tiny model travels in several buckets
    info = _info(proc.url)
    assert info["tp_size"] == 2 and info["tp_gpus"] == list(GPUS)
    assert info["tp_payload_gpus"] == list(GPUS)  # entry r came from the rank on GPU r's, for every bucket
    assert _violations(proc.url) == before

    async def generate():
        client = EngineClient(proc.url)
        try:
            return await client.generate(PROMPT, GREEDY)
        finally:
            await client.close()

    out = asyncio.run(generate())
    assert out.weight_version == "3"
    expect = forward_logprobs(reference, PROMPT, out.output_ids.tolist()).numpy()
    assert float(np.abs(out.output_logprobs - expect).max()) < 1e-4  # the engine holds exactly the new weights


def test_a_payload_from_another_gpu_too_few_entries_or_different_weights_are_refused(tp2_engine, tiny_model, store):
    from transformers import AutoModelForCausalLM

    kind, proc = tp2_engine
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    named = list(random_weights(model, seed=6).items())[:3]
    before = _violations(proc.url)

    # the two trainer ranks swapped: entry 0 made on GPU 7, which TP rank 0 does not read
    poster, member = _pair(proc.url, store, f"swapped-{kind}", gpus=GPUS[::-1])
    results = asyncio.run(_send_both(poster, member, named, named, 4))
    assert all(isinstance(r, WeightTransferError) for r in results), results
    assert "made on GPU 7" in str(results[0]) and "rank 0 reads GPU 4" in str(results[0])
    assert "posted by TP rank 0's trainer rank" in str(results[1])  # the contributing rank learns it too

    # one rank's payload repeated for both ranks (what handles.py did before): entry 1 is GPU 4's
    async def repeated():
        sender = HandleSender([EngineTarget(EngineClient(proc.url), 2)], gpu_id=GPUS[0])
        try:
            await sender.send(iter(named), 5)
        finally:
            await sender.close()

    with pytest.raises(WeightTransferError, match=r"serialized_named_tensors\[1\] was made on GPU 4"):
        asyncio.run(repeated())

    # a single entry for a two-rank engine (SGLang's rank 1 would index past the list)
    async def single():
        sender = HandleSender([EngineTarget(EngineClient(proc.url), 1)], gpu_id=GPUS[0])
        try:
            await sender.send(iter(named), 6)
        finally:
            await sender.close()

    with pytest.raises(WeightTransferError, match="1 entries .*tp_size 2"):
        asyncio.run(single())

    # each rank on its own GPU, but rank 1 holds other weights than rank 0
    poster, member = _pair(proc.url, store, f"differ-{kind}")
    other = [(n, t + 1.0) for n, t in named]
    results = asyncio.run(_send_both(poster, member, named, other, 7))
    assert all(isinstance(r, WeightTransferError) for r in results), results
    assert "holds other weights than entry 0" in str(results[0])
    if kind == "strict-sglang":
        assert _violations(proc.url) == before + 4


def test_a_rank_that_never_hands_its_payload_over_fails_the_push(store, tiny_model):
    """The posting rank waits at most its timeout for the others (a rank that died), then says so."""
    exchange = PayloadExchange(_client(store), "lonely", timeout_s=1.0)
    poster = HandleSender([EngineTarget(EngineClient("http://127.0.0.1:9"), 2, exchange_key=0)], exchange=exchange)

    async def run():
        try:
            await poster.send(iter([("w", torch.zeros(4))]), 1)
        finally:
            await poster.close()

    with pytest.raises(WeightTransferError, match="TP ranks 1..1 .*did not arrive within 1 s"):
        asyncio.run(run())
    assert store.get("rayrl-tp/lonely/0/0/0/answer").decode().startswith("the payloads")  # the others are told


def test_check_tp_entries_rules():
    w = [("a", torch.arange(4.0))]
    assert check_tp_entries([(w, "4"), ([("a", torch.arange(4.0))], "7")], GPUS) == w
    assert check_tp_entries([(w, None), (w, None)], GPUS) == w  # host memory without a GPU: any rank reads it
    assert check_tp_entries([(w, "9")], []) == w  # not placed on GPUs: nothing to check against
    with pytest.raises(WeightUpdateError, match=r"\[1\] was made on GPU 4"):
        check_tp_entries([(w, "4"), (w, "4")], GPUS)
    with pytest.raises(WeightUpdateError, match="other weights"):
        check_tp_entries([(w, "4"), ([("b", torch.arange(4.0))], "7")], GPUS)
    with pytest.raises(WeightUpdateError, match="other weights"):
        check_tp_entries([(w, "4"), ([("a", torch.arange(4.0).half())], "7")], GPUS)


def test_only_an_engine_that_opens_rayrl_buffers_gets_them(tp2_engine):
    """Handle senders give rayrl's own shared-memory buffers (rayrl/weights/shm.py: never outliving their
    owner) only to an engine whose /get_server_info says it opens them: our CPU engine. SGLang's unpickler
    (and the strict stand-in's, which is SGLang's own) refuses rayrl's opener, so those get torch's handles."""
    kind, proc = tp2_engine

    async def connected() -> bool:
        sender = HandleSender([EngineTarget(EngineClient(proc.url), 2)])
        try:
            await sender.connect()
            return sender._engine_buffers
        finally:
            await sender.close()

    assert asyncio.run(connected()) is (kind == "cpu-engine")
