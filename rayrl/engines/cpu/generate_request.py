"""What the engine server's ``/generate`` accepts: SGLang's GenerateReqInput, parsed and validated.

A body becomes a :class:`GenerateBatch` of items (prompts, expanded by ``sampling_params.n`` the way
SGLang expands them) or a RequestError naming the field, before anything reaches the engine: fields SGLang
does not know are refused, fields the CPU engine cannot honour are refused, values outside what the engine
can hold are refused (sampling.SamplingParams), and one request's size is bounded. Nothing that passes
here can make the batch it joins fail for the other requests in it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from rayrl.engines.cpu.engine import CPUEngine
from rayrl.engines.cpu.sampling import SamplingParams, is_int
from rayrl.engines.http_input import RequestError, bool_flag, per_item

# Fields of SGLang's GenerateReqInput we accept. Those in UNSUPPORTED must be absent/empty/false.
GENERATE_FIELDS = {
    "text",
    "input_ids",
    "input_embeds",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "return_text_in_logprobs",
    "stream",
    "log_metrics",
    "return_hidden_states",
    "modalities",
    "session_params",
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "data_parallel_rank",
    "priority",
    "extra_key",
    "cache_salt",
    "return_routed_experts",
    "routed_dp_rank",
    "no_logs",
    "background",
    "conversation_id",
    "label",
    "image_data",
    "video_data",
    "audio_data",
    "stream_output",
    "return_bytes",
    "require_reasoning",
    "dp_balance_id",
    "rid_prefix",
    "external_trace_header",
    "received_time",
    "is_single",
    "batch_size",
}
UNSUPPORTED = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "lora_id",
    "session_params",
    "custom_logit_processor",
    "return_hidden_states",
    "token_ids_logprob",
    "return_routed_experts",
)
MAX_BATCH_ITEMS = 4096  # bounds the work one request can queue (prompts x sampling_params.n)



@dataclass
class GenerateItem:
    """One sequence to generate: its prompt ids, sampling parameters, request id and log-prob options."""

    input_ids: list[int]
    params: SamplingParams
    rid: str
    return_logprob: bool
    logprob_start_len: int


@dataclass
class GenerateBatch:
    """A parsed /generate request: its items, whether it was a single prompt, streamed, text in log-probs."""

    items: list[GenerateItem]
    single: bool
    stream: bool
    text_in_logprobs: bool


def parse_generate(body: dict[str, Any], engine: CPUEngine) -> GenerateBatch:
    """A /generate body as the items to submit; RequestError (a 400) for anything SGLang would refuse or
    the CPU engine cannot do, naming the field."""
    unknown = sorted(k for k in body if k not in GENERATE_FIELDS)
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}")
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False, [], {}, ""):
            raise RequestError(f"{key} is not supported by the CPU engine")
    top = body.get("top_logprobs_num")
    if top not in (None, 0):
        raise RequestError("top_logprobs_num is not supported by the CPU engine")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise RequestError("give exactly one of text or input_ids")
    tok = engine.tokenizer
    if has_text:
        text = body["text"]
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError("text must be a string or a non-empty list of strings")
        prompts = []
        for i, t in enumerate(texts):
            try:
                prompts.append(tok.encode(t))
            except Exception as err:  # e.g. a lone surrogate: valid JSON, not valid text
                where = "text" if single else f"text[{i}]"
                raise RequestError(f"{where} cannot be tokenized: {type(err).__name__}") from None
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        single = not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        for p in prompts:
            if not isinstance(p, list) or not all(is_int(i) for i in p):
                raise RequestError("input_ids must be a list of integers or a list of lists of integers")
    n_prompts = len(prompts)
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if len(raw_params) != n_prompts:
            raise RequestError(
                f"sampling_params has {len(raw_params)} entries for a batch of {n_prompts}"
            )
    elif raw_params is not None and not isinstance(raw_params, dict):
        raise RequestError("sampling_params must be an object or a list of objects")
    param_list = raw_params if isinstance(raw_params, list) else [raw_params] * n_prompts
    params = [SamplingParams.from_dict(p, engine.vocab_size) for p in param_list]
    copies = {p.n for p in params}
    if len(copies) > 1:
        raise RequestError("sampling_params.n must be the same for every item")
    n_copies = copies.pop()
    if n_prompts * n_copies > MAX_BATCH_ITEMS:
        raise RequestError(f"a /generate batch may hold at most {MAX_BATCH_ITEMS} items (prompts x n)")
    if n_copies > 1:  # SGLang expands inputs * n: [p0, p1, p0, p1]
        prompts, params, single = prompts * n_copies, params * n_copies, False
    size = len(prompts)
    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(size)]
    elif isinstance(rid, str):
        rids = [rid] if size == 1 and single else [f"{rid}_{i}" for i in range(size)]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != size:
            raise RequestError(f"rid has {len(rid)} entries for a batch of {size}")
        rids = list(rid)
    else:
        raise RequestError("rid must be a string or a list of strings")
    if len(set(rids)) != len(rids):
        raise RequestError("duplicate request ids in the batch")
    return_lp = per_item(
        body.get("return_logprob"), size, "return_logprob", lambda v: isinstance(v, bool), False
    )
    start_len = per_item(body.get("logprob_start_len"), size, "logprob_start_len", is_int, -1)
    lora_path = body.get("lora_path")
    if isinstance(lora_path, list) and len(lora_path) != size:
        raise RequestError(f"lora_path list length ({len(lora_path)}) must match batch size ({size})")
    try:  # the adapter merged into the weights, named by every item (rayrl/engines/cpu/engine_adapter.py)
        engine.check_adapter_request(lora_path)
    except ValueError as err:
        raise RequestError(str(err)) from None
    items = []
    for i in range(size):
        ids = engine.validate_prompt(prompts[i], params[i])
        if not -1 <= start_len[i] < len(ids):
            raise RequestError(
                f"logprob_start_len ({start_len[i]}) must be -1 (none) or in [0, {len(ids)}) (the prompt length)"
            )
        items.append(GenerateItem(ids, params[i], rids[i], return_lp[i], start_len[i]))
    return GenerateBatch(items, single, bool_flag(body, "stream"), bool_flag(body, "return_text_in_logprobs"))
