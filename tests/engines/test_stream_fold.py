"""rayrl/engines/stream_fold.py: a stream's chunks parsed only as far as the answer needs them.

Every stream shape is checked against the fold the router did before (each chunk parsed as it came until
two chunks with tokens told the stream's kind, then only the last one of a cumulative stream), over
cumulative and incremental streams, with and without the engine's token count, read one chunk at a time
or several to a read, ended, broken part-way, or carrying an in-stream error. And what the fold saves:
a cumulative stream is parsed once, and what it holds unparsed stays under its bound.
"""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from rayrl.engines import stream_fold, wire_json
from rayrl.engines.client import EngineError
from rayrl.engines.outputs import StreamAccumulator
from rayrl.engines.stream_fold import StreamFold

URL = "http://engine"


def _chunks(n: int, cumulative: bool, counts: bool = True, finish: bool = True, seed: int = 0) -> list[bytes]:
    """An SGLang-like stream of ``n`` tokens, one chunk per token."""
    rng = random.Random(seed)
    ids = [rng.randrange(50000) for _ in range(n)]
    lps = [-rng.random() for _ in range(n)]
    text = "".join(chr(97 + i % 26) for i in range(n))
    out = []
    for k in range(1, n + 1):
        lo = 0 if cumulative else k - 1
        meta = {"id": "r", "prompt_tokens": 5, "weight_version": "3",
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps[lo:k], ids[lo:k])],
                "finish_reason": {"type": "stop"} if finish and k == n else None}
        if counts:
            meta["completion_tokens"] = k
        out.append(json.dumps({"text": text[:k], "output_ids": ids[lo:k], "meta_info": meta}).encode())
    return out


def _before(events: list[bytes]) -> StreamAccumulator:
    """The router's fold before stream_fold, for a caller that does not stream."""
    acc = StreamAccumulator()
    held = None

    def fold(data: bytes) -> None:
        chunk = wire_json.loads(data)
        if isinstance(chunk, dict) and "error" in chunk:
            raise EngineError(500, str(chunk["error"].get("message")), URL)
        acc.add(chunk)

    for data in events:
        if acc.cumulative:
            held = data
            continue
        fold(data)
    if held is not None:
        fold(held)
    return acc


def _feed(fold: StreamFold, events: list[bytes], per_read: int) -> None:
    for i in range(0, len(events), per_read):
        assert not fold.feed(events[i:i + per_read])


def _same(a: StreamAccumulator, b: StreamAccumulator) -> None:
    oa, ob = a.output(URL), b.output(URL)
    assert oa.output_ids.tolist() == ob.output_ids.tolist() and oa.text == ob.text
    assert np.array_equal(oa.output_logprobs, ob.output_logprobs) and oa.meta_info == ob.meta_info


@pytest.mark.parametrize("cumulative", [True, False])
@pytest.mark.parametrize("counts", [True, False])
@pytest.mark.parametrize("per_read", [1, 3, 100])
@pytest.mark.parametrize("n", [1, 2, 9, 40])
def test_every_stream_folds_as_before(cumulative, counts, per_read, n):
    events = _chunks(n, cumulative, counts)
    fold = StreamFold(URL, hold_bytes=2048)
    _feed(fold, events, per_read)
    assert fold.feed([b"[DONE]", b"ignored"]) is True
    fold.settle()
    assert fold.finished
    _same(fold.acc, _before(events))
    if cumulative:
        assert fold.acc.ids == json.loads(events[-1])["output_ids"]


def test_a_cumulative_stream_is_parsed_once(monkeypatch):
    parsed = []
    monkeypatch.setattr(wire_json, "loads", lambda data: parsed.append(data) or json.loads(data))
    events = _chunks(12, cumulative=True)
    fold = StreamFold(URL)
    _feed(fold, events, 1)
    assert parsed == []  # nothing read while the stream runs
    fold.settle()
    assert parsed == [events[-1]] and fold.finished
    _same(fold.acc, _before(events))


def test_what_is_held_stays_under_its_bound(monkeypatch):
    """A long cumulative stream (its bytes grow as the square of its length) holds at most the bound plus
    one chunk unparsed: past the bound the held chunks are folded, which tells the stream's kind, and from
    then on only the latest chunk is kept. Three chunks are parsed in all, not one per chunk."""
    parsed = []
    real = wire_json.loads
    monkeypatch.setattr(wire_json, "loads", lambda data: parsed.append(data) or real(data))
    events = _chunks(400, cumulative=True)
    bound = 20000
    fold = StreamFold(URL, hold_bytes=bound)
    most = 0
    for data in events:
        fold.feed([data])
        held = sum(map(len, fold._pending)) + len(fold._held or b"")
        assert fold._pending_bytes == sum(map(len, fold._pending))
        most = max(most, held)
    assert most <= bound + len(events[-1])
    assert fold.acc.cumulative is True and fold._pending == []
    fold.settle()
    assert len(parsed) == 3  # the first two (the kind), then the last
    _same(fold.acc, _before(events))


def test_an_incremental_stream_past_the_bound_folds_each_chunk_as_it_comes():
    events = _chunks(300, cumulative=False)
    fold = StreamFold(URL, hold_bytes=4096)
    _feed(fold, events, 1)
    assert fold.acc.cumulative is False and fold._pending == [] and fold._held is None
    fold.settle()
    _same(fold.acc, _before(events))


@pytest.mark.parametrize("cumulative", [True, False])
def test_a_broken_stream_keeps_the_tokens_received(cumulative):
    """Where the connection breaks the router settles what arrived and continues from those tokens."""
    events = _chunks(10, cumulative)[:6]
    fold = StreamFold(URL)
    _feed(fold, events, 2)
    fold.settle()
    assert not fold.finished
    part = fold.acc.partial(URL)
    assert len(part.output_ids) == 6 and len(part.output_logprobs) == 6
    assert part.finish_reason["type"] == "abort"
    before = _before(events)
    assert part.output_ids.tolist() == before.ids and part.text == before.text


ERROR = b'{"error": {"message": "CUDA out of memory"}}'


@pytest.mark.parametrize("cumulative", [True, False])
@pytest.mark.parametrize("at", [0, 1])
def test_an_error_chunk_before_the_kind_is_known_raises_as_before(cumulative, at):
    """Where the fold before raised (an error chunk among the chunks that tell the stream's kind), this one
    raises too, even when answer chunks follow it and the last of them holds the whole answer."""
    events = _chunks(6, cumulative)
    for stream in (events[:at] + [ERROR], events[:at] + [ERROR] + events[at:]):
        fold = StreamFold(URL)
        _feed(fold, stream, 1)
        with pytest.raises(EngineError, match="CUDA out of memory") as err:
            fold.settle()
        assert err.value.status == 500
        with pytest.raises(EngineError, match="CUDA out of memory"):
            _before(stream)


def test_an_error_chunk_once_the_stream_is_known_incremental_raises_when_it_arrives():
    events = _chunks(300, cumulative=False)
    fold = StreamFold(URL, hold_bytes=4096)
    _feed(fold, events[:200], 1)
    assert fold.acc.cumulative is False
    with pytest.raises(EngineError, match="CUDA out of memory"):
        fold.feed([ERROR])


def test_an_error_chunk_in_a_cumulative_stream_counts_where_it_did():
    """Once the stream is known to be cumulative only its last chunk is read, as before: an error chunk
    last is raised at the end, one followed by answer chunks is not read."""
    events = _chunks(6, cumulative=True)
    fold = StreamFold(URL)
    fold.feed(events[:3] + [ERROR])
    with pytest.raises(EngineError, match="CUDA out of memory"):
        fold.settle()
    with pytest.raises(EngineError):
        _before(events[:3] + [ERROR])
    fold = StreamFold(URL)
    fold.feed(events[:3] + [ERROR] + events[3:])
    fold.settle()
    _same(fold.acc, _before(events[:3] + [ERROR] + events[3:]))


def test_the_word_error_in_the_text_is_not_an_error():
    chunk = json.loads(_chunks(1, cumulative=True)[0])
    chunk["text"] = 'the "error" key'
    fold = StreamFold(URL)
    fold.feed([json.dumps(chunk).encode()])
    fold.settle()
    assert fold.acc.text == 'the "error" key' and fold.finished


def test_a_last_chunk_that_does_not_hold_the_whole_answer_folds_them_all_in_order():
    """No text, no log-prob for every token, or no count of its own: the last chunk cannot stand alone;
    every chunk is folded in order, as before."""
    base = _chunks(5, cumulative=True)
    last = json.loads(base[-1])
    variants = []
    variants.append({**last, "text": ""})
    variants.append({**last, "meta_info": {**last["meta_info"], "output_token_logprobs": []}})
    variants.append({**last, "meta_info": {k: v for k, v in last["meta_info"].items() if k != "completion_tokens"}})
    for v in variants:
        events = base[:-1] + [json.dumps(v).encode()]
        fold = StreamFold(URL)
        _feed(fold, events, 1)
        fold.settle()
        before = _before(events)
        assert fold.acc.ids == before.ids and fold.acc.text == before.text and fold.acc.meta == before.meta
        assert len(fold.acc.logprobs) == len(before.logprobs)
        assert all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in zip(fold.acc.logprobs, before.logprobs))


def test_a_chunk_that_is_not_json_is_reported_unless_the_last_chunk_makes_it_unnecessary():
    events = _chunks(5, cumulative=True)
    fold = StreamFold(URL)
    _feed(fold, [b"{not json"] + events, 1)
    fold.settle()  # the last chunk holds the whole answer: the others are never read
    _same(fold.acc, _before(events))
    fold = StreamFold(URL)
    _feed(fold, events + [b"{not json"], 1)
    with pytest.raises(ValueError):
        fold.settle()


def test_the_streaming_callers_fold_parses_every_chunk():
    events = _chunks(7, cumulative=True)
    fold = StreamFold(URL)
    seen = []
    for data in events:
        fold.fold(data)
        seen.append(len(fold.acc.ids))
    assert seen == list(range(1, 8)) and fold.finished
    assert stream_fold.HOLD_BYTES >= 4096
