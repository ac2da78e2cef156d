"""rayrl's decode kernels (rayrl/engines/cpu/decode_kernels.py, decode_kernels.cpp) held to the torch ops they
replace in the step, and the step's fallback to torch's ops where they cannot be built.

Tolerances, float32: attention 2e-5 max |kernel - SDPA| (another summation order and our own exp;
measured up to 2.3e-6), on cache-shaped inputs: queries as views of a fused qkv row, keys
and values as column windows of a wider cache buffer; the pointwise ops 1e-5 (RoPE is exact up to the
FMA's rounding, silu uses our exp, the norm sums in another order).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from rayrl.engines.cpu import decode_kernels
from rayrl.engines.cpu.decode_kernels import decode_kernels_available


@pytest.fixture(scope="module")
def kernel() -> None:
    if not decode_kernels_available():
        pytest.skip(f"the kernels cannot be built here: {decode_kernels.unavailable_reason()}")


def _case(n: int, kv_heads: int, group: int, dim: int, length: int, padded: bool, seed: int):
    """Queries ``[n, kv_heads, group, dim]`` inside a wider qkv row, keys/values ``[n, kv_heads, length, dim]``
    as views of a cache with spare columns, and a left-padding mask (0 / -inf, one row unpadded) or None."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    qkv = torch.randn(n, heads + 2 * kv_heads, dim, generator=g) * 2
    q = qkv.narrow(1, 0, heads).view(n, kv_heads, group, dim)
    cache = torch.randn(2, n, kv_heads, length + 7, dim, generator=g)
    mask = None
    if padded:
        mask = torch.zeros(n, 1, 1, length)
        for r in range(1, n):
            mask[r, ..., : int(torch.randint(0, length, (1,), generator=g))] = float("-inf")
    return q, cache[0, :, :, :length], cache[1, :, :, :length], mask


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dim", [16, 32, 40, 64, 128])
def test_kernel_is_sdpa(kernel, group, dim):
    worst = 0.0
    for seed, length in enumerate([1, 2, 3, 4, 7, 8, 9, 33, 130, 300]):
        for padded in (False, True):
            q, k, v, mask = _case(3, 2, group, dim, length, padded, seed)
            scale = dim**-0.5
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
            got = torch.ops.rayrl.decode_attention(q, k, v, mask, scale)
            assert got.shape == want.shape and got.is_contiguous()
            worst = max(worst, float((got - want).abs().max()))
    assert worst <= 2e-5


def test_kernel_with_more_rows_than_threads_and_large_scores(kernel):
    """Every (row, KV head) task lands where it belongs across threads, and with scores in the hundreds
    (where float32 rounding of the scores shows in the output) the kernel is as close to a float64
    reference as SDPA is."""
    q, k, v, mask = _case(9, 3, 3, 64, 130, True, 7)
    q = q * 30
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=0.125)
    sdpa_error = float((F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125) - exact).abs().max())
    kernel_error = float((torch.ops.rayrl.decode_attention(q, k, v, mask, 0.125) - exact).abs().max())
    assert kernel_error <= 2 * sdpa_error + 1e-6


def test_a_query_with_nothing_to_attend_gets_zeros(kernel):
    q, k, v, _ = _case(2, 1, 2, 32, 5, False, 0)
    mask = torch.zeros(2, 1, 1, 5)
    mask[1] = float("-inf")
    out = torch.ops.rayrl.decode_attention(q, k, v, mask, 0.2)
    assert bool((out[1] == 0).all())
    want = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], scale=0.2)
    torch.testing.assert_close(out[:1], want, atol=2e-5, rtol=0)


def test_kernel_refuses_what_it_cannot_read(kernel):
    q, k, v, _ = _case(2, 1, 2, 32, 5, False, 0)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.rayrl.decode_attention(q.double(), k.double(), v.double(), None, 0.2)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.rayrl.decode_attention(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None, 0.2)


@pytest.mark.parametrize("dim", [16, 32, 40, 64, 128])
def test_rope_cache_is_rope_and_the_cache_copy(kernel, dim):
    """Queries rotated in place, rotated keys and the values written to the cache column (a strided view
    of a wider cache, as the step passes it), the keys in qkv left as they were."""
    g = torch.Generator().manual_seed(dim)
    n, heads, kv_heads = 5, 6, 2
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).view(n, heads + 2 * kv_heads, dim)
    cos, sin = torch.randn(n, 1, dim, generator=g), torch.randn(n, 1, dim, generator=g)
    cache = torch.zeros(2, n + 1, kv_heads, 9, dim)
    col = cache[:, 1:, :, 4]
    qk = qkv.narrow(1, 0, heads + kv_heads)
    rotated = qk * cos + qk.roll(dim // 2, -1) * sin
    keys_before, values = qkv[:, heads : heads + kv_heads].clone(), qkv[:, heads + kv_heads :].clone()
    torch.ops.rayrl.rope_cache(qkv, cos, sin, col, heads)
    torch.testing.assert_close(qkv[:, :heads], rotated[:, :heads], atol=1e-5, rtol=0)
    torch.testing.assert_close(col[0], rotated[:, heads:], atol=1e-5, rtol=0)
    assert torch.equal(col[1], values) and torch.equal(qkv[:, heads : heads + kv_heads], keys_before)
    assert int(cache.count_nonzero()) == int(col.count_nonzero())  # nothing written outside the column


@pytest.mark.parametrize("inter", [1, 8, 36, 1536])
def test_silu_mul_is_silu_times_up(kernel, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(3, 2 * inter, generator=g) * 6
    gate_up[0, :inter] = torch.linspace(-120, 120, inter)  # far tails: exp's clamps
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(torch.ops.rayrl.silu_mul(gate_up), want, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("hidden", [4, 44, 576])
def test_add_rms_norm_adds_in_place_and_norms(kernel, hidden):
    g = torch.Generator().manual_seed(hidden)
    x, y = torch.randn(4, hidden, generator=g) * 3, torch.randn(4, hidden, generator=g)
    w = torch.randn(hidden, generator=g)
    total = x + y
    out = torch.ops.rayrl.add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(x, total)
    torch.testing.assert_close(out, torch.rms_norm(total, [hidden], w, 1e-5), atol=1e-5, rtol=1e-6)


@pytest.fixture
def fresh_choice():
    """decode_kernels_available() decided again in the test, and again after it (for later tests)."""
    decode_kernels_available.cache_clear()
    yield
    decode_kernels_available.cache_clear()


def test_no_kernel_when_turned_off_and_the_step_uses_sdpa(fresh_choice, tiny_model, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM

    from rayrl.engines.cpu.lean_decode import LeanDecoder

    monkeypatch.setenv(decode_kernels.ENV, "off")
    with caplog.at_level(logging.WARNING, logger="rayrl.engines.cpu.decode_kernels"):
        assert decode_kernels_available() is False
    assert "RAYRL_DECODE_KERNELS=off" in caplog.text
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    lean = LeanDecoder(model, "float32", 64)
    assert lean.kernel is False and lean.attention == "sdpa"


def test_a_failed_build_falls_back_to_sdpa(fresh_choice, monkeypatch, caplog):
    import torch.utils.cpp_extension as ext

    if decode_kernels.unavailable_reason() is not None:
        pytest.skip("no build is tried here")

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'rayrl_decode_kernels'")

    monkeypatch.setattr(ext, "load", broken)
    with caplog.at_level(logging.WARNING, logger="rayrl.engines.cpu.decode_kernels"):
        assert decode_kernels_available() is False
    assert "Error building extension" in caplog.text


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_engine(tmp_path):
    """torch's loader waits for ever while its ``lock`` file exists; a build killed midway leaves one. A new
    process, in a copy of this machine's build folder holding a just-written lock, loads the kernels."""
    import os
    import shutil
    import subprocess
    import sys

    if decode_kernels.unavailable_reason() is not None:
        pytest.skip("no build is tried here")
    decode_kernels_available()  # this machine's build exists (or the copy below builds: seconds)
    here = decode_kernels.build_directory()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    copy = tmp_path / here.name
    shutil.copytree(here, copy, ignore=shutil.ignore_patterns("lock", "*.flock"))
    (copy / "lock").touch()  # as fresh as a build in progress: no age tells them apart
    probe = "from rayrl.engines.cpu.decode_kernels import decode_kernels_available as a; print(a())"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
    assert "removed the build lock of a build that did not finish" in done.stderr
    assert not (copy / "lock").exists()


def test_no_kernel_without_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(decode_kernels, "cpu_flags", lambda: {"sse2", "avx"})
    monkeypatch.setattr(decode_kernels.platform, "machine", lambda: "x86_64")
    monkeypatch.delenv(decode_kernels.ENV, raising=False)
    assert decode_kernels.unavailable_reason() == "the CPU lacks avx2, fma, f16c"
    monkeypatch.setattr(decode_kernels.platform, "machine", lambda: "aarch64")
    assert decode_kernels.unavailable_reason() == "not x86-64 (aarch64)"


def test_the_build_folder_is_keyed_by_what_the_build_depends_on(tmp_path, monkeypatch):
    """Two checkouts of the same source share one build; another source or other flags get their own
    folder instead of rebuilding over the other's (what happened when every checkout used one folder)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    here = decode_kernels.build_directory()
    assert here.parent == tmp_path / "builds" and (here / decode_kernels.SOURCE.name).read_bytes() \
        == decode_kernels.SOURCE.read_bytes()
    other_checkout = tmp_path / "other" / decode_kernels.SOURCE.name
    other_checkout.parent.mkdir()
    other_checkout.write_bytes(decode_kernels.SOURCE.read_bytes())
    monkeypatch.setattr(decode_kernels, "SOURCE", other_checkout)
    assert decode_kernels.build_directory() == here
    other_checkout.write_bytes(other_checkout.read_bytes() + b"\n// changed\n")
    changed = decode_kernels.build_directory()
    assert changed != here and (changed / other_checkout.name).read_bytes().endswith(b"// changed\n")
    monkeypatch.setattr(decode_kernels, "CFLAGS", [*decode_kernels.CFLAGS, "-DOTHER"])
    assert decode_kernels.build_directory() not in (here, changed)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("RAYRL_CACHE", str(tmp_path / "cache"))  # rayrl's cache folder, beside the models
    assert decode_kernels.build_directory().parent == tmp_path / "cache" / "kernels"


def test_the_build_names_no_checkout(kernel):
    """torch's build file names the copy inside the keyed folder, never this checkout's source: a run from
    another checkout then finds the same build file and loads the kernels without building them again."""
    build_file = (decode_kernels.build_directory() / "build.ninja").read_text()
    assert str(decode_kernels.SOURCE) not in build_file
    assert str(decode_kernels.build_directory() / decode_kernels.SOURCE.name) in build_file
