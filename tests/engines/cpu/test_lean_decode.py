"""The engine's own decode path (rayrl/engines/cpu/lean_decode.py) held to the transformers model.

Per model family (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms and a head size of its own) and
per weight format; the packed weights across weight updates, also while a request decodes through
them; and a decode forward that one request breaks, which fails that request alone.

Tolerances (max |engine - transformers| log-prob of each generated token, recomputed by one plain
transformers forward in float32):
- float32 weights: 1e-4 (float32 rounding of fused matmuls and another attention kernel);
- fp16-packed weights, on the real SmolLM2-135M-Instruct: 1e-2 at most and 2e-3 on average (measured
  about 4e-3 and 9e-4); on the random tiny models, whose logits are far larger than a
  trained model's, 2e-2 (measured up to 7.5e-3).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
from _engine_kit import forward_logprobs, random_weights

from rayrl.engines.cpu.decode_kernels import decode_kernels_available
from rayrl.engines.cpu.engine import CPUEngine
from rayrl.engines.cpu.kv_cache import BatchKV, KVBlock, prefill_mask
from rayrl.engines.cpu.lean_decode import HEAD_CHUNK, LeanDecoder, _decoder_layers, unsupported_reason
from rayrl.engines.cpu.weight_formats import Fp16PackedChunks, Fp16PackedLinear, fp16_packing_available
from rayrl.models import resolve_model_path

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
PROMPTS = [[1, 2, 3, 4, 5], list(range(100, 137)), [7], list(range(2000, 2090, 3))]
REQUESTS = [  # joined into one left-padded batch: greedy and sampled rows
    (PROMPTS[0], GREEDY),
    (PROMPTS[1], {"temperature": 0.8, "max_new_tokens": 10, "sampling_seed": 3}),
    (PROMPTS[2], dict(GREEDY, max_new_tokens=7)),
    (PROMPTS[3], {"temperature": 1.2, "top_k": 30, "max_new_tokens": 9, "sampling_seed": 4}),
]
packed_only = pytest.mark.skipif(not fp16_packing_available(), reason="this torch build has no FBGEMM fp16 linear")


def _family_model(kind: str, target: Path, tokenizer_dir: Path) -> Path:
    """A tiny random model of ``kind`` with SmolLM2's tokenizer (weights re-drawn so outputs vary)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, MistralConfig, Qwen2Config, Qwen3Config

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  tie_word_embeddings=kind != "qwen2", eos_token_id=2, pad_token_id=0)
    config = {"qwen2": lambda: Qwen2Config(**common),
              "qwen3": lambda: Qwen3Config(**common, head_dim=32),  # 4 x 32 = 128 query dims != hidden 64
              "mistral": lambda: MistralConfig(**common, sliding_window=None)}[kind]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(random_weights(model, seed=11), strict=False)
    model.save_pretrained(target, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name == "vocab.json":
            shutil.copy(f, target / f.name)
    return target


@pytest.fixture(scope="module")
def family_models(tiny_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    models = {"llama": tiny_model}
    for kind in ("qwen2", "qwen3", "mistral"):
        models[kind] = _family_model(kind, root / kind, tiny_model)
    return models


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _max_gap(engine: CPUEngine, reference, requests) -> float:
    """Run ``requests`` together; the largest |engine - reference| log-prob over every output token."""
    handles = [engine.submit(p, sp) for p, sp in requests]
    worst = 0.0
    for (prompt, _), h in zip(requests, handles):
        res = h.result(60)
        assert res.finish_reason["type"] == "length" and len(res.output_logprobs) == len(res.output_ids)
        expected = forward_logprobs(reference, prompt, res.output_ids)
        worst = max(worst, float((torch.tensor(res.output_logprobs) - expected).abs().max()))
    return worst


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("fmt, tolerance", [("float32", 1e-4), pytest.param("fp16-packed", 2e-2, marks=packed_only)])
def test_each_family_decodes_as_transformers(family_models, kind, fmt, tolerance):
    path = family_models[kind]
    with CPUEngine(path, dtype="float32", max_batch_size=8, weight_format=fmt) as eng:
        stats = eng.stats()
        assert stats["decode_path"] == "lean" and stats["weight_format"] == fmt
        assert stats["decode_attention"] == ("rayrl-kernels" if decode_kernels_available() else "sdpa")
        assert _max_gap(eng, _reference(path), REQUESTS) <= tolerance


def _left_padded(n: int, t: int, padding: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` random prompts of ``t`` ids, row ``r`` left-padded by ``padding[r]`` columns: ids, mask, positions."""
    ids = torch.randint(3, 1000, (n, t))
    mask = torch.ones(n, t, dtype=torch.bool)
    for row, columns in padding.items():
        mask[row, :columns] = False
    return ids, mask, (mask.long().cumsum(1) - 1).clamp(min=0)


def _cache_of(lean: LeanDecoder, keys: list, values: list, mask: torch.Tensor) -> BatchKV:
    """A fresh running-batch cache holding a prefill's keys and values."""
    kv = BatchKV(len(lean.layers), mask.shape[0])
    kv.append(KVBlock(keys, values, mask))
    return kv


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("fmt", ["float32", pytest.param("fp16-packed", marks=packed_only)])
def test_scripted_step_is_the_python_step(family_models, kind, fmt):
    """Both weight formats run their layers through one TorchScript function; the same function run as
    Python (what a torch build that cannot script it runs) gives the same logits and writes the same
    cache column, with and without padding (Qwen2's q/k/v biases and Qwen3's q/k norms included)."""
    model = _reference(family_models[kind])
    lean = LeanDecoder(model, fmt, 256)
    assert isinstance(lean._run_layers, torch.jit.ScriptFunction)
    assert (len(lean._packed) > 0) == (fmt == "fp16-packed") and (len(lean._dense) > 0) == (fmt == "float32")
    torch.manual_seed(0)
    for padded in (False, True):
        n, t = 3, 9
        ids, mask, positions = _left_padded(n, t, {0: 4} if padded else {})
        with torch.inference_mode():
            attn = prefill_mask(mask) if padded else None
            _, keys, values = lean.prefill(ids, positions, attn, None, False)
            outs = []
            for run in (lean._run_layers, _decoder_layers):
                kv = _cache_of(lean, keys, values, mask)
                step_mask = kv.step_mask()
                assert (step_mask is not None) == padded
                lean._run_layers = run
                logits = lean.step(ids[:, -1], positions[:, -1] + 1, kv, slice(0, n), step_mask)
                outs.append((logits, kv.all_kv[:, :, :n, :, t].clone()))
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=0)
        torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("fmt", ["float32", pytest.param("fp16-packed", marks=packed_only)])
def test_kernel_step_is_the_sdpa_step(family_models, kind, fmt):
    """Where rayrl's attention kernel builds, the step runs through it (so the tests above hold it to
    transformers) and gives the logits of the same step through SDPA, with and without padding."""
    if not decode_kernels_available():
        pytest.skip("rayrl's kernels cannot be built here")
    lean = LeanDecoder(_reference(family_models[kind]), fmt, 256)
    assert lean.kernel and lean.attention == "rayrl-kernels"
    torch.manual_seed(1)
    for padded in (False, True):
        n, t = 4, 11
        ids, mask, positions = _left_padded(n, t, {0: 4, 2: 9} if padded else {})
        outs = []
        with torch.inference_mode():
            _, keys, values = lean.prefill(ids, positions, prefill_mask(mask) if padded else None, None, False)
            for kernel in (True, False):
                kv = _cache_of(lean, keys, values, mask)
                lean.kernel = kernel
                outs.append(lean.step(ids[:, -1], positions[:, -1] + 1, kv, slice(0, n), kv.step_mask()))
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)


@packed_only
def test_packed_head_in_blocks_is_the_whole_head(tiny_model):
    """fp16-packed packs the vocabulary head in row blocks (HEAD_CHUNK rows each): its logits are those of
    the head packed whole, at 1 and 8 rows, and an update of the (tied) embedding reaches every block."""
    model = _reference(tiny_model)
    lean = LeanDecoder(model, "fp16-packed", 64)
    weight = model.get_output_embeddings().weight
    assert isinstance(lean.head, Fp16PackedChunks) and len(lean.head.parts) == -(-weight.shape[0] // HEAD_CHUNK) > 1
    assert lean.head.nbytes == 2 * weight.numel()
    torch.manual_seed(0)
    with torch.inference_mode():
        for rows in (1, 8):
            x = torch.randn(rows, weight.shape[1])
            torch.testing.assert_close(lean.head(x), Fp16PackedLinear(weight)(x), atol=1e-6, rtol=0)
        new = random_weights(model, seed=5)["model.embed_tokens.weight"]
        model.model.embed_tokens.weight.copy_(new)  # tied: the head's weight too
        lean.repack(["model.embed_tokens.weight"])
        x = torch.randn(8, weight.shape[1])
        torch.testing.assert_close(lean.head(x), Fp16PackedLinear(new)(x), atol=1e-6, rtol=0)


def test_other_families_decode_through_transformers(family_models):
    """A model the lean path does not cover decodes as before, through transformers; asking it for
    packed weights is refused."""
    path = family_models["mistral"]
    reference = _reference(path)
    assert "mistral" in unsupported_reason(reference, torch.device("cpu"))
    with CPUEngine(path, dtype="float32", max_batch_size=8, weight_format="auto") as eng:
        assert eng.stats()["decode_path"] == "transformers" and eng.weight_format == "float32"
        assert _max_gap(eng, reference, REQUESTS) <= 1e-4
        with pytest.raises(ValueError, match="lean decode path"):
            eng.set_weight_format("fp16-packed")
    with pytest.raises(ValueError, match="lean decode path"):
        CPUEngine(path, dtype="float32", weight_format="fp16-packed")


def test_float32_fuses_the_models_own_weights(tiny_model):
    """float32: q/k/v and gate/up become views of one buffer each; nothing is copied, and an update
    copied into the parameters is what the next decode step reads."""
    with CPUEngine(tiny_model, dtype="float32", max_batch_size=4) as eng:
        attn = eng.model.model.layers[0].self_attn
        q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        assert eng.stats()["packed_weight_bytes"] == 0
        before = eng.generate(PROMPTS[1], GREEDY, timeout=30)
        reference = _reference(tiny_model)
        new = random_weights(reference, seed=21)
        eng.update_weights(new, version="1")
        reference.load_state_dict(new, strict=False)
        after = eng.generate(PROMPTS[1], GREEDY, timeout=30)
        assert after.output_ids != before.output_ids
        torch.testing.assert_close(torch.tensor(after.output_logprobs),
                                   forward_logprobs(reference, PROMPTS[1], after.output_ids), atol=1e-4, rtol=0)


@packed_only
def test_packed_weights_follow_every_update(tiny_model, tmp_path):
    """fp16-packed: a full update and a one-layer bucket are repacked before the next step, counted and
    timed; the engine then decodes exactly as one loaded with those weights."""
    reference = _reference(tiny_model)
    new = random_weights(reference, seed=22)
    bucket = {n: t for n, t in random_weights(reference, seed=23).items() if n.startswith("model.layers.1.self_attn.")}
    with CPUEngine(tiny_model, dtype="float32", max_batch_size=4, weight_format="fp16-packed") as eng:
        stats = eng.stats()
        assert stats["packed_weight_bytes"] > 0 and stats["weight_load_pack_seconds"] > 0 and stats["weight_packs"] == 0
        before = eng.generate(PROMPTS[1], GREEDY, timeout=30)
        eng.update_weights(new, version="1")
        eng.update_weights(bucket, version="2")
        after = eng.generate(PROMPTS[1], GREEDY, timeout=30)
        stats = eng.stats()
        assert stats["weight_packs"] == 2 and stats["weight_pack_seconds"] > 0
    assert after.output_ids != before.output_ids
    reference.load_state_dict({**new, **bucket}, strict=False)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    for f in Path(tiny_model).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "vocab.json":
            shutil.copy(f, tmp_path / f.name)
    with CPUEngine(tmp_path, dtype="float32", max_batch_size=4, weight_format="fp16-packed") as loaded:
        expected = loaded.generate(PROMPTS[1], GREEDY, timeout=30)
    assert after.output_ids == expected.output_ids and after.output_logprobs == expected.output_logprobs


@packed_only
def test_packed_update_while_a_request_decodes(tiny_model):
    """Partial rollout: weights change while a request decodes through fp16-packed weights. Every token
    stamped with a version has the log-prob of that version's weights over the cache the request built so
    far (replayed step by step with transformers, switching weights at the same token), so no step ran
    on half-packed weights."""
    from transformers.cache_utils import DynamicCache

    reference = _reference(tiny_model)
    original = {k: v.clone() for k, v in reference.state_dict().items()}
    updates = {"1": random_weights(reference, seed=31), "2": random_weights(reference, seed=32)}
    with CPUEngine(tiny_model, dtype="float32", max_batch_size=4, weight_format="fp16-packed") as eng:
        h = eng.submit(PROMPTS[1], dict(GREEDY, max_new_tokens=1500), rid="spans-updates")
        for version, weights in [*updates.items(), (None, None)]:
            seen = len(h.output_ids)
            while len(h.output_ids) < seen + 5:
                threading.Event().wait(0.002)
            if weights is None:
                eng.abort("spans-updates")  # enough tokens after the second update: the rest adds nothing
            else:
                eng.update_weights(weights, version=version)
        res = h.result(120)
    versions = res.token_versions
    assert versions is not None and versions[0] == "0" and versions[-1] == "2" and "1" in versions
    weights = {"0": original, **updates}
    cache = DynamicCache()
    ids = torch.tensor([PROMPTS[1]])
    worst = 0.0
    with torch.no_grad():
        for i, (token, version) in enumerate(zip(res.output_ids, versions)):
            reference.load_state_dict(weights[version], strict=False)
            logits = reference(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            worst = max(worst, abs(float(torch.log_softmax(logits, -1)[token]) - res.output_logprobs[i]))
            ids = torch.tensor([[token]])
    assert worst <= 5e-2


def test_a_request_that_breaks_the_decode_forward_fails_alone(fresh_engine, monkeypatch):
    """Fault injection at the forward boundary (a stand-in for a request whose own state makes the batch
    forward raise): the batch is run again in parts, the request that breaks it fails alone with an
    engine error, and the others decode exactly as they do alone."""
    poison = 4242
    others = [(p, dict(GREEDY, max_new_tokens=15)) for p in PROMPTS]
    alone = [fresh_engine.generate(p, sp, timeout=30) for p, sp in others]
    real = fresh_engine._forward_rows

    def breaks_on_poison(rows, mask):
        if bool((fresh_engine._next_ids[rows] == poison).any()):
            raise RuntimeError("this row cannot run")
        return real(rows, mask)

    monkeypatch.setattr(fresh_engine, "_forward_rows", breaks_on_poison)
    # the poisoned request's first token (sampled at prefill) is the poison: its first decode step breaks
    bad = dict(GREEDY, max_new_tokens=15, logit_bias={str(poison): 1e4})
    handles = [fresh_engine.submit(p, sp) for p, sp in others[:2]]
    handles.append(fresh_engine.submit(PROMPTS[0], bad))
    handles += [fresh_engine.submit(p, sp) for p, sp in others[2:]]
    results = [h.result(60) for h in handles]
    broken = results.pop(2)
    assert broken.finish_reason["type"] == "abort" and broken.finish_reason["status_code"] == 500
    assert "decode forward pass failed" in broken.finish_reason["message"] and broken.output_ids == [poison]
    for a, b in zip(alone, results):
        assert b.output_ids == a.output_ids and b.finish_reason == a.finish_reason
        torch.testing.assert_close(torch.tensor(b.output_logprobs), torch.tensor(a.output_logprobs), atol=1e-4, rtol=0)
    stats = fresh_engine.stats()
    assert stats["decode_retries"] >= 1 and stats["request_errors"] == 1 and stats["last_error"] is None


@pytest.fixture(scope="module")
def smollm2():
    path = resolve_model_path("smollm2-135m-instruct")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is 2+3?", "Name a fruit that is red and explain why.", "Write a haiku about rivers.",
                         "List three prime numbers.")]
    return path, _reference(path), prompts


@pytest.mark.slow  # ~12 s, SmolLM2 in both formats; fast twin: test_each_family_decodes_as_transformers
def test_real_smollm2_log_probs_hold_to_transformers(smollm2):
    """The reference test on the real model, in each weight format: greedy and sampled requests decoded
    together, every output token's log-prob against one transformers forward in float32."""
    path, reference, prompts = smollm2
    params = [dict(GREEDY, max_new_tokens=20), {"temperature": 0.7, "max_new_tokens": 20, "sampling_seed": 1},
              dict(GREEDY, max_new_tokens=16),
              {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 20, "sampling_seed": 2}]
    formats = [("float32", 1e-4, 1e-5)] + ([("fp16-packed", 1e-2, 2e-3)] if fp16_packing_available() else [])
    with CPUEngine(path, dtype="float32", max_batch_size=8, weight_format="float32") as eng:
        for fmt, max_tol, mean_tol in formats:
            eng.set_weight_format(fmt)
            handles = [eng.submit(p, sp) for p, sp in zip(prompts, params)]
            gaps = []
            for prompt, h in zip(prompts, handles):
                res = h.result(120)
                expected = forward_logprobs(reference, prompt, res.output_ids)
                gaps.append((torch.tensor(res.output_logprobs) - expected).abs())
            gap = torch.cat(gaps)
            assert float(gap.max()) <= max_tol and float(gap.mean()) <= mean_tol, \
                (fmt, float(gap.max()), float(gap.mean()))


@packed_only
def test_set_weight_format_over_http(tiny_model):
    """POST /set_weight_format (the CPU engine's own route, the pipeline's float32 fallback): bad values
    get a 400 with a JSON body; a good one repacks between steps, is counted and logged as a control call."""
    import json
    import urllib.error
    import urllib.request

    from _engine_kit import ServerThread

    def post(server, body) -> tuple[int, dict]:
        req = urllib.request.Request(server.url + "/set_weight_format", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as err:
            return err.code, json.load(err)

    with CPUEngine(tiny_model, dtype="float32", max_batch_size=4, weight_format="fp16-packed") as eng:
        server = ServerThread(eng)
        try:
            packed = eng.generate(PROMPTS[1], GREEDY, timeout=30)
            for bad in ({}, {"weight_format": 3}, {"weight_format": "int4"}):
                code, body = post(server, bad)
                assert code == 400 and body["object"] == "error" and "weight_format" in body["message"]
            code, body = post(server, {"weight_format": "float32"})
            assert code == 200 and body["success"] and body["weight_format"] == "float32"
            assert body["previous_weight_format"] == "fp16-packed"
            stats = eng.stats()
            assert stats["weight_format"] == "float32" and stats["packed_weight_bytes"] == 0
            assert stats["weight_packs"] == 1
            dense = eng.generate(PROMPTS[1], GREEDY, timeout=30)
            torch.testing.assert_close(torch.tensor(dense.output_logprobs),
                                       forward_logprobs(_reference(tiny_model), PROMPTS[1], dense.output_ids),
                                       atol=1e-4, rtol=0)
            code, body = post(server, {"weight_format": "fp16-packed"})
            assert code == 200 and body["pack_seconds"] > 0
            again = eng.generate(PROMPTS[1], GREEDY, timeout=30)  # the prefix cache was emptied at each change
            assert again.output_ids == packed.output_ids and again.output_logprobs == packed.output_logprobs
            assert server.server.control_calls.count("set_weight_format") == 2
        finally:
            server.close()
