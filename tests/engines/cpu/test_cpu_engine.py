"""CPUEngine: log-prob fidelity, continuous batching, weight updates and request control."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from _engine_kit import forward_logprobs, model_with_weights, random_weights

from rayrl.engines.cpu.engine import CPUEngine
from rayrl.engines.cpu.sampling import SamplingParams
from rayrl.weights.wire import WeightUpdateError

GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
PROMPTS = [
    [1, 2, 3, 4, 5],
    list(range(100, 137)),
    [7],
    list(range(500, 512)),
    list(range(2000, 2090, 3)),
    [42, 43],
]


def wait_for_tokens(handle, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(handle.output_ids) < n:
        assert time.monotonic() < deadline, "engine produced no tokens"
        time.sleep(0.005)


def test_logprobs_match_a_forward_pass(engine, reference_model):
    """The returned log-probs are the raw model's, for greedy and for sampled tokens."""
    requests = [
        (PROMPTS[0], GREEDY),
        (PROMPTS[1], {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12, "sampling_seed": 3}),
        (PROMPTS[4], {"temperature": 1.3, "top_k": 20, "max_new_tokens": 8, "sampling_seed": 4}),
    ]
    handles = [engine.submit(p, sp) for p, sp in requests]  # batched together, left-padded
    for (prompt, _), h in zip(requests, handles):
        res = h.result(30)
        assert len(res.output_ids) == len(res.output_logprobs) > 0
        expected = forward_logprobs(reference_model, prompt, res.output_ids)
        torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=1e-4, rtol=0)
    greedy = handles[0].result()
    # greedy = argmax of the same distribution
    logits = reference_model(torch.tensor([PROMPTS[0]])).logits[0, -1]
    assert greedy.output_ids[0] == int(logits.argmax())


def test_greedy_matches_hf_generate(engine, reference_model):
    for prompt in PROMPTS[:3]:
        res = engine.generate(prompt, GREEDY, timeout=30)
        out = reference_model.generate(
            torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0
        )
        assert res.output_ids == out[0, len(prompt) :].tolist()


def test_continuous_batching_equals_running_alone(engine):
    """Requests joining and leaving a running batch at different times decode exactly as alone."""
    specs = []
    for i, prompt in enumerate(PROMPTS * 2):
        params = dict(GREEDY, max_new_tokens=4 + 3 * (i % 4))
        if i % 2:  # seeded sampling: noise is per request, so batching must not change it either
            params = dict(params, temperature=1.0, sampling_seed=100 + i)
        specs.append((prompt, params))
    alone = [engine.generate(p, sp, timeout=30) for p, sp in specs]
    handles = []
    for i, (p, sp) in enumerate(specs):  # staggered: later requests join a batch mid-flight
        handles.append(engine.submit(p, sp))
        if i % 3 == 2:
            wait_for_tokens(handles[-1], 1)
    together = [h.result(60) for h in handles]
    for a, b in zip(alone, together):
        assert a.output_ids == b.output_ids
        assert a.finish_reason == b.finish_reason == {"type": "length", "length": len(a.output_ids)}
        torch.testing.assert_close(
            torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=1e-4, rtol=0
        )
    assert engine.stats()["running"] == 0


def test_update_weights_from_disk_and_tensor(fresh_engine, tiny_model, tmp_path, reference_model):
    from transformers import AutoModelForCausalLM

    new_dir = model_with_weights(tiny_model, tmp_path / "v1", seed=2)
    fresh = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    before = fresh_engine.generate(PROMPTS[1], GREEDY, timeout=30)

    count = fresh_engine.load_weights_from_disk(new_dir, version="1")
    assert count > 0 and fresh_engine.weight_version == "1"
    after = fresh_engine.generate(PROMPTS[1], GREEDY, timeout=30)
    expected = fresh.generate(
        torch.tensor([PROMPTS[1]]), max_new_tokens=10, min_new_tokens=10, do_sample=False
    )
    assert after.output_ids == expected[0, len(PROMPTS[1]) :].tolist() != before.output_ids
    assert after.weight_version == "1" and after.token_versions is None
    torch.testing.assert_close(
        torch.tensor(after.output_logprobs),
        forward_logprobs(fresh, PROMPTS[1], after.output_ids),
        atol=1e-4,
        rtol=0,
    )

    # in-memory update back to the original weights (bf16 payload: cast on copy)
    original = {
        k: v.to(torch.bfloat16) for k, v in reference_model.state_dict().items() if k != "lm_head.weight"
    }
    fresh_engine.update_weights(original, version="2")
    again = fresh_engine.generate(PROMPTS[0], GREEDY, timeout=30)
    ref = dict(reference_model.state_dict())
    rounded = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ref.items()})
    expected = rounded.generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=10, min_new_tokens=10, do_sample=False
    )
    assert again.output_ids == expected[0, len(PROMPTS[0]) :].tolist()
    assert again.weight_version == "2"


def test_weight_validation_changes_nothing(fresh_engine, reference_model):
    before = fresh_engine.generate(PROMPTS[0], GREEDY, timeout=30).output_ids
    good = random_weights(reference_model, seed=9)
    with pytest.raises(WeightUpdateError, match="not parameters of the model"):
        fresh_engine.update_weights({**good, "model.bogus.weight": torch.zeros(3)}, version="x")
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(WeightUpdateError, match="shape mismatch"):
        fresh_engine.update_weights({**good, name: torch.zeros(2, 2)}, version="x")
    with pytest.raises(WeightUpdateError, match="no such checkpoint"):
        fresh_engine.load_weights_from_disk("/nonexistent/ckpt", version="x")
    assert fresh_engine.weight_version == "0"
    assert fresh_engine.generate(PROMPTS[0], GREEDY, timeout=30).output_ids == before


def test_versions_change_mid_generation(fresh_engine, reference_model):
    """Weights updated between steps: the request records which version produced each token."""
    h = fresh_engine.submit(PROMPTS[1], dict(GREEDY, max_new_tokens=200))
    wait_for_tokens(h, 3)
    fresh_engine.pause("in_place")
    n_before = len(h.output_ids)
    fresh_engine.update_weights(random_weights(reference_model, seed=5), version="7")
    fresh_engine.resume()
    res = h.result(60)
    assert res.finish_reason == {"type": "length", "length": 200}
    assert res.token_versions == ["0"] * n_before + ["7"] * (200 - n_before)
    assert res.weight_version == "7"


def test_abort_pause_and_resume(fresh_engine):
    long = dict(GREEDY, max_new_tokens=500)
    h = fresh_engine.submit(PROMPTS[0], long, rid="long-1")
    wait_for_tokens(h, 2)
    assert fresh_engine.abort("long-1") is True
    res = h.result(30)
    assert res.finish_reason["type"] == "abort" and 2 <= len(res.output_ids) < 500
    assert len(res.output_logprobs) == len(res.output_ids)
    assert fresh_engine.abort("long-1") is False  # finished: unknown now

    # in_place pause keeps requests; new ones wait; resume finishes both
    h1 = fresh_engine.submit(PROMPTS[2], dict(GREEDY, max_new_tokens=300))
    wait_for_tokens(h1, 1)
    fresh_engine.pause("in_place")
    frozen = len(h1.output_ids)
    h2 = fresh_engine.submit(PROMPTS[3], dict(GREEDY, max_new_tokens=5))
    time.sleep(0.2)
    assert len(h1.output_ids) == frozen and not h2.finished
    fresh_engine.resume()
    assert h1.result(30).finish_reason["type"] == "length"
    assert h2.result(30).finish_reason["type"] == "length"

    # abort-mode pause aborts running and waiting requests
    h3 = fresh_engine.submit(PROMPTS[0], long)
    wait_for_tokens(h3, 1)
    fresh_engine.pause("abort")
    assert h3.result(10).finish_reason["type"] == "abort"
    h4 = fresh_engine.submit(PROMPTS[0], dict(GREEDY, max_new_tokens=3))
    time.sleep(0.1)
    assert not h4.finished
    assert fresh_engine.abort_all() == 1
    assert h4.result(10).finish_reason["type"] == "abort" and h4.result().output_ids == []
    fresh_engine.resume()
    assert fresh_engine.generate(PROMPTS[0], dict(GREEDY, max_new_tokens=2), timeout=30).output_ids


def test_stop_conditions(engine):
    tok = engine.tokenizer
    free = engine.generate(PROMPTS[1], dict(GREEDY, max_new_tokens=12), timeout=30)
    # stop token id: the 5th generated token
    stop_id = free.output_ids[4]
    first = free.output_ids.index(stop_id)
    res = engine.generate(PROMPTS[1], dict(GREEDY, max_new_tokens=12, stop_token_ids=[stop_id]), timeout=30)
    assert res.output_ids == free.output_ids[: first + 1]
    assert res.finish_reason == {"type": "stop", "matched": stop_id}
    assert res.text == tok.decode(free.output_ids[:first])  # the stop token is trimmed from the text
    kept = engine.generate(
        PROMPTS[1], dict(GREEDY, max_new_tokens=12, stop_token_ids=[stop_id], no_stop_trim=True), timeout=30
    )
    assert kept.text == tok.decode(free.output_ids[: first + 1])

    # min_new_tokens blocks the stop token until enough tokens exist
    blocked = engine.generate(
        PROMPTS[1],
        dict(GREEDY, max_new_tokens=12, min_new_tokens=12, stop_token_ids=[free.output_ids[0]]),
        timeout=30,
    )
    assert len(blocked.output_ids) == 12 and free.output_ids[0] not in blocked.output_ids

    # stop string: a piece of the free-running text
    text = free.text
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    res = engine.generate(PROMPTS[1], dict(GREEDY, max_new_tokens=12, stop=[needle]), timeout=30)
    assert res.finish_reason == {"type": "stop", "matched": needle}
    assert res.text == text[: text.find(needle)]
    assert len(res.output_ids) < 12 or text.find(needle) >= len(tok.decode(free.output_ids[:-1]))

    # EOS stops unless ignore_eos; max_new_tokens=0 returns nothing
    eos = min(engine.eos_token_ids)
    assert eos in engine.eos_token_ids
    zero = engine.generate(PROMPTS[0], dict(GREEDY, max_new_tokens=0), timeout=30)
    assert zero.output_ids == [] and zero.finish_reason == {"type": "length", "length": 0}


def test_eos_token_stops(fresh_engine, reference_model):
    """Make the model's first greedy token the EOS token by biasing its logit."""
    eos = sorted(fresh_engine.eos_token_ids)[0]
    res = fresh_engine.generate(
        PROMPTS[0], {"temperature": 0, "max_new_tokens": 5, "logit_bias": {str(eos): 100.0}}, timeout=30
    )
    assert res.output_ids == [eos] and res.finish_reason == {"type": "stop", "matched": eos}
    ignored = fresh_engine.generate(
        PROMPTS[0],
        {"temperature": 0, "max_new_tokens": 5, "logit_bias": {str(eos): 100.0}, "ignore_eos": True},
        timeout=30,
    )
    assert ignored.output_ids == [eos] * 5
    # the returned log-prob is still the raw model's, not the biased one
    expected = forward_logprobs(reference_model, PROMPTS[0], [eos])
    assert abs(res.output_logprobs[0] - float(expected[0])) < 1e-4


def test_prompt_logprobs(engine, reference_model):
    prompt = PROMPTS[1]
    res = engine.generate(prompt, dict(GREEDY, max_new_tokens=2), logprob_start_len=0, timeout=30)
    lps = res.input_token_logprobs
    assert lps[0] is None and len(lps) == len(prompt)
    expected = forward_logprobs(reference_model, prompt[:1], prompt[1:])
    torch.testing.assert_close(torch.tensor(lps[1:]), expected, atol=1e-4, rtol=0)
    tail = engine.generate(prompt, dict(GREEDY, max_new_tokens=1), logprob_start_len=5, timeout=30)
    assert tail.input_token_logprobs == pytest.approx(lps[5:], abs=1e-4)


def test_seeded_sampling_is_reproducible_and_varies(engine):
    params = {"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 11, "ignore_eos": True}
    a = engine.generate(PROMPTS[0], params, timeout=30)
    b = engine.generate(PROMPTS[0], params, timeout=30)
    c = engine.generate(PROMPTS[0], dict(params, sampling_seed=12), timeout=30)
    assert a.output_ids == b.output_ids != c.output_ids


def test_sampling_filters_restrict_the_support():
    from rayrl.engines.cpu.sampling import BatchSampler, RowState

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    rows = [
        RowState(SamplingParams.from_dict({"top_k": 2}), [], 4),
        RowState(SamplingParams.from_dict({"top_p": 0.6}), [], 4),
        RowState(SamplingParams.from_dict({"min_p": 0.5}), [], 4),
    ]
    sampler = BatchSampler(rows)
    gen = torch.Generator().manual_seed(0)
    seen = [set() for _ in rows]
    for _ in range(300):
        tokens, lps, failed = sampler.sample(logits, (), gen)
        for i, t in enumerate(tokens.tolist()):
            seen[i].add(t)
        torch.testing.assert_close(lps, logits.gather(1, tokens.view(-1, 1)).view(-1))
        assert failed == {}
    assert seen == [{0, 1}, {0, 1}, {0, 1}]


def test_sampled_frequencies_follow_the_tempered_distribution():
    """Inverse-CDF sampling draws each token with its probability after temperature (and never a
    token of probability 0), for a batch of rows sharing one generator."""
    from rayrl.engines.cpu.sampling import BatchSampler, RowState

    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    logits = torch.log(probs).expand(4, -1).clone()
    sampler = BatchSampler([RowState(SamplingParams.from_dict({"temperature": t}), [], 6)
                            for t in (1.0, 1.0, 0.5, 2.0)])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(4, 6)
    for _ in range(5000):
        tokens, _, _ = sampler.sample(logits, (), gen)
        counts[torch.arange(4), tokens] += 1
    freq = counts / counts.sum(1, keepdim=True)
    for row, t in enumerate((1.0, 1.0, 0.5, 2.0)):
        expected = torch.softmax(torch.log(probs) / t, -1)
        torch.testing.assert_close(freq[row], expected, atol=0.02, rtol=0)
    assert counts[:, [1, 5]].sum() == 0


@pytest.mark.parametrize(
    "params, message",
    [
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"regex": "a+"}, "not supported"),
        ({"frobnicate": 1}, "unknown"),
        ({"min_new_tokens": 5, "max_new_tokens": 2}, "min_new_tokens"),
    ],
)
def test_bad_sampling_params(engine, params, message):
    with pytest.raises(ValueError, match=message):
        engine.submit([1, 2], params)


def test_bad_prompts(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], {})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([1, engine.vocab_size], {})
    with pytest.raises(ValueError, match="integers"):
        engine.submit(["a"], {})
    with pytest.raises(ValueError, match="context length"):
        engine.submit([1] * engine.context_length, {})
    with pytest.raises(ValueError, match="context length"):
        engine.submit([1] * 10, {"max_new_tokens": engine.context_length})
    h = engine.submit([1, 2], {"max_new_tokens": 50}, rid="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.submit([1, 2], {}, rid="dup")
    engine.abort("dup")
    h.result(10)


def test_thread_safety_of_submissions(engine):
    """Many threads submitting at once all get complete results."""
    results = []

    def worker(i: int) -> None:
        results.append(engine.generate(PROMPTS[i % len(PROMPTS)], dict(GREEDY, max_new_tokens=3), timeout=60))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 12 and all(len(r.output_ids) == 3 for r in results)


def test_memory_occupation_and_stats(engine):
    engine.release_memory_occupation(["weights"])
    assert engine.stats()["released_memory"] == ["weights"]
    engine.resume_memory_occupation(None)
    assert engine.stats()["released_memory"] == []
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.release_memory_occupation(["gpu"])
    assert engine.flush_cache() is True
    stats = engine.stats()
    assert stats["tokens_generated"] > 0 and stats["running"] == 0 and stats["waiting"] == 0


def test_bfloat16_engine_runs(tiny_model):
    with CPUEngine(tiny_model, dtype="bfloat16", max_batch_size=4) as eng:
        handles = [eng.submit(p, dict(GREEDY, max_new_tokens=4)) for p in PROMPTS[:4]]
        for h in handles:
            res = h.result(30)
            assert len(res.output_ids) == 4 and all(lp <= 0 for lp in res.output_logprobs)


def test_context_length_defaults_to_the_models_maximum(tiny_model):
    """No context_length: the model's own maximum (agent CLIs send 7-20K-token first prompts); a larger
    one is capped to it."""
    from transformers import AutoConfig

    maximum = AutoConfig.from_pretrained(tiny_model).max_position_embeddings
    for asked in (None, maximum * 4):
        eng = CPUEngine(tiny_model, dtype="float32", max_batch_size=1, context_length=asked)
        assert eng.context_length == maximum


def test_a_process_that_exits_with_its_engine_still_decoding_exits_cleanly(tiny_model):
    """The owner never calls shutdown and leaves requests running: the engine is stopped at exit, so the
    process ends with its own status, not with SIGABRT from a loop thread unwound inside a torch op."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from rayrl.engines.cpu.engine import CPUEngine\n"
        "engine = CPUEngine(sys.argv[1], dtype='float32', max_batch_size=8, num_threads=1).start()\n"
        "params = {'temperature': 0.0, 'max_new_tokens': 3000, 'ignore_eos': True}\n"
        "running = [engine.submit(list(range(10 + i, 60 + i)), params) for i in range(4)]\n"
        "engine.generate([5, 6, 7], {'temperature': 0.0, 'max_new_tokens': 2, 'ignore_eos': True})\n"
        "print('leaving with', sum(not h.finished for h in running), 'running', flush=True)\n"
    )
    for _ in range(2):  # without the stop at exit, each run aborted
        out = subprocess.run([sys.executable, "-c", script, str(tiny_model)], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "leaving with 4 running" in out.stdout
