"""Trainer -> engine weight transfer on CPU, three transports side by side, same weights, one engine.

- disk: safetensors written to shared memory (/dev/shm) + ``/update_weights_from_disk`` (the CPU default)
- shm handles: SGLang's ``/update_weights_from_tensor`` payload with shared-memory handles (the CPU twin
  of CUDA IPC), flattened buckets
- gloo broadcast: ``/init_weights_update_group`` + ``/update_weights_from_distributed`` (the CPU twin of
  the NCCL path), flattened buckets

The engine is a real CPU engine process (``python -m rayrl.engines.cpu``); the trainer is this process.
The transports take turns
update by update, the order rotating each round, after one warm-up round (bench/measure.py); reported:
median seconds per full update with its spread, GB/s, and the per-round ratio to disk. Every update is
checked: the engine must report the new version.

    python bench/weight_transfer.py [--model smollm2-135m-instruct] [--bucket-mb 64] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from measure import Record, add_common_args, alternate, paired_ratio  # noqa: E402

from rayrl.config import EngineConfig  # noqa: E402
from rayrl.engines.client import EngineClient  # noqa: E402
from rayrl.engines.launcher import EngineProcess  # noqa: E402
from rayrl.models import resolve_model_path  # noqa: E402
from rayrl.weights.broadcast import BroadcastSender  # noqa: E402
from rayrl.weights.disk import DiskSender  # noqa: E402
from rayrl.weights.files import export_state_dict, shared_memory_root  # noqa: E402
from rayrl.weights.handles import HandleSender  # noqa: E402
from rayrl.weights.transfer import EngineTarget  # noqa: E402


def run(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    rounds = dict(min_rounds=2, max_rounds=2) if args.quick else dict(min_rounds=5, max_rounds=9, budget_s=60)
    record = Record("weight_transfer", "Trainer -> engine weight transfer on CPU", quick=args.quick,
                    record_dir=args.record_dir)
    path = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = export_state_dict(model, torch.float32)
    total = sum(t.numel() * t.element_size() for t in state.values())
    cfg = EngineConfig(dtype="float32", max_batch_size=4, context_length=512, num_threads=1, startup_timeout_s=300)
    loop = asyncio.new_event_loop()
    with tempfile.TemporaryDirectory() as logs, EngineProcess(cfg, str(path), Path(logs) / "engine.log") as proc:
        client = EngineClient(proc.url)
        bucket = args.bucket_mb * 1024 * 1024
        senders = {  # the three transports, with the interface the trainer uses (connect / send / close)
            "disk (/dev/shm safetensors)": DiskSender([EngineTarget(EngineClient(proc.url))],
                                                      shared_memory_root() / "rayrl-bench-weights"),
            "shm handles": HandleSender([EngineTarget(EngineClient(proc.url))], bucket_bytes=bucket, flattened=True),
            "gloo broadcast": BroadcastSender([EngineTarget(EngineClient(proc.url))], backend="gloo",
                                              bucket_bytes=bucket, flattened=True),
        }
        versions = iter(range(1, 10**6))

        async def send(sender) -> float:
            version = next(versions)
            start = time.perf_counter()
            await sender.send(state.items(), version)
            elapsed = time.perf_counter() - start
            assert await client.get_weight_version() == str(version)
            return elapsed

        try:
            for sender in senders.values():
                loop.run_until_complete(sender.connect())
            res = alternate({name: (lambda s=sender: loop.run_until_complete(send(s)))
                             for name, sender in senders.items()}, label="transports", **rounds)
        finally:
            for sender in senders.values():
                loop.run_until_complete(sender.close())
            loop.run_until_complete(client.close())
            loop.close()
    base = res["disk (/dev/shm safetensors)"]["value"]
    rows = [[name, r["value"].fmt(3), f"{total / 1e9 / r['value'].median:.2f}",
             paired_ratio(base, r["value"]).fmt(2, "x")] for name, r in res.items()]
    record.table(f"model {args.model}: {len(state)} tensors, {total / 1e6:.0f} MB float32; buckets {args.bucket_mb} "
                 "MiB; seconds per full update, median [IQR] (min-max, n), transports alternating; speed against "
                 "disk = median of per-round ratios", ["transport", "seconds", "GB/s", "speed vs disk"], rows)
    record.save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--bucket-mb", type=int, default=64)
    add_common_args(ap)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
