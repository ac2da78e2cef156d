"""Payloads for tensor-parallel engines: one per TP rank, each made on the GPU that rank reads.

SGLang 0.5.9's TP rank ``r`` deserializes ``serialized_named_tensors[r]`` of an
``/update_weights_from_tensor`` request (managers/tp_worker.py) and opens the CUDA IPC handles in it on
the GPU each handle names (utils/patch_torch.py maps the sender's GPU UUID to a visible device). Rank
``r`` runs on visible device ``r`` (entrypoints/engine.py: ``base_gpu_id + tp_rank * gpu_id_step``), so
entry ``r`` must be made on that GPU: a payload from another GPU makes the rank map that GPU's memory
(a CUDA context there and every copy across GPUs), or kill the scheduler when the engine cannot see it;
too few entries kill it too (an IndexError). A trainer rank holds memory on its own GPU only, so each
entry is made by the trainer rank on that GPU (colocated: rayrl/weights/plan.py plans which rank
makes which entry, from where ranks and engines landed).

Sending side, :class:`PayloadExchange`: the trainer ranks of TP ranks 1..N-1 each serialize their own
bucket and hand the payload (a few hundred bytes of handles, not the tensors) to the rank of TP rank 0
through the trainer world's TCP store; that rank posts all N in TP order in one request and then
answers, so the others can free their buckets (the engine has copied them) or fail with the engine's
error. Every rank cuts the same weights into the same buckets (data parallel: identical weights;
Megatron: every rank drains the same gathered export), so bucket ``i`` of every rank is the same tensors.

Receiving side, :func:`check_tp_entries` (the CPU engine and the strict SGLang stand-in): one entry per
TP rank, entry ``r`` made on rank ``r``'s GPU, every entry the same weights.

On CPU there is no GPU in a handle, so a sender on a logical GPU (Ray's ``num_gpus`` on a CPU machine,
the layout tests) marks its flattened bucket with ``"gpu_id"``, the GPU it stands for; SGLang reads only
``flattened_tensor`` and ``metadata`` of a bucket (model_runner._update_weights_from_flattened_bucket), and
its unpickler admits a string, so the mark changes nothing there. Host memory without a mark can be read
by every rank, as a CPU tensor can.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch

from rayrl.weights.transfer import WeightTransferError
from rayrl.weights.wire import GPU_MARK, WeightUpdateError


class PayloadExchange:
    """The trainer ranks of one engine's TP ranks, meeting per bucket in a shared TCP store.

    Keys are ``<session>/<engine>/<send>/<bucket>/...``: ``session`` names one weight plan, ``send``
    counts the pushes since it (every rank makes the same pushes), so a later push never reads an earlier
    one's keys. Waits are bounded by ``timeout_s`` (a rank that died or fell behind fails the push)."""

    def __init__(self, store: Any, session: str, timeout_s: float) -> None:
        self.store = store
        self.session = session
        self.timeout = timedelta(seconds=timeout_s)

    def _key(self, engine: int, send: int, bucket: int, part: str) -> str:
        return f"rayrl-tp/{self.session}/{engine}/{send}/{bucket}/{part}"

    def offer(self, engine: int, send: int, bucket: int, tp_rank: int, payload: str, last: bool) -> None:
        """Hand TP rank ``tp_rank``'s entry of bucket ``bucket`` to the rank that posts it (never blocks)."""
        value = json.dumps({"payload": payload, "last": last})
        self.store.set(self._key(engine, send, bucket, f"entry{tp_rank}"), value)

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait(keys, self.timeout)
        except Exception as err:  # the store's timeout error differs between torch versions
            raise WeightTransferError(
                f"{what} did not arrive within {self.timeout.total_seconds():g} s ({type(err).__name__}: {err}); "
                "a trainer rank died or fell behind"
            ) from None

    def _collect_blocking(self, engine: int, send: int, bucket: int, tp_size: int, last: bool) -> list[str]:
        keys = [self._key(engine, send, bucket, f"entry{r}") for r in range(1, tp_size)]
        self._wait(keys, f"the payloads of TP ranks 1..{tp_size - 1} for bucket {bucket}")
        entries = []
        for r, key in enumerate(keys, start=1):
            value = json.loads(self.store.get(key))
            self.store.delete_key(key)
            if value["last"] != last:
                raise WeightTransferError(
                    f"TP rank {r}'s trainer rank cut the weights into other buckets than TP rank 0's (bucket "
                    f"{bucket}: last={value['last']} vs {last}); every rank must send the same weights"
                )
            entries.append(value["payload"])
        return entries

    async def collect(self, engine: int, send: int, bucket: int, tp_size: int, last: bool) -> list[str]:
        """The entries of TP ranks 1..tp_size-1, in TP order (waits for every one)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, self._collect_blocking, engine, send, bucket, tp_size, last)

    def answer(self, engine: int, send: int, bucket: int, error: Optional[str]) -> None:
        """Tell the contributing ranks the engine has answered (``error``: it refused, or the post failed)."""
        self.store.set(self._key(engine, send, bucket, "answer"), error or "")

    def _outcome_blocking(self, engine: int, send: int, bucket: int) -> str:
        key = self._key(engine, send, bucket, "answer")
        self._wait([key], f"the engine's answer to bucket {bucket}")
        return self.store.get(key).decode()

    async def outcome(self, engine: int, send: int, bucket: int) -> None:
        """Wait until the posting rank has the engine's answer; raise WeightTransferError if it failed."""
        loop = asyncio.get_running_loop()
        error = await loop.run_in_executor(None, self._outcome_blocking, engine, send, bucket)
        if error:
            raise WeightTransferError(f"bucket {bucket} (posted by TP rank 0's trainer rank): {error}")


def entry_gpu(obj: Any) -> Optional[str]:
    """The logical GPU a deserialized entry says it was made on (a flattened bucket's mark), or None."""
    if isinstance(obj, dict) and obj.get(GPU_MARK) is not None:
        return str(obj[GPU_MARK])
    return None


def check_tp_entries(
    entries: Sequence[tuple[list[tuple[str, torch.Tensor]], Optional[str]]],
    tp_gpus: Sequence[str],
    device: Optional[torch.device] = None,
) -> list[tuple[str, torch.Tensor]]:
    """The weights of an update whose TP rank ``r`` read ``entries[r]`` (its tensors and the GPU its mark
    names); raises WeightUpdateError unless each entry was made on its rank's GPU and all hold the same
    weights. ``tp_gpus``: the GPU each rank reads (empty: not known, marks are not checked); ``device``: a
    CUDA device the engine runs on, where every CUDA tensor must be."""
    if not entries:
        raise WeightUpdateError("serialized_named_tensors: no entries")
    for r, (named, gpu) in enumerate(entries):
        if gpu is not None and tp_gpus and gpu != str(tp_gpus[r]):
            raise WeightUpdateError(
                f"serialized_named_tensors[{r}] was made on GPU {gpu}, and tensor-parallel rank {r} reads GPU "
                f"{tp_gpus[r]}: each rank's entry must be made on its own GPU (SGLang's rank would map another "
                "GPU's memory, or die when it cannot see that GPU)"
            )
        if device is not None and device.type == "cuda":
            elsewhere = sorted({str(t.device) for _, t in named if t.is_cuda and t.device != device})
            if elsewhere:
                raise WeightUpdateError(
                    f"serialized_named_tensors[{r}] holds tensors on {', '.join(elsewhere)}, and tensor-parallel "
                    f"rank {r} reads {device}: each rank's entry must be made on its own GPU"
                )
    first = entries[0][0]
    for r, (named, _) in enumerate(entries[1:], start=1):
        if [n for n, _ in named] != [n for n, _ in first] or any(
            a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.to(b.device), b)
            for (_, a), (_, b) in zip(named, first)
        ):
            raise WeightUpdateError(
                f"serialized_named_tensors[{r}] holds other weights than entry 0: the tensor-parallel ranks would "
                "load different weights"
            )
    return first
