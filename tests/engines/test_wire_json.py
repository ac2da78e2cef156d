"""The engine wire's JSON (rayrl/engines/wire_json.py): orjson, with the standard library taking what
orjson refuses, so every request and chunk that encoded or decoded before still does, to the same values."""

from __future__ import annotations

import json
import math

import numpy as np

from rayrl.engines import wire_json


def test_a_request_encodes_as_the_standard_library_reads_it():
    ids = np.arange(40_000, dtype=np.int32)
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": np.int64(16), "temperature": 0.7,
                                                     "logit_bias": {5: -1.0}, "stop": ["é\n", "</tool_call>"]},
               "rid": "r", "return_logprob": True, "stream": True}
    back = json.loads(wire_json.dumps(payload))
    assert back["input_ids"] == ids.tolist()
    assert back["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.7, "logit_bias": {"5": -1.0},
                                       "stop": ["é\n", "</tool_call>"]}


def test_what_orjson_refuses_goes_through_the_standard_library():
    lone = {"stop": ["\ud800"]}  # a lone surrogate: orjson will not encode it, json escapes it
    assert json.loads(wire_json.dumps(lone)) == lone
    chunk = b'{"meta_info": {"output_token_logprobs": [[-Infinity, 5, null], [NaN, 6, null]]}}'
    entries = wire_json.loads(chunk)["meta_info"]["output_token_logprobs"]
    assert entries[0][0] == -math.inf and math.isnan(entries[1][0])
    assert wire_json.loads(b'{"text": "ok", "output_ids": [1, 2]}') == {"text": "ok", "output_ids": [1, 2]}
