"""Folding engine outputs into one: a stream's chunks, and the parts of a generation that was continued.

A generation the router continued (after a pause's abort, or on another engine after its engine died)
arrives in parts; :func:`join_parts` makes one output of them whose per-token versions say which weights
made each token. :class:`StreamAccumulator` folds SGLang's stream chunks (cumulative or incremental) into
one output, or into the part that arrived before the stream broke.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from rayrl.engines.client import EngineError, GenerateOutput


def part_versions(out: GenerateOutput) -> np.ndarray:
    """The policy version of each token of one part (the part's ``weight_version`` for every token when the
    engine reported no per-token versions; -1 where that is not a number)."""
    if out.versions is not None:
        return np.asarray(out.versions, dtype=np.int32)
    try:
        version = int(out.weight_version)
    except (TypeError, ValueError):
        version = -1
    return np.full(len(out.output_ids), version, dtype=np.int32)


def join_parts(parts: Sequence[GenerateOutput]) -> GenerateOutput:
    """One generation from its parts (aborted by a pause, then continued): tokens, log-probs and text
    concatenated; per-token versions say which weights produced each token; the last part decides how
    it finished."""
    last = parts[-1]
    ids = np.concatenate([p.output_ids for p in parts]).astype(np.int32)
    return GenerateOutput(
        output_ids=ids,
        output_logprobs=np.concatenate([p.output_logprobs for p in parts]).astype(np.float32),
        text="".join(p.text for p in parts),
        finish_reason=last.finish_reason,
        weight_version=last.weight_version,
        versions=np.concatenate([part_versions(p) for p in parts]),
        prompt_tokens=parts[0].prompt_tokens,
        completion_tokens=len(ids),
        rid=parts[0].rid,
        # the caller's prompt is the first part's: its cache hits are the ones to report
        meta_info={**last.meta_info, "continued_parts": len(parts),
                   "cached_tokens": parts[0].meta_info.get("cached_tokens", 0)},
    )


class StreamAccumulator:
    """Folds SGLang stream chunks (cumulative or incremental ids/log-probs) into one finished output.

    ``cumulative`` says what the stream is, once a chunk has followed one with tokens: True when each chunk
    holds every token so far (SGLang's default, and the CPU engine's), so the last one alone makes the
    output; None until then.
    """

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.meta: dict[str, Any] = {}
        self.cumulative: bool | None = None

    def add(self, chunk: Mapping[str, Any]) -> None:
        ids = list(chunk.get("output_ids") or [])
        meta = chunk.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        lps = [float(e[0]) if e and e[0] is not None else float("nan") for e in entries]
        n = len(self.ids)
        total = meta.get("completion_tokens")
        if isinstance(total, int) and not isinstance(total, bool) and total >= len(ids):
            cumulative = len(ids) == total  # the engine's count of tokens so far says which
        else:
            cumulative = len(ids) >= n and ids[:n] == self.ids
        if ids and n:  # a first chunk looks the same either way: the second one tells
            self.cumulative = cumulative
        if cumulative:
            new_total = len(ids)
            self.ids = ids
        else:
            new_total = n + len(ids)
            self.ids = self.ids + ids
        if len(lps) == new_total:
            self.logprobs = lps
        elif len(self.logprobs) + len(lps) == new_total:
            self.logprobs = self.logprobs + lps
        self.text = chunk.get("text", self.text) or self.text
        self.meta = dict(meta)

    def partial(self, base_url: str) -> GenerateOutput:
        """What arrived before the stream broke: the tokens that have log-probs, as an aborted output."""
        n = min(len(self.ids), len(self.logprobs))
        self.ids, self.logprobs = self.ids[:n], self.logprobs[:n]
        self.meta = {**self.meta, "finish_reason": {"type": "abort", "message": "engine connection lost"}}
        return self.output(base_url)

    def output(self, base_url: str) -> GenerateOutput:
        if len(self.logprobs) != len(self.ids):
            raise EngineError(200, "the engine stream ended without log-probs for every token", base_url)
        per_token = self.meta.get("output_token_versions")
        versions = None
        if per_token:
            versions = np.asarray([int(v) if str(v).lstrip("-").isdigit() else -1 for v in per_token], np.int32)
        return GenerateOutput(
            output_ids=np.asarray(self.ids, dtype=np.int32),
            output_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            text=self.text,
            finish_reason=self.meta.get("finish_reason") or {},
            weight_version=str(self.meta.get("weight_version", "")),
            versions=versions,
            prompt_tokens=int(self.meta.get("prompt_tokens", 0)),
            completion_tokens=len(self.ids),
            rid=str(self.meta.get("id", "")),
            meta_info=self.meta,
        )
