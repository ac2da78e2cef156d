"""Per-request state of the CPU engine: the caller's handle, the engine's view, the final result.

The handle is shared between threads: the engine thread appends tokens and finishes it; other threads
read snapshots (lists are copied atomically under the GIL) or wait on ``done``. Stop conditions live
on :class:`SequenceState` so the decode loop stays a loop over tensors. :func:`checked_prompt` is the
one check of a prompt against the vocabulary and the context; :func:`engine_error` the one shape of a
request the engine failed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from rayrl.engines.cpu.sampling import RowState, SamplingParams

logger = logging.getLogger(__name__)

FinishReason = dict[str, Any]


def engine_error(message: str, status: int = 500) -> FinishReason:
    """The finish reason of a request the engine failed (SGLang's FINISH_ABORT with a status code): an
    error of the engine, never the request's own output. ``type`` stays "abort", so every reader that
    only knows SGLang's types still sees an unfinished generation; ``status_code`` tells a failure
    (5xx: the engine's) from an abort someone asked for (no status code)."""
    err_type = "ServiceUnavailable" if status == 503 else "InternalServerError"
    return {"type": "abort", "message": message, "status_code": status, "err_type": err_type}


@dataclass
class GenerationResult:
    """What one finished request produced. ``token_versions`` is None unless the version changed."""

    rid: str
    prompt_tokens: int
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: FinishReason
    weight_version: str
    token_versions: Optional[list[str]]
    input_token_logprobs: Optional[list[Optional[float]]]
    e2e_latency: float
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class RequestHandle:
    """A submitted request: progress readable while it runs, its result once finished."""

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        return_logprob: bool,
        logprob_start_len: int,
        stream: bool,
        on_update: Optional[Callable[["RequestHandle"], None]],
    ) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.stream = stream
        self.on_update = on_update
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.input_logprobs: Optional[list[Optional[float]]] = None
        self.start_version: Optional[str] = None  # the version at prefill
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.cache_epoch: Optional[int] = None  # the engine's weight epoch at prefill (prefix cache)
        self.version_changes: list[tuple[int, str]] = []  # (index of the first token it produced, version)
        self.submitted_at = time.perf_counter()
        self.first_token_at: Optional[float] = None  # perf_counter() when the first token was sampled
        self.done = threading.Event()
        self._result: Optional[GenerationResult] = None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    def result(self, timeout: Optional[float] = None) -> GenerationResult:
        """Block until the request finishes (raises TimeoutError after ``timeout`` seconds)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.rid} did not finish within {timeout} s")
        assert self._result is not None
        return self._result

    def token_versions(self) -> Optional[list[str]]:
        """Per-token versions when the weights changed during this request, else None."""
        n = len(self.output_ids)
        if not any(v != self.start_version and i < n for i, v in self.version_changes):
            return None
        out = [self.start_version or ""] * n
        for i, v in self.version_changes:
            out[i:] = [v] * max(0, n - i)
        return out

    def finish(self, result: GenerationResult) -> None:
        """Publish the result (engine thread) and tell the listener."""
        self._result = result
        self.done.set()
        self.notify()

    def notify(self) -> None:
        if self.on_update is not None:
            try:
                self.on_update(self)
            except Exception:  # a broken listener must not take the decode loop down
                logger.exception("on_update callback for %s failed", self.rid)


class SequenceState:
    """The engine's view of a running request: its sampler row and stop conditions."""

    def __init__(
        self, handle: RequestHandle, eos_ids: frozenset[int], vocab_size: int, context_length: int
    ) -> None:
        p = handle.params
        self.handle = handle
        self.row = RowState(p, handle.prompt_ids, vocab_size)
        self.stop_ids = (frozenset() if p.ignore_eos else eos_ids) | frozenset(p.stop_token_ids)
        self.stop_window = max((len(s) for s in p.stop), default=0) + 4  # tokens decoded for stop strings
        # stop tokens may not be sampled before min_new_tokens (SGLang's min-new-tokens penalizer)
        self.blocked = torch.tensor(sorted(self.stop_ids), dtype=torch.long) if p.min_new_tokens else None
        self.max_len = min(p.max_new_tokens, context_length - len(handle.prompt_ids))

    def blocks_now(self) -> bool:
        return self.blocked is not None and len(self.handle.output_ids) < self.handle.params.min_new_tokens

    def append(self, token: int, logprob: float, tokenizer: Any) -> Optional[FinishReason]:
        """Record one generated token; returns the finish reason when a stop condition now holds."""
        h, p = self.handle, self.handle.params
        if not h.output_ids:
            h.first_token_at = time.perf_counter()
        h.output_ids.append(token)
        h.output_logprobs.append(logprob)
        self.row.observe(token)
        n = len(h.output_ids)
        if n >= p.min_new_tokens:
            if token in self.stop_ids:
                return {"type": "stop", "matched": token}
            if p.stop:
                tail = tokenizer.decode(
                    h.output_ids[-self.stop_window :], skip_special_tokens=p.skip_special_tokens
                )
                hit = next((s for s in p.stop if s in tail), None)
                if hit is not None:
                    return {"type": "stop", "matched": hit}
        if n >= self.max_len:
            return {"type": "length", "length": n}
        return None


def checked_prompt(
    input_ids: Sequence[int], params: SamplingParams, vocab_size: int, context_length: int
) -> list[int]:
    """Token ids as a list of ints, checked against the vocabulary and the context length."""
    if isinstance(input_ids, (str, bytes)) or not hasattr(input_ids, "__iter__"):
        raise ValueError("input_ids must be a list of integers")
    ids = list(input_ids)
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
        raise ValueError("input_ids must be a list of integers")
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("input_ids must not be empty")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"input_ids contains token id {bad[0]} outside the vocabulary [0, {vocab_size})"
        )
    if len(ids) >= context_length:
        raise ValueError(
            f"The input ({len(ids)} tokens) is longer than the model's context length "
            f"({context_length} tokens)."
        )
    if len(ids) + params.max_new_tokens > context_length:
        raise ValueError(
            "Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {len(ids) + params.max_new_tokens} "
            f"tokens: {len(ids)} tokens from the input messages and {params.max_new_tokens} tokens for "
            "the completion."
        )
    return ids


def final_text(handle: RequestHandle, reason: FinishReason, tokenizer: Any) -> str:
    """Decoded output with SGLang's trimming: a matched stop token or stop string is removed unless
    ``no_stop_trim``."""
    p = handle.params
    ids = handle.output_ids
    matched = reason.get("matched")
    is_stop = reason.get("type") == "stop" and not p.no_stop_trim
    if is_stop and isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens)
    if is_stop and isinstance(matched, str):
        cut = text.find(matched)
        if cut >= 0:
            text = text[:cut]
    return text


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id that ends a generation: the tokenizer's, the generation config's and the model config's."""
    ids: set[int] = set()
    for source in (
        tokenizer.eos_token_id,
        getattr(model.generation_config, "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ):
        if source is None:
            continue
        ids.update(int(i) for i in (source if isinstance(source, (list, tuple)) else [source]))
    return ids
