"""The adapter transport against the strict SGLang 0.5.9 stand-in (``python -m rayrl.engines.cpu --strict-sglang
--enable-lora``): SGLang's own serializer and LoRAConfig read what we send; what 0.5.9 fails on is refused
and counted."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch
from _engine_kit import post_json

from rayrl.config import EngineConfig, LoraConfig, TrainerConfig
from rayrl.engines.api import LORA_ADAPTER
from rayrl.engines.client import EngineClient
from rayrl.engines.launcher import EngineProcess
from rayrl.trainers.torch_backend import TorchTrainer
from rayrl.weights.adapter import AdapterSender
from rayrl.weights.transfer import EngineTarget
from rayrl.weights.wire import serialize_adapter, serialize_for_engine

pytest.importorskip("sglang.srt.utils", reason="the pinned sglang wheel (make test installs it)")


@pytest.fixture(scope="module")
def strict_lora(tiny_model, tmp_path_factory):
    cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=512, num_threads=1, startup_timeout_s=180,
                       max_lora_rank=8, extra_args=["--strict-sglang"])
    proc = EngineProcess(cfg, str(tiny_model), tmp_path_factory.mktemp("strict-lora") / "engine.log").start()
    yield proc
    proc.stop()


def _contract(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/server_info", timeout=10) as resp:
        return json.load(resp)["sglang_contract"]


def test_the_adapter_sender_passes_the_strict_stand_in_and_bad_payloads_are_counted(strict_lora, tiny_model):
    url = strict_lora.url
    trainer = TorchTrainer(tiny_model, TrainerConfig(compute_dtype="float32", lora=LoraConfig(rank=4)), device="cpu")
    tensors = dict(trainer.named_weights(torch.float32))

    async def run() -> None:
        client = EngineClient(url)
        sender = AdapterSender([EngineTarget(client)], trainer.adapter_config())
        await sender.connect()
        for version in (1, 2):
            await sender.send(iter(tensors.items()), version)
        out = await client.generate([5, 17, 42], {"max_new_tokens": 3}, lora_path=LORA_ADAPTER)
        assert out.weight_version == "2" and await client.lora_adapters() == [LORA_ADAPTER]
        await client.close()

    asyncio.run(run())
    assert _contract(url)["contract_violations"] == 0

    # a list of pairs (what /update_weights_from_tensor takes) is not what 0.5.9's LoRAAdapter iterates
    status, body = post_json(url, "/load_lora_adapter_from_tensors", {
        "lora_name": "other", "config_dict": trainer.adapter_config(),
        "serialized_tensors": serialize_for_engine(list(tensors.items()))})
    assert status == 400 and "iterates a dict of name -> tensor" in body["message"]
    assert _contract(url)["contract_violations"] == 1
    # SGLang's own LoRAConfig needs target_modules
    config = {k: v for k, v in trainer.adapter_config().items() if k != "target_modules"}
    status, body = post_json(url, "/load_lora_adapter_from_tensors", {
        "lora_name": "other", "config_dict": config, "serialized_tensors": serialize_adapter(tensors)})
    assert status == 400 and "target_modules" in body["error_message"]
