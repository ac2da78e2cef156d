"""CUDA IPC weight transfer between two processes, the colocated path of /update_weights_from_tensor:
the sender serializes buckets as IPC handles (rayrl.weights.wire.serialize_for_engine), the receiver
opens them with the allow-list unpickler and copies into its own weights. Prints and records GB/s."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch
from _gpu_kit import record

pytestmark = pytest.mark.gpu

TOTAL_BYTES = 4 * 1024**3
BUCKET_BYTES = 512 * 1024**2
TENSOR_ELEMS = 64 * 1024**2  # 128 MiB per bf16 tensor


def _receiver(requests: "mp.Queue", replies: "mp.Queue") -> None:
    import torch

    from rayrl.weights.wire import deserialize_entry

    torch.cuda.set_device(0)
    weights: dict[str, torch.Tensor] = {}
    while True:
        payload = requests.get()
        if payload is None:
            break
        named, _ = deserialize_entry(payload, allow_cuda=True)
        for name, t in named:
            if name not in weights:
                weights[name] = torch.empty_like(t)
            weights[name].copy_(t)
        torch.cuda.synchronize()
        del named
        replies.put(len(weights))
    checksum = float(sum(w.float().sum().item() for w in weights.values()))
    replies.put(checksum)


def test_cuda_ipc_two_processes():
    from rayrl.weights.transfer import iter_buckets
    from rayrl.weights.wire import flatten_bucket, serialize_for_engine

    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = TOTAL_BYTES // (TENSOR_ELEMS * 2)
    named = [(f"layer{i}.weight", torch.randn(TENSOR_ELEMS, device="cuda", generator=gen).to(torch.bfloat16))
             for i in range(n)]  # fmt: skip
    expected = float(sum(t.float().sum().item() for _, t in named))
    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(requests, replies), daemon=True)
    proc.start()
    try:
        # warm-up (CUDA context in the receiver), not timed
        requests.put(serialize_for_engine(flatten_bucket(named[:1])))
        replies.get(timeout=300)
        results = {}
        for form in ("flattened_bucket", "named_list"):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for bucket in iter_buckets(iter(named), BUCKET_BYTES, one_dtype=True):
                obj = flatten_bucket(bucket) if form == "flattened_bucket" else bucket
                requests.put(serialize_for_engine(obj))
                replies.get(timeout=300)  # the receiver has copied: the bucket may be freed
                del obj
            seconds = time.perf_counter() - start
            results[form] = {"seconds": seconds, "gb_per_s": TOTAL_BYTES / 1e9 / seconds}
        requests.put(None)
        got = replies.get(timeout=300)
    finally:
        proc.join(60)
    figures = {"device": torch.cuda.get_device_name(), "total_bytes": TOTAL_BYTES, "bucket_bytes": BUCKET_BYTES,
               **{f"{form}_{k}": v for form, r in results.items() for k, v in r.items()}}  # fmt: skip
    record("ipc_transfer", figures)
    assert abs(got - expected) <= 1e-3 * max(1.0, abs(expected))
    assert all(r["gb_per_s"] > 0 for r in results.values())
