"""BatchKV bookkeeping: random joins, decode steps and leaves keep every row's cache intact."""

from __future__ import annotations

import random

import torch

from rayrl.engines.cpu.kv_cache import BatchKV, KVBlock, prefill_mask

H, D, LAYERS = 2, 4, 2


def make_block(lengths: list[int], tag: int) -> tuple[KVBlock, list[torch.Tensor]]:
    """A left-padded block; row i's real columns hold distinct values; returns per-row real K columns."""
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    keys = torch.full((len(lengths), H, width, D), float("nan"))  # padding garbage must not survive
    real = []
    for i, n in enumerate(lengths):
        mask[i, width - n :] = True
        cols = torch.randn(H, n, D) + tag
        keys[i, :, width - n :] = cols
        real.append(cols)
    values = keys * 2
    return KVBlock([keys.clone() for _ in range(LAYERS)], [values.clone() for _ in range(LAYERS)], mask), real


def check(kv: BatchKV, rows: list[torch.Tensor]) -> None:
    assert kv.rows == len(rows)
    if not rows:
        return
    for layer in range(LAYERS):
        keys = kv.cache.layers[layer].keys
        values = kv.cache.layers[layer].values
        assert keys.shape[0] == len(rows) and keys.shape[2] == kv.length
        for r, ref in enumerate(rows):
            m = kv.mask[r]
            assert int(m.sum()) == ref.shape[1] and bool(m[-ref.shape[1] :].all())  # right-aligned
            torch.testing.assert_close(keys[r][:, m], ref)
            torch.testing.assert_close(values[r][:, m], ref * 2)
            assert torch.isfinite(keys[r]).all() and torch.isfinite(values[r]).all()
    leading = int(kv.mask.any(dim=0).to(torch.int8).argmax())
    assert leading < max(32, kv.length // 4) or kv.length == 0  # long all-padding prefixes are trimmed


def test_random_join_step_leave_sequences():
    rng = random.Random(0)
    torch.manual_seed(0)
    kv = BatchKV(LAYERS, max_rows=12)
    rows: list[torch.Tensor] = []
    for event in range(120):
        action = rng.random()
        if action < 0.3 and len(rows) < 12:
            lengths = [rng.choice([1, 3, 8, 40, 90]) for _ in range(rng.randint(1, min(3, 12 - len(rows))))]
            block, real = make_block(lengths, event)
            keep = sorted(rng.sample(range(len(lengths)), rng.randint(1, len(lengths))))
            kv.append(block, torch.tensor(keep))
            rows.extend(real[i] for i in keep)
        elif action < 0.5 and rows:
            drop = sorted(rng.sample(range(len(rows)), rng.randint(1, len(rows))))
            order = kv.remove(drop)
            assert sorted(order) == [i for i in range(len(rows)) if i not in drop]
            rows = [rows[i] for i in order]
        elif rows:  # a decode step: every row gets one new column
            kv.decode_mask()
            new = torch.randn(len(rows), H, 1, D)
            for layer in kv.cache.layers:
                layer.update(new, new * 2)
            kv.commit()
            rows = [torch.cat([ref, new[i]], dim=1) for i, ref in enumerate(rows)]
        check(kv, rows)


def test_decode_mask_is_a_view_and_grows():
    kv = BatchKV(LAYERS, max_rows=4)
    block, _ = make_block([3, 5], 0)
    kv.append(block)
    capacity = kv.col_capacity
    for _ in range(capacity):  # past the first capacity: buffers grow, contents survive
        mask = kv.decode_mask()
        assert mask.shape == (2, 1, 1, kv.length + 1) and mask.data_ptr() == kv.mask_buffer.data_ptr()
        z = torch.zeros(2, H, 1, D)
        for layer in kv.cache.layers:
            layer.update(z, z)
        kv.commit()
    assert kv.col_capacity > capacity and kv.length == 5 + capacity


def test_prefill_mask_rows_never_empty():
    mask = torch.tensor([[False, False, True], [True, True, True]])
    full = prefill_mask(mask)
    assert full.shape == (2, 1, 3, 3)
    assert bool(full.any(dim=-1).all())
    assert full[0, 0, 2].tolist() == [False, False, True]
    assert full[1, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_step_mask_is_none_exactly_when_no_row_is_padded():
    rng = random.Random(1)
    kv = BatchKV(LAYERS, max_rows=8)
    rows = 0
    for event in range(60):
        if rng.random() < 0.4 and rows < 8:
            n = rng.randint(1, min(3, 8 - rows))
            block, _ = make_block([rng.choice([4, 4, 7]) for _ in range(n)], event)
            kv.append(block)
            rows += n
        elif rng.random() < 0.3 and rows:
            kv.remove(sorted(rng.sample(range(rows), rng.randint(1, rows))))
            rows = kv.rows
        elif rows:
            padded = not bool(kv.mask.all())
            mask = kv.step_mask()
            assert (mask is None) == (not padded)
            if mask is not None:
                assert mask.shape == (rows, 1, 1, kv.length + 1)
            z = torch.zeros(rows, H, 1, D)
            for layer in kv.cache.layers:
                layer.update(z, z)
            kv.commit()


def test_a_forward_for_part_of_the_rows_sees_and_writes_only_those():
    """rows_only: the cache views a model gets cover the part; a step run in two parts equals one step."""
    torch.manual_seed(2)
    block, real = make_block([3, 6, 2, 5], 0)
    kv = BatchKV(LAYERS, max_rows=4)
    kv.append(block)
    kv.decode_mask()
    new = torch.randn(4, H, 1, D)
    for part in (slice(0, 1), slice(1, 4)):
        with kv.rows_only(part):
            for layer in kv.cache.layers:
                keys, values = layer.update(new[part], new[part] * 2)
                assert keys.shape[0] == part.stop - part.start and keys.shape[2] == kv.length + 1
    kv.commit(1)
    check(kv, [torch.cat([ref, new[i]], dim=1) for i, ref in enumerate(real)])
    assert kv.window == slice(0, 4)
