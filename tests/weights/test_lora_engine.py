"""A LoRA policy's updates are its adapter alone: trainer process -> a real CPU engine server process.

The trainer (this process: a TorchTrainer with trainer.lora after real steps) sends the adapter with the
sender rayrl/weights/plan.py builds for LoRA (SGLang's ``/unload_lora_adapter`` +
``/load_lora_adapter_from_tensors`` + ``/update_weight_version``, shared-memory handles); the engine merges
it into its weights. Its greedy output and log-probs then equal the trainer's PEFT model, requests must
name the adapter, and what the engine cannot do is a 400 with a JSON body that names the problem.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from rayrl.config import EngineConfig, LoraConfig, TrainerConfig
from rayrl.engines.api import LORA_ADAPTER
from rayrl.engines.client import EngineClient, EngineError
from rayrl.engines.launcher import EngineProcess
from rayrl.trainers.torch_backend import TorchTrainer
from rayrl.types import Sample
from rayrl.weights.adapter import AdapterSender
from rayrl.weights.plan import EngineEndpoint, RankPlace, WeightPlanError, make_sender, plan_senders
from rayrl.weights.wire import serialize_adapter
from tests.engines._engine_kit import forward_logprobs, post_json

PROMPT = [5, 17, 42, 99, 7, 3]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["float32", "fp16-packed"])
def engine_proc(request, tiny_model, tmp_path_factory):
    cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=256, num_threads=1, startup_timeout_s=180,
                       weight_format=request.param, max_lora_rank=8)
    proc = EngineProcess(cfg, str(tiny_model), tmp_path_factory.mktemp("lora") / "engine.log")
    proc.start()
    yield proc
    proc.stop()


def _trainer(tiny_model) -> TorchTrainer:
    cfg = TrainerConfig(lr=5e-2, micro_batch_tokens=256, compute_dtype="float32", lora=LoraConfig(rank=4, alpha=8))
    return TorchTrainer(tiny_model, cfg, seed=0, device="cpu")


def _train(trainer: TorchTrainer, seed: int) -> None:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(4):
        tokens = rng.integers(10, 4000, size=20).astype(np.int32)
        n = len(tokens) - 6
        samples.append(Sample(tokens=tokens, prompt_length=6, loss_mask=np.ones(n, np.int8),
                              rollout_logprobs=np.full(n, -8.0, np.float32), policy_versions=np.zeros(n, np.int32)))
    trainer.train_step(samples, [1.0, -1.0, 1.0, -1.0])


async def _engine_vs_trainer(client: EngineClient, trainer: TorchTrainer) -> tuple[str, float]:
    out = await client.generate(PROMPT, GREEDY, lora_path=LORA_ADAPTER)
    expect = forward_logprobs(trainer.model, PROMPT, out.output_ids.tolist()).numpy()
    assert out.versions is None  # every token from the one version the engine reports
    return out.weight_version, float(np.abs(out.output_logprobs - expect).max())


async def _packs(client: EngineClient) -> int:
    """How many times the engine has rebuilt its packed decode weights (``/server_info``'s engine state)."""
    state = (await client.get_server_info())["internal_states"][0]
    assert state["decode_path"] == "lean"  # the tiny model decodes on the lean path, which holds packed copies
    return int(state["weight_packs"])


def test_the_adapter_alone_reaches_the_engine_and_it_generates_as_the_trainer(engine_proc, tiny_model):
    tol = 1e-4 if "float32" in engine_proc.cfg.weight_format else 2e-2  # fp16-packed: half-precision weights

    async def run() -> None:
        trainer = _trainer(tiny_model)
        client = EngineClient(engine_proc.url)
        assert await client.lora_adapters() == []
        plan = plan_senders("auto", [EngineEndpoint(engine_proc.url, "n1")], [RankPlace(0, "n1")], "cpu", lora=True)
        assert plan.transport == "adapter"
        sender = make_sender(plan, 0, bucket_bytes=1 << 20, timeout_s=120, master_address="127.0.0.1",
                             disk_root="/nonexistent", cuda=False, adapter_config=trainer.adapter_config())
        assert isinstance(sender, AdapterSender)
        await sender.connect()
        try:
            for version in (1, 2, 3):  # each update replaces the last: merged onto W0, never on top of it
                _train(trainer, seed=version)
                before = await client.generate(PROMPT, GREEDY, lora_path=LORA_ADAPTER) if version > 1 else None
                packs = await _packs(client)
                stats = await sender.send(trainer.named_weights(torch.float32), version=version)
                # unload (the base back) + load (base + adapter): one repack of the adapted matrices, not two
                assert await _packs(client) == packs + 1
                adapter_bytes = sum(t.numel() * 4 for _, t in trainer.named_weights(torch.float32))
                full_bytes = sum(p.numel() * 4 for p in trainer.model.parameters() if not p.requires_grad)
                assert stats.bytes == adapter_bytes and stats.bytes < full_bytes / 20
                got, diff = await _engine_vs_trainer(client, trainer)
                assert got == str(version) and diff < tol, (version, diff)
                if before is not None:
                    assert before.weight_version == str(version - 1)
            assert await client.lora_adapters() == [LORA_ADAPTER]
            # unloaded, the engine decodes with the base again: its packed copies are rebuilt before that step
            await client.unload_lora_adapter(LORA_ADAPTER)
            out = await client.generate(PROMPT, GREEDY)
            with trainer.model.disable_adapter():
                base = forward_logprobs(trainer.model, PROMPT, out.output_ids.tolist()).numpy()
            assert float(np.abs(out.output_logprobs - base).max()) < tol
        finally:
            await sender.close()
        await client.close()

    asyncio.run(run())


def test_requests_must_name_the_adapter_and_bad_adapter_calls_are_400(engine_proc, tiny_model):
    url = engine_proc.url
    trainer = _trainer(tiny_model)
    tensors = dict(trainer.named_weights(torch.float32))
    config = trainer.adapter_config()
    load = {"lora_name": LORA_ADAPTER, "config_dict": config, "serialized_tensors": serialize_adapter(tensors)}
    if LORA_ADAPTER in [c["id"] for c in json.load(urllib.request.urlopen(url + "/v1/models"))["data"]]:
        assert post_json(url, "/unload_lora_adapter", {"lora_name": LORA_ADAPTER})[0] == 200  # the other test's
    assert post_json(url, "/load_lora_adapter_from_tensors", load)[0] == 200
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}}
    status, err = post_json(url, "/generate", body)
    assert status == 400 and "must name it in lora_path" in err["message"]
    status, err = post_json(url, "/generate", {**body, "lora_path": "other"})
    assert status == 400 and "lora_path 'other': no such adapter is loaded" in err["message"]
    assert post_json(url, "/generate", {**body, "lora_path": LORA_ADAPTER})[0] == 200

    payload = serialize_adapter(tensors)
    cases = [
        ({"lora_name": LORA_ADAPTER, "config_dict": config, "serialized_tensors": payload}, 400, "already loaded"),
        ({"lora_name": "x", "config_dict": config, "serialized_tensors": payload, "bogus": 1}, 400,
         "unknown field(s) bogus"),
        ({"lora_name": "x", "config_dict": "no", "serialized_tensors": payload}, 400, "config_dict must be an object"),
        ({"lora_name": "x", "config_dict": config, "serialized_tensors": "@@"}, 400, "not valid base64"),
    ]
    for body_, code, text in cases:
        status, answer = post_json(url, "/load_lora_adapter_from_tensors", body_)
        message = answer.get("error_message") or answer.get("message", "")
        assert status == code and text in message, (body_.keys(), status, answer)
    # full weights cannot land under a merged adapter
    status, answer = post_json(url, "/update_weights_from_disk", {"model_path": str(tiny_model)})
    assert status == 400 and "unload it before loading full weights" in answer["message"]

    status, answer = post_json(url, "/unload_lora_adapter", {"lora_name": LORA_ADAPTER})
    assert status == 200 and answer["success"] and answer["loaded_adapters"] == {}
    status, answer = post_json(url, "/unload_lora_adapter", {"lora_name": LORA_ADAPTER})
    assert status == 400 and "is not loaded" in answer["error_message"]
    # rank above --max-lora-rank, and names that are not PEFT's
    wide = TorchTrainer(tiny_model, TrainerConfig(compute_dtype="float32", lora=LoraConfig(rank=16)), device="cpu")
    status, answer = post_json(url, "/load_lora_adapter_from_tensors", {
        "lora_name": "wide", "config_dict": wide.adapter_config(),
        "serialized_tensors": serialize_adapter(dict(wide.named_weights()))})
    assert status == 400 and "above --max-lora-rank 8" in answer["error_message"]
    status, answer = post_json(url, "/load_lora_adapter_from_tensors", {
        "lora_name": "odd", "config_dict": config,
        "serialized_tensors": serialize_adapter({"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)})})
    assert status == 400 and "is not a LoRA weight under PEFT's names" in answer["error_message"]
    # the base model is back: requests without an adapter are served again
    assert post_json(url, "/generate", body)[0] == 200


def test_an_engine_without_a_trainer_rank_on_its_node_is_refused_naming_trainer_lora():
    with pytest.raises(WeightPlanError, match="^trainer.lora: the adapter goes to each engine"):
        plan_senders("auto", [EngineEndpoint("http://x", "n2")], [RankPlace(0, "n1")], "cpu", lora=True)


def test_a_client_sees_the_loaded_adapters_error_message(engine_proc):
    async def run() -> None:
        client = EngineClient(engine_proc.url)
        with pytest.raises(EngineError, match="is not loaded"):
            await client.unload_lora_adapter("nothing-here")
        await client.close()

    asyncio.run(run())


def test_an_adapter_on_modules_outside_lora_target_modules_is_refused(tiny_model):
    from rayrl.engines.cpu.engine import CPUEngine
    from rayrl.engines.cpu.engine_adapter import AdapterError

    trainer = _trainer(tiny_model)
    engine = CPUEngine(tiny_model, dtype="float32", max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"])
    with pytest.raises(AdapterError, match="changes (k_proj|o_proj|gate_proj|up_proj|down_proj), which is not in "
                                           r"--lora-target-modules \['q_proj', 'v_proj'\]"):
        engine.load_adapter(LORA_ADAPTER, trainer.adapter_config(), dict(trainer.named_weights()))
    assert engine.adapter is None
