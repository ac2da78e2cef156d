"""A request that fails, fails alone: one request's parameters, tokens or logits never abort or alter
the other requests decoded in the same batch.

Two layers. Values the engine cannot hold are refused at submission (ValueError; a 400 naming the field
over HTTP, as SGLang answers): a seed beyond what a torch.Generator takes (2^64 used to abort the whole
running batch), float32-overflowing temperatures or biases, too many stop strings. Values that pass but
still break a row inside the batch (a repetition penalty so small that the row's logits overflow to
infinity, a bias that leaves a tempered distribution without finite mass) fail that request alone, with
SGLang's abort finish reason carrying ``status_code``; a greedy request decoded beside a stream of them
produces exactly the tokens it produces alone.
"""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch
from _engine_kit import ServerThread

from rayrl.engines.cpu.requests import engine_error
from rayrl.engines.cpu.sampling import SEED_MAX, SEED_MIN, BatchSampler, RowState, SamplingParams

PROMPT = [1, 17, 230, 4005, 812, 77, 3001, 9]
GREEDY = {"max_new_tokens": 40, "temperature": 0.0, "ignore_eos": True}
# pass validation, then break their own row inside the batch
ROW_BREAKERS = [
    {"max_new_tokens": 30, "temperature": 0.0, "repetition_penalty": 1e-40, "ignore_eos": True},
    {"max_new_tokens": 30, "temperature": 1e-5, "logit_bias": {"5": 3.0e38}, "ignore_eos": True},
    {"max_new_tokens": 30, "temperature": 0.7, "repetition_penalty": 1e-40, "ignore_eos": True},
]
# built in-process, past the parser's checks (SamplingParams objects are trusted): before isolation, a
# seed of 2^64 raised while the request joined and aborted the whole running batch
UNCHECKED = [SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=2**64),
             SamplingParams(max_new_tokens=8, temperature=1.0, top_k=2**70)]
# extremes the engine holds: these decode normally
EXTREMES = [
    {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": SEED_MAX},
    {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": SEED_MIN, "top_k": 2**70},
    {"max_new_tokens": 12, "temperature": 3.0e38, "min_p": 1.0, "logit_bias": {"3": -3.0e38}},
    {"max_new_tokens": 12, "temperature": 2.0, "top_p": 1e-9, "presence_penalty": 2.0, "frequency_penalty": -2.0},
]


@pytest.mark.parametrize("params, field", [
    ({"sampling_seed": 2**64}, "sampling_seed"),
    ({"sampling_seed": SEED_MIN - 1}, "sampling_seed"),
    ({"temperature": 1e39}, "temperature"),
    ({"logit_bias": {"5": 1e39}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": ["x" * 1025]}, "stop"),
    ({"top_k": -2}, "top_k"),
])
def test_values_the_engine_cannot_hold_are_refused_naming_the_field(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.submit(PROMPT, {"max_new_tokens": 2, **params})


def test_sampler_fails_broken_rows_alone():
    """Rows whose logits are NaN, +inf or all -inf are reported; every other row gets the token it gets
    sampled alone, greedy or seeded."""
    gen_logits = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 50, generator=gen_logits)
    logits[1, 7] = float("nan")
    logits[3, 2] = float("inf")
    logits[4] = float("-inf")
    params = [{"temperature": 0.0}, {"temperature": 0.0}, {"temperature": 1.0, "sampling_seed": 11},
              {"temperature": 0.5}, {"temperature": 0.0}, {"temperature": 0.9, "sampling_seed": 12, "top_k": 5}]
    rows = [RowState(SamplingParams.from_dict(p), [], 50) for p in params]
    tokens, logprobs, failed = BatchSampler(rows).sample(logits, (), torch.Generator().manual_seed(0))
    assert sorted(failed) == [1, 3, 4] and all("not finite" in m for m in failed.values())
    for i in (0, 2, 5):  # each healthy row, sampled alone with a fresh copy of its state
        alone_row = RowState(SamplingParams.from_dict(params[i]), [], 50)
        alone, alone_lp, none = BatchSampler([alone_row]).sample(logits[i : i + 1], (), torch.Generator())
        assert none == {} and tokens[i] == alone[0]
        assert logprobs[i] == pytest.approx(float(alone_lp[0]))
    assert all(tokens[i] == 0 for i in failed)  # a valid placeholder id: the batch goes on


def test_a_greedy_request_beside_row_breakers_decodes_as_alone(engine):
    alone = engine.generate(PROMPT, GREEDY, timeout=60)
    errors_before = engine.stats()["request_errors"]
    stop = threading.Event()
    failures: list[dict] = []
    finished: list[dict] = []

    def hostile_stream() -> None:
        while not stop.is_set():
            hostile = ROW_BREAKERS + UNCHECKED + EXTREMES
            handles = [engine.submit(PROMPT[: 3 + i % 5], p) for i, p in enumerate(hostile)]
            for h, p in zip(handles, hostile):
                res = h.result(60)
                (failures if res.finish_reason["type"] == "abort" else finished).append(res.finish_reason)
                # the bias that leaves no finite mass and the unchecked values always fail; extremes never do
                assert res.finish_reason["type"] == "abort" or (p is not ROW_BREAKERS[1] and p not in UNCHECKED)
                assert res.finish_reason["type"] != "abort" or p not in EXTREMES, (p, res.finish_reason)

    thread = threading.Thread(target=hostile_stream)
    thread.start()
    try:
        together = [engine.submit(PROMPT, GREEDY) for _ in range(3)]
        results = [h.result(120) for h in together]
    finally:
        stop.set()
        thread.join(120)
    for res in results:
        assert res.output_ids == alone.output_ids and res.finish_reason == alone.finish_reason
        torch.testing.assert_close(torch.tensor(res.output_logprobs), torch.tensor(alone.output_logprobs),
                                   atol=1e-4, rtol=0)
    assert failures and all(f["type"] == "abort" and f["status_code"] == 500 and f["err_type"] == "InternalServerError"
                            and "engine error" in f["message"] for f in failures)
    stats = engine.stats()
    assert stats["request_errors"] - errors_before == len(failures)  # each counted once
    assert stats["last_error"] is None and engine.alive() and stats["running"] == 0


def _post(server: ServerThread, body: dict) -> tuple[int, object]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


@pytest.mark.parametrize("sampling, field", [
    ({"sampling_seed": 2**64}, "sampling_seed"),
    ({"logit_bias": {"1": 1e39}}, "logit_bias"),
    ({"temperature": 1e300}, "temperature"),
    ({"stop": ["s"] * 100}, "stop"),
])
def test_engine_server_answers_400_for_values_out_of_range(server, sampling, field):
    code, body = _post(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, **sampling}})
    assert code == 400 and field in body["message"] and body["object"] == "error"


def test_one_failing_item_of_a_generate_batch_fails_alone(server):
    """A /generate batch with a greedy item and a row breaker: 200, the breaker's finish reason says the
    engine failed it (status_code), the greedy item equals the same prompt sent alone."""
    code, alone = _post(server, {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert code == 200
    code, both = _post(server, {"input_ids": [PROMPT, PROMPT[:4]], "sampling_params": [GREEDY, ROW_BREAKERS[1]],
                                "return_logprob": True})
    assert code == 200
    assert both[0]["output_ids"] == alone["output_ids"]
    assert both[1]["meta_info"]["finish_reason"]["status_code"] == 500
    assert math.isfinite(both[0]["meta_info"]["output_token_logprobs"][0][0])


def test_engine_error_shape_is_sglangs_abort_with_a_status():
    assert engine_error("engine error: x") == {"type": "abort", "message": "engine error: x", "status_code": 500,
                                               "err_type": "InternalServerError"}
    assert engine_error("shutting down", 503)["err_type"] == "ServiceUnavailable"
