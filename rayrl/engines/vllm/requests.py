"""SGLang's ``/generate`` in vLLM's terms and back: the request and answer translations of the vllm backend.

``translate_generate`` turns a ``/generate`` body (``input_ids``, SGLang's ``sampling_params``, ``rid``,
``return_logprob``, ``logprob_start_len``, ``stream``) into a request for vLLM's token-in/token-out route
``/inference/v1/generate`` (vllm/entrypoints/scale_out/token_in_token_out/protocol.py ``GenerateRequest``,
its ``sampling_params`` vLLM's ``SamplingParams``); tests/engines/vllm/test_vllm_backend.py validates what it
makes with those classes themselves, in vLLM's interpreter. The answer comes back in SGLang's shape:
cumulative ``output_ids`` and ``text``, ``meta_info.output_token_logprobs`` as ``[logprob, id, None]``,
the finish reason as SGLang's ``{"type": ...}`` object, and the weight version from vLLM's
``weight_versions`` spans (``output_token_versions`` per token when the spans name more than one).

Log-probs are vLLM's raw log-probs (``--logprobs-mode raw_logprobs``): the model's own distribution
before temperature, as our CPU engine and the trainer compute them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rayrl.engines import wire_json
from rayrl.engines.http_input import RequestError

# SGLang sampling_params -> vLLM SamplingParams (same meaning; vLLM validates the values)
SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "no_stop_trim": "include_stop_str_in_output",
    "sampling_seed": "seed",
    "logit_bias": "logit_bias",
}
SGLANG_DEFAULT_MAX_NEW_TOKENS = 128  # what SGLang generates when max_new_tokens is not given
BODY_KEYS = {"input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "stream",
             "return_text_in_logprobs", "top_logprobs_num"}


def error_message(raw: bytes) -> str:
    """The message of a vLLM (FastAPI) error body: ``{"error": {"message"}}``, ``{"detail"}`` or text."""
    try:
        body = wire_json.loads(raw)
    except ValueError:
        return raw[:500].decode("utf-8", "replace")
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return str(body)


def check_tp_entries_count(entries: list[str], tp_size: int) -> None:
    if len(entries) != tp_size:
        raise RequestError(f"serialized_named_tensors has {len(entries)} entries and this engine has tp_size "
                           f"{tp_size}: one per tensor-parallel rank")


def _sampling(params: Any) -> tuple[dict[str, Any], bool]:
    """vLLM's sampling_params for SGLang's, and whether only the prompt is scored (max_new_tokens 0)."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError("sampling_params must be an object")
    unknown = sorted(set(params) - set(SAMPLING_NAMES) - {"n"})
    if unknown:
        raise RequestError(f"sampling_params {', '.join(unknown)}: not supported by the vllm backend "
                           f"(it takes {', '.join(sorted(SAMPLING_NAMES))})")
    if params.get("n", 1) != 1:
        raise RequestError("sampling_params.n: the vllm backend generates one sequence per request")
    out = {SAMPLING_NAMES[k]: v for k, v in params.items() if k != "n" and v is not None}
    out.setdefault("max_tokens", SGLANG_DEFAULT_MAX_NEW_TOKENS)
    if isinstance(out.get("logit_bias"), dict):
        try:
            out["logit_bias"] = {int(k): float(v) for k, v in out["logit_bias"].items()}
        except (TypeError, ValueError):
            raise RequestError("sampling_params.logit_bias: token id keys and number values") from None
    if isinstance(out.get("stop"), str):
        out["stop"] = [out["stop"]]
    prompt_only = out["max_tokens"] == 0
    if prompt_only:
        out["max_tokens"] = 1  # vLLM generates at least one token; it is dropped from the answer
    return out, prompt_only


@dataclass
class GenerateTranslation:
    """One ``/generate`` call planned for vLLM: ``request`` is the ``/inference/v1/generate`` body."""

    request: dict[str, Any]
    rid: str
    prompt_tokens: int
    stream: bool
    logprobs: bool
    prompt_logprobs_from: Optional[int]
    prompt_only: bool

    def whole_answer(self, answer: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed vLLM answer (``GenerateTextResponse``) in SGLang's shape."""
        choices = answer.get("choices") or []
        if len(choices) != 1:
            raise RequestError(f"vLLM answered with {len(choices)} choices", status=502)
        state = StreamState(self)
        state.add_choice(choices[0])
        out = state.sglang_chunk()
        if self.prompt_logprobs_from is not None:
            out["meta_info"]["input_token_logprobs"] = self._prompt_logprobs(answer.get("prompt_logprobs"))
        return out

    def _prompt_logprobs(self, per_position: Any) -> list[list[Any]]:
        ids = self.request["token_ids"]
        start = self.prompt_logprobs_from or 0
        if not isinstance(per_position, list) or len(per_position) != len(ids):
            raise RequestError("vLLM answered without prompt log-probs for every prompt token", status=502)
        out = []
        for pos in range(start, len(ids)):
            entry = per_position[pos]
            lp = None
            if isinstance(entry, dict):
                found = entry.get(str(ids[pos]), entry.get(ids[pos]))  # JSON keys are strings
                lp = found.get("logprob") if isinstance(found, dict) else None
            out.append([lp, ids[pos], None])
        return out


def translate_generate(body: dict[str, Any]) -> GenerateTranslation:
    """Check a ``/generate`` body as SGLang would and plan the vLLM request (RequestError: 400)."""
    unknown = sorted(set(body) - BODY_KEYS)
    if unknown:
        raise RequestError(f"/generate {', '.join(unknown)}: not supported by the vllm backend")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in ids):
        raise RequestError("input_ids must be a non-empty list of non-negative token ids")
    sampling, prompt_only = _sampling(body.get("sampling_params"))
    rid = body.get("rid")
    if rid is None:
        import uuid

        rid = uuid.uuid4().hex
    if not isinstance(rid, str) or not rid:
        raise RequestError("rid must be a non-empty string")
    logprobs = bool(body.get("return_logprob", False))
    stream = bool(body.get("stream", False))
    start = body.get("logprob_start_len")
    prompt_from: Optional[int] = None
    if logprobs and isinstance(start, int) and not isinstance(start, bool) and start >= 0:
        if stream:
            raise RequestError("logprob_start_len: prompt log-probs are not streamed by the vllm backend")
        prompt_from = start
        sampling["prompt_logprobs"] = 0
    elif start is not None and not (isinstance(start, int) and not isinstance(start, bool)):
        raise RequestError("logprob_start_len must be an integer")
    if logprobs:
        sampling["logprobs"] = 0  # the sampled token's own log-prob, nothing more
    request: dict[str, Any] = {
        "request_id": rid,
        "token_ids": ids,
        "sampling_params": sampling,
        "output_mode": "text",
        "stream": stream,
    }
    if stream:
        request["stream_options"] = {"include_usage": True}
    return GenerateTranslation(request=request, rid=rid, prompt_tokens=len(ids), stream=stream,
                               logprobs=logprobs, prompt_logprobs_from=prompt_from, prompt_only=prompt_only)


@dataclass
class StreamState:
    """The tokens, log-probs and text of one generation so far, from vLLM's chunks (deltas), answered as
    SGLang's cumulative chunks."""

    plan: GenerateTranslation
    ids: list[int] = field(default_factory=list)
    logprobs: list[Optional[float]] = field(default_factory=list)
    text: str = ""
    finish: Optional[dict[str, Any]] = None
    spans: list[dict[str, Any]] = field(default_factory=list)
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def add_choice(self, choice: dict[str, Any]) -> None:
        delta = list(choice.get("token_ids") or [])
        self.ids.extend(delta)
        content = ((choice.get("logprobs") or {}).get("content")) or []
        if self.plan.logprobs:
            if len(content) != len(delta):
                raise RequestError(f"vLLM gave {len(content)} log-probs for {len(delta)} tokens", status=502)
            self.logprobs.extend(float(c["logprob"]) if c.get("logprob") is not None else None for c in content)
        self.text += choice.get("text") or ""
        if choice.get("weight_versions"):
            self.spans = list(choice["weight_versions"])
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish = self._finish_reason(reason, choice.get("stop_reason"))

    def _finish_reason(self, reason: str, stop_reason: Any) -> dict[str, Any]:
        if reason == "length":
            return {"type": "length", "length": len(self.ids)}
        if reason == "abort":
            return {"type": "abort", "message": "aborted by vLLM (pause or abort)"}
        matched = stop_reason if stop_reason is not None else (self.ids[-1] if self.ids else None)
        return {"type": "stop", "matched": matched}

    def fold(self, chunk: dict[str, Any]) -> Optional[dict[str, Any]]:
        """One vLLM stream chunk -> the SGLang chunk to send (None: nothing new, e.g. the usage chunk)."""
        if "error" in chunk:
            err = chunk["error"]
            return {"error": {"message": f"vLLM: {err.get('message') if isinstance(err, dict) else err}"}}
        details = ((chunk.get("usage") or {}).get("prompt_tokens_details")) or {}
        if isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]
        choices = chunk.get("choices") or []
        if not choices:
            return None
        self.add_choice(choices[0])
        return self.sglang_chunk()

    def aborted(self, message: str) -> dict[str, Any]:
        self.finish = {"type": "abort", "message": message}
        return self.sglang_chunk()

    def sglang_chunk(self) -> dict[str, Any]:
        ids = [] if self.plan.prompt_only else self.ids
        meta: dict[str, Any] = {
            "id": self.plan.rid,
            "finish_reason": self.finish,
            "prompt_tokens": self.plan.prompt_tokens,
            "completion_tokens": len(ids),
            "cached_tokens": self.cached_tokens,
        }
        if self.plan.logprobs:
            lps = [] if self.plan.prompt_only else self.logprobs
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
        versions = {str(s.get("version")) for s in self.spans}
        if self.spans:
            meta["weight_version"] = str(self.spans[-1].get("version"))
        if len(versions) > 1 and ids:
            per_token: list[str] = [""] * len(ids)
            for s in self.spans:
                for i in range(max(0, int(s["start"])), min(len(ids), int(s["end"]))):
                    per_token[i] = str(s["version"])
            meta["output_token_versions"] = per_token
        return {"text": "" if self.plan.prompt_only else self.text, "output_ids": ids, "meta_info": meta}
