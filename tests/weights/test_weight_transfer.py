"""Weight transfer without disk, trainer process -> a real CPU engine server process.

The trainer (this test process, a TorchTrainer after real GRPO steps) pushes its weights through
SGLang's endpoints, with the sender rayrl/weights/plan.py builds for each transport: a gloo broadcast
group (``/init_weights_update_group`` + ``/update_weights_from_distributed``, the NCCL path's code on
CPU), shared-memory handles (``/update_weights_from_tensor`` in SGLang's serialized form) and a
safetensors directory in shared memory (``/update_weights_from_disk``). Afterwards the engine's greedy
output and log-probs equal the trainer's own forward pass. Bad requests get 400 with a JSON body.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle

import numpy as np
import pytest
import torch

from rayrl.config import EngineConfig, TrainerConfig
from rayrl.engines.client import EngineClient, EngineError
from rayrl.engines.launcher import EngineProcess
from rayrl.trainers.torch_backend import TorchTrainer
from rayrl.types import Sample
from rayrl.weights.broadcast import BroadcastSender
from rayrl.weights.disk import DiskSender
from rayrl.weights.handles import HandleSender
from rayrl.weights.owners import owner_tag, shared_memory_root
from rayrl.weights.plan import EngineEndpoint, RankPlace, make_sender, plan_senders
from rayrl.weights.transfer import EngineTarget, WeightTransferError, iter_buckets
from rayrl.weights.wire import bucket_classes, serialize_for_engine
from tests.engines._engine_kit import forward_logprobs, post_json

PROMPT = [5, 17, 42, 99, 7, 3]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
BUCKET = 1 << 20  # 1 MiB: the tiny model travels in several buckets


@pytest.fixture(scope="module")
def engine_proc(tiny_model, tmp_path_factory):
    cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=256, num_threads=1, startup_timeout_s=180,
                       weight_format="float32")  # exact numbers: the transfer, not the packing, is checked
    proc = EngineProcess(cfg, str(tiny_model), tmp_path_factory.mktemp("wt") / "engine.log")
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def trainer(tiny_model):
    return TorchTrainer(tiny_model, TrainerConfig(lr=3e-2, micro_batch_tokens=256), seed=0, device="cpu")


def _train(trainer: TorchTrainer, seed: int) -> None:
    """One real GRPO step on random sequences, so the trainer's weights move away from the engine's."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(4):
        tokens = rng.integers(10, 4000, size=20).astype(np.int32)
        n = len(tokens) - 6
        lp = forward_logprobs(trainer.model, tokens[:6].tolist(), tokens[6:].tolist()).numpy()
        samples.append(Sample(tokens=tokens, prompt_length=6, loss_mask=np.ones(n, np.int8),
                              rollout_logprobs=lp, policy_versions=np.zeros(n, np.int32)))
    trainer.train_step(samples, [1.0, -1.0, 1.0, -1.0])


async def _engine_vs_trainer(client: EngineClient, trainer: TorchTrainer) -> tuple[str, float]:
    out = await client.generate(PROMPT, GREEDY)
    expect = forward_logprobs(trainer.model, PROMPT, out.output_ids.tolist()).numpy()
    return out.weight_version, float(np.abs(out.output_logprobs - expect).max())


def test_iter_buckets_sizes_and_dtypes():
    named = [("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(1000)),
             ("d", torch.zeros(10, dtype=torch.bfloat16)), ("e", torch.zeros(10))]  # fmt: skip
    assert [[n for n, _ in b] for b in iter_buckets(iter(named), 800)] == [["a", "b"], ["c"], ["d", "e"]]
    assert [[n for n, _ in b] for b in iter_buckets(iter(named), 10_000, one_dtype=True)] == [
        ["a", "b", "c"], ["d"], ["e"]]  # fmt: skip
    with pytest.raises(ValueError):
        list(iter_buckets(iter(named), 0))


def _sender(mode: str, url: str, tmp_path, node: str = "n1"):
    """The sender a run builds for ``mode``: rank 0 on node n1, the engine on ``node``."""
    plan = plan_senders(mode, [EngineEndpoint(url, node)], [RankPlace(0, "n1")], "cpu")
    return make_sender(plan, 0, bucket_bytes=BUCKET, timeout_s=120, master_address="127.0.0.1",
                       disk_root=tmp_path / "weights", cuda=False)


def test_broadcast_over_gloo_then_engine_matches_trainer(engine_proc, trainer, tmp_path):
    async def run() -> None:
        client = EngineClient(engine_proc.url)
        _train(trainer, seed=1)
        version, diff = await _engine_vs_trainer(client, trainer)
        assert version == "0" and diff > 1e-3  # the engine still has the initial weights

        sender = _sender("auto", engine_proc.url, tmp_path, node="n2")  # another node: only a broadcast reaches it
        assert isinstance(sender, BroadcastSender) and sender.backend == "gloo"
        await sender.connect()
        try:
            stats = await sender.send(trainer.named_weights(torch.float32), version=1)
            assert stats.buckets > 1 and stats.tensors == len(dict(trainer.named_weights()))
            assert stats.bytes == sum(t.numel() * 4 for _, t in trainer.named_weights(torch.float32))
            version, diff = await _engine_vs_trainer(client, trainer)
            assert version == "1" and diff < 1e-4

            _train(trainer, seed=2)  # again, now as flattened buckets over the same group
            sender.flattened = True
            await sender.send(trainer.named_weights(torch.float32), version=2)
            version, diff = await _engine_vs_trainer(client, trainer)
            assert version == "2" and diff < 1e-4
        finally:
            await sender.close()
        with pytest.raises(EngineError, match="no weight update group"):  # close() destroyed it
            await client.destroy_weights_update_group()
        await client.close()

    asyncio.run(run())


@pytest.mark.parametrize("flattened", [True, False], ids=["flattened_bucket", "named_list"])
def test_shared_memory_handles_then_engine_matches_trainer(engine_proc, trainer, flattened, tmp_path):
    async def run() -> None:
        client = EngineClient(engine_proc.url)
        _train(trainer, seed=3 + flattened)
        _, diff = await _engine_vs_trainer(client, trainer)
        assert diff > 1e-3
        version = f"shm-{int(flattened)}"
        if flattened:  # what a run builds by default (auto) for a CPU engine on the trainer's node
            sender = _sender("auto", engine_proc.url, tmp_path)
            assert isinstance(sender, HandleSender) and sender.flattened
        else:
            sender = HandleSender([EngineTarget(EngineClient(engine_proc.url))], bucket_bytes=BUCKET, flattened=False)
        await sender.connect()
        stats = await sender.send(trainer.named_weights(torch.float32), version)
        assert len(list(shared_memory_root().glob(f"rayrl-wbuf-{owner_tag()}-*"))) == 1  # one buffer, reused
        await sender.close()
        assert not list(shared_memory_root().glob(f"rayrl-wbuf-{owner_tag()}-*"))  # closed with the sender
        assert stats.buckets > 1
        got, diff = await _engine_vs_trainer(client, trainer)
        assert got == version and diff < 1e-4
        await client.close()

    asyncio.run(run())


def test_disk_transport_then_engine_matches_trainer(engine_proc, trainer, tmp_path):
    async def run() -> None:
        client = EngineClient(engine_proc.url)
        _train(trainer, seed=6)
        _, diff = await _engine_vs_trainer(client, trainer)
        assert diff > 1e-3
        sender = _sender("disk", engine_proc.url, tmp_path)
        assert isinstance(sender, DiskSender)
        await sender.connect()
        for version in (7, 8):  # only the newest version stays on disk
            stats = await sender.send(trainer.named_weights(torch.float32), version)
            assert stats.bytes == sum(t.numel() * 4 for _, t in trainer.named_weights(torch.float32))
            got, diff = await _engine_vs_trainer(client, trainer)
            assert got == str(version) and diff < 1e-4
            assert [p.name for p in (tmp_path / "weights" / f"rank0-{owner_tag()}").iterdir()] == [f"v{version:06d}"]
        await sender.close()
        assert not list((tmp_path / "weights").iterdir())
        await client.close()

    asyncio.run(run())


class _RunsCode:
    """A pickle that would run a shell command when loaded (the allow-list must refuse it)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_bad_weight_transfer_requests(engine_proc, tmp_path):
    url = engine_proc.url
    init = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2,
            "group_name": "g", "backend": "gloo"}  # fmt: skip
    marker = tmp_path / "pwned"
    evil = base64.b64encode(pickle.dumps([("x", _RunsCode(str(marker)))])).decode()
    cases = [
        ("/init_weights_update_group", {**init, "master_address": None}, "master_address"),
        ("/init_weights_update_group", {**init, "rank_offset": 0}, "rank_offset"),
        ("/init_weights_update_group", {**init, "world_size": "2"}, "world_size"),
        ("/init_weights_update_group", {**init, "backend": "nccl"}, "gloo"),
        ("/init_weights_update_group", b"[1, 2]", "JSON object"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]]},
         "init_weights_update_group"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": [], "shapes": [[2]]}, "dtypes"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["floaty"], "shapes": [[2]]}, "dtype"),
        ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, "names"),
        ("/update_weights_from_distributed",
         {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "load_format": "zip"}, "load_format"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["%%%"]}, "base64"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": [evil]}, "not allowed"),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["AAAA"], "load_format": "my.loader"},
         "load_format"),
    ]  # fmt: skip
    for path, payload, needle in cases:
        status, body = post_json(url, path, payload)
        assert status == 400, (path, payload, body)
        assert body["object"] == "error" and body["code"] == 400 and needle in body["message"], (path, body)
    assert not marker.exists()  # the refused pickle ran nothing

    # a well-formed payload naming a tensor the model does not have: the endpoint's failure shape
    payload = serialize_for_engine([("model.no_such.weight", torch.zeros(3))])
    status, body = post_json(url, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    assert status == 400 and body["success"] is False and "model.no_such.weight" in body["message"]
    metadata_cls = bucket_classes()[1]  # SGLang's own class (the pinned wheel is installed for the tests)
    bucket = {"flattened_tensor": torch.zeros(6, dtype=torch.uint8),  # metadata that does not fit its slice
              "metadata": [metadata_cls("model.norm.weight", torch.Size([4]), torch.float32, 0, 6, 6)]}  # fmt: skip
    status, body = post_json(url, "/update_weights_from_tensor",
                         {"serialized_named_tensors": [serialize_for_engine(bucket)],
                          "load_format": "flattened_bucket"})  # fmt: skip
    assert status == 400 and body["object"] == "error" and "bad bucket metadata" in body["message"]
    status, body = post_json(url, "/destroy_weights_update_group", {"group_name": "never-made"})
    assert status == 400 and body["success"] is False

    async def still_serving() -> None:
        client = EngineClient(url)
        assert (await client.generate(PROMPT, GREEDY)).completion_tokens == 8
        with pytest.raises(WeightTransferError, match="refused|failed"):
            await HandleSender([EngineTarget(client)]).send([("nope", torch.zeros(2))], "x")
        await client.close()

    asyncio.run(still_serving())
