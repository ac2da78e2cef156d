"""Offload bandwidth (issue 20 item 2): a 4 GiB state paused and resumed three times by

- ``ours``: MemorySaver (region without the library's backup; one pinned host buffer, async copies),
- ``library``: torch_memory_saver's own CPU backup (pinned host memory allocated at every pause),
- ``library_retained``: the same with ``retain_cpu_backup`` (torch_memory_saver >= 0.0.10),

side by side with a plain pinned-memory ``copy_`` of the same bytes, in one process on one GPU.
Every cycle must restore every byte; the rates are recorded in $OUT/offload_bandwidth.json, never
asserted (timings are not pass/fail). fzyzcjy/torch_memory_saver#111 reports the library's backup at
2.41 GiB/s (pause) and 5.32 GiB/s (resume) against 24.4 / 23.5 GiB/s for a plain pinned copy on an L20.
"""

from __future__ import annotations

import time
from typing import Callable

import pytest
import torch
from _gpu_kit import need, record

pytestmark = pytest.mark.gpu

GIB = 2**30
STATE_BYTES = 4 * GIB
CHUNK_BYTES = 256 * 2**20  # 16 tensors, like a model's large parameters
CYCLES = 3


def _make_state(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, device="cuda", generator=gen)
            for _ in range(STATE_BYTES // CHUNK_BYTES)]  # fmt: skip


def _checksums(tensors: list[torch.Tensor]) -> list[int]:
    return [int(t.sum(dtype=torch.int64)) for t in tensors]


def _timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def _cycles(pause: Callable[[], object], resume: Callable[[], object], state: list[torch.Tensor]) -> list[dict]:
    expected = _checksums(state)
    out = []
    for _ in range(CYCLES):
        pause_s = _timed(pause)
        resume_s = _timed(resume)
        out.append({"pause_s": pause_s, "resume_s": resume_s, "pause_gib_per_s": STATE_BYTES / GIB / pause_s,
                    "resume_gib_per_s": STATE_BYTES / GIB / resume_s, "restored": _checksums(state) == expected})
    return out


def _plain_pinned() -> list[dict]:
    """The reference: a plain pinned copy of the same bytes, both ways, into a buffer allocated beforehand."""
    device = torch.empty(STATE_BYTES, dtype=torch.uint8, device="cuda")
    host = torch.empty(STATE_BYTES, dtype=torch.uint8, pin_memory=True)
    out = []
    for _ in range(CYCLES):
        d2h = _timed(lambda: host.copy_(device, non_blocking=True))
        h2d = _timed(lambda: device.copy_(host, non_blocking=True))
        out.append({"d2h_gib_per_s": STATE_BYTES / GIB / d2h, "h2d_gib_per_s": STATE_BYTES / GIB / h2d})
    return out


def test_offload_bandwidth_ours_library_and_plain_pinned():
    need("torch_memory_saver")
    from torch_memory_saver import torch_memory_saver as tms

    from rayrl.trainers.memory_saver import MemorySaver

    results: dict[str, object] = {"device": torch.cuda.get_device_name(), "state_bytes": STATE_BYTES}

    plain = _plain_pinned()
    results["plain_pinned"] = plain
    torch.cuda.empty_cache()

    saver = MemorySaver(enabled=True, tag="bw-ours")  # sets the library's hook mode first
    with saver.region():
        ours = _make_state(1)
    results["ours"] = _cycles(saver.pause, saver.resume, ours)
    results["ours_last_cycle"] = saver.last_cycle

    with tms.region(tag="bw-library", enable_cpu_backup=True):
        library = _make_state(2)
    results["library"] = _cycles(lambda: tms.pause("bw-library"), lambda: tms.resume("bw-library"), library)

    # a property from 0.0.10 on; on 0.0.9 (SGLang 0.5.5's pin) an assignment would only add an attribute
    retained_supported = isinstance(getattr(type(tms), "retain_cpu_backup", None), property)
    if retained_supported:
        tms.retain_cpu_backup = True
    results["library_retained_supported"] = retained_supported
    if retained_supported:
        with tms.region(tag="bw-library-retained", enable_cpu_backup=True):
            retained = _make_state(3)
        results["library_retained"] = _cycles(lambda: tms.pause("bw-library-retained"),
                                              lambda: tms.resume("bw-library-retained"), retained)  # fmt: skip
        tms.retain_cpu_backup = False

    steady = {name: results[name][-1] for name in ("ours", "library", "library_retained") if name in results}
    ref = plain[-1]
    results["ratios_last_cycle"] = {
        name: {"plain_over_pause": ref["d2h_gib_per_s"] / c["pause_gib_per_s"],
               "plain_over_resume": ref["h2d_gib_per_s"] / c["resume_gib_per_s"]}
        for name, c in steady.items()
    }  # fmt: skip
    record("offload_bandwidth", results)
    for name in ("ours", "library", "library_retained"):
        if name in results:
            assert all(c["restored"] for c in results[name]), name  # every byte back, every cycle
