"""Prefix cache: reused KV gives the same tokens and log-probs as a full prefill, multi-turn and
group requests hit it, and weight updates and /flush_cache empty it."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from _engine_kit import forward_logprobs

from rayrl.engines.cpu.engine import CPUEngine
from rayrl.engines.cpu.prefix_cache import MIN_REUSE_TOKENS, PrefixCache

SYSTEM = list(range(300, 360))  # a shared "system prompt" of 60 tokens
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def _kv(n: int, layers: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.zeros(1, 2, n, 4) for _ in range(layers)], [torch.zeros(1, 2, n, 4) for _ in range(layers)]


def test_store_matches_longest_prefix_and_evicts_by_bytes():
    per_token = 2 * 2 * 2 * 4 * 4  # keys + values, 2 layers, 2 heads, dim 4, float32
    cache = PrefixCache(budget_bytes=100 * per_token)
    a = list(range(40))
    b = list(range(30)) + [999] * 10
    assert cache.insert(a, *_kv(40)) and cache.insert(b, *_kv(40))
    n, entry = cache.match(list(range(35)) + [5])
    assert n == 35 and entry.tokens.tolist() == a
    n, entry = cache.match(a)  # a full match still leaves the last token to run
    assert n == 39
    assert cache.match([7] * 50) == (0, None)
    assert cache.match(list(range(MIN_REUSE_TOKENS - 1)) + [777]) == (0, None)  # too short to reuse
    assert cache.covers(a[:20]) and not cache.covers(a + [1])
    assert not cache.insert(a[:25], *_kv(25))  # already held by a longer entry
    assert cache.insert(a + [1, 2], *_kv(42)) and len(cache) == 2  # a is subsumed by its extension
    assert cache.insert(list(range(1000, 1030)), *_kv(30))  # over budget: the least recently used (b) goes
    assert cache.bytes <= cache.budget_bytes and cache.evicted == 1 and len(cache) == 2
    assert cache.match(b)[0] == 30  # only the prefix it shares with a's extension is left
    assert cache.match(a)[0] == 39
    assert cache.clear() == 2 and len(cache) == 0 and cache.bytes == 0


def test_disabled_store_keeps_nothing():
    cache = PrefixCache(0)
    assert not cache.insert(list(range(40)), *_kv(40)) and cache.match(list(range(40))) == (0, None)


@pytest.fixture
def cached_engine(tiny_model):
    eng = CPUEngine(tiny_model, dtype="float32", max_batch_size=8, prefix_cache_mb=64).start()
    yield eng
    eng.shutdown()


def test_next_turn_reuses_the_conversation_with_identical_numbers(cached_engine, reference_model):
    first = cached_engine.generate(SYSTEM + [11, 12, 13], GREEDY, timeout=30)
    assert first.cached_tokens == 0
    turn2 = SYSTEM + [11, 12, 13] + first.output_ids + [21, 22, 23, 24]
    res = cached_engine.generate(turn2, GREEDY, timeout=30)
    # everything but the last output token (never fed to the model) came from the cache
    assert res.cached_tokens == len(SYSTEM) + 3 + len(first.output_ids) - 1
    expected = forward_logprobs(reference_model, turn2, res.output_ids)
    torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=1e-4, rtol=0)
    greedy = reference_model.generate(torch.tensor([turn2]), max_new_tokens=8, min_new_tokens=8,
                                      do_sample=False, pad_token_id=0)[0, len(turn2):].tolist()
    assert res.output_ids == greedy


def test_group_arriving_together_prefills_its_prompt_once(cached_engine, reference_model):
    prompt = SYSTEM + list(range(700, 720))
    handles = [cached_engine.submit(prompt, {**GREEDY, "temperature": 0.8, "sampling_seed": i}) for i in range(4)]
    results = [h.result(30) for h in handles]
    assert sorted(r.cached_tokens for r in results) == [0] + [len(prompt) - 1] * 3
    for r in results:
        expected = forward_logprobs(reference_model, prompt, r.output_ids)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), expected, atol=1e-4, rtol=0)
    other_task = SYSTEM + list(range(900, 910))  # a different question after the same system prompt
    assert cached_engine.generate(other_task, GREEDY, timeout=30).cached_tokens == len(SYSTEM)
    stats = cached_engine.stats()
    assert stats["prefix_cache_hits"] >= 4 and 0 < stats["prefix_cache_bytes"] <= stats["prefix_cache_budget_bytes"]


def test_hits_admitted_together_prefill_in_one_batch_with_identical_numbers(cached_engine, reference_model):
    """Next turns of several conversations (different cached lengths, different new parts) and a new
    question after the cached system prompt, admitted in one iteration: they prefill as batches on
    top of their cached prefixes, and each gives what a plain forward pass gives."""
    firsts = {}
    for name, question in {"a": [11, 12, 13], "b": list(range(20, 41)), "c": [50]}.items():
        firsts[name] = SYSTEM + question + cached_engine.generate(SYSTEM + question, GREEDY, timeout=30).output_ids
    prompts = [firsts["a"] + [61, 62, 63, 64], firsts["b"] + [65, 66], firsts["c"] + [67, 68, 69, 70, 71],
               SYSTEM + [72, 73, 74, 75]]
    cached_engine.pause("in_place")
    handles = [cached_engine.submit(p, GREEDY) for p in prompts]
    cached_engine.resume()
    results = [h.result(30) for h in handles]
    for prompt, res in zip(prompts, results):
        assert len(SYSTEM) - 2 <= res.cached_tokens < len(prompt)
        expected = forward_logprobs(reference_model, prompt, res.output_ids)
        torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=1e-4, rtol=0)
        greedy = reference_model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert res.output_ids == greedy
    # new parts (uncached rests) are b 3, d 4, a 5, c 6 tokens: b, d and a run as one batch of 5 new
    # columns (b recomputes 2 cached tokens, d 1), c on its own (6 against 5 would waste too much)
    assert [r.cached_tokens for r in results] == [len(prompts[0]) - 5, len(prompts[1]) - 5, len(prompts[2]) - 6,
                                                  len(prompts[3]) - 5]


def test_weight_update_and_flush_empty_the_cache(cached_engine, reference_model):
    prompt = SYSTEM + [5, 6, 7]
    cached_engine.generate(prompt, GREEDY, timeout=30)
    assert cached_engine.generate(prompt, GREEDY, timeout=30).cached_tokens == len(prompt) - 1
    cached_engine.flush_cache()
    assert cached_engine.stats()["prefix_cache_entries"] == 0
    assert cached_engine.generate(prompt, GREEDY, timeout=30).cached_tokens == 0

    # new weights: KV computed by the old ones must not be reused
    state = {k: v.clone() for k, v in reference_model.state_dict().items()}
    state["model.norm.weight"] = state["model.norm.weight"] * 1.5
    cached_engine.update_weights(state, version="1")
    res = cached_engine.generate(prompt, GREEDY, timeout=30)
    assert res.cached_tokens == 0 and res.weight_version == "1"
    cached_engine.release_memory_occupation(["kv_cache"])
    assert cached_engine.stats()["prefix_cache_entries"] == 0
    cached_engine.resume_memory_occupation(["kv_cache"])


def test_a_request_spanning_a_weight_update_is_not_cached(cached_engine, reference_model):
    prompt = SYSTEM + [1, 2]
    handle = cached_engine.submit(prompt, {**GREEDY, "max_new_tokens": 200})
    deadline = time.monotonic() + 30
    while len(handle.output_ids) < 3:
        assert time.monotonic() < deadline, "engine produced no tokens"
        time.sleep(0.005)
    cached_engine.update_weights(dict(reference_model.state_dict()), version="2")
    res = handle.result(60)
    assert res.token_versions is not None and res.token_versions[-1] == "2"
    follow = prompt + res.output_ids + [3]
    assert cached_engine.generate(follow, GREEDY, timeout=30).cached_tokens == 0


def test_server_reports_cached_tokens(server):
    import aiohttp

    async def generate(body):
        async with aiohttp.ClientSession() as session, session.post(f"{server.url}/generate", json=body) as r:
            assert r.status == 200
            return await r.json()

    prompt = SYSTEM + [40, 41]
    body = {"input_ids": prompt, "sampling_params": GREEDY}
    first = server.run(generate(body))
    second = server.run(generate(body))
    assert first["meta_info"]["cached_tokens"] in (0, len(prompt) - 1)  # the module's server may hold it
    assert second["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert np.array_equal(first["output_ids"], second["output_ids"])
