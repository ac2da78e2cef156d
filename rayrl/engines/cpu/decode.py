"""The CPU engine's decode step, and how requests leave the batch and finish.

A mixin of :class:`rayrl.engines.cpu.engine.CPUEngine`, kept apart from the request API and the loop
(engine.py) and admission (prefill.py). Its methods run on the engine thread and use the engine's
model, batch state (``_kv``, ``_seqs``, ``_positions``, ``_next_ids``, ``_sampler``), counters and
prefix cache. A decode step writes one KV column for the whole batch; a request that finished leaves
right after the step that finished it, and its conversation goes into the prefix cache.

The forward runs through the lean decode path (lean_decode.py) where the engine has one, else through
the transformers model over the cache's views (kv_cache.py); either can run for a contiguous part of
the rows.

A request that fails, fails alone: a row the sampler cannot sample (its logits are NaN or infinite
after its own parameters), a token it cannot append (decoding for its stop strings raised), an output
that cannot be decoded: that request finishes with an engine error (``requests.engine_error``) and
leaves; the other rows' tokens are the ones they would have had without it. A forward pass of the
batch that raises is run again on each half of the rows, and so on down to single rows
(:meth:`DecodeMixin._forward_isolated`): a request whose row still fails alone is failed, the others
get their logits from the parts that succeeded, so one request that breaks the forward (a bad state of
its own) costs the others about ``2 log2(batch)`` extra forwards and nothing else. A part rewrites the
same cache column, so a retry leaves no trace of the failed try. Each such failure is counted
(``request_errors``; ``decode_retries`` for the batches retried) and logged once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from rayrl.engines.cpu.requests import GenerationResult, RequestHandle, SequenceState, engine_error, final_text
from rayrl.engines.cpu.sampling import BatchSampler

logger = logging.getLogger("rayrl.engines.cpu.engine")


class DecodeMixin:
    """Decode, leave and finish (mixed into CPUEngine)."""

    def _blocked(self, seqs: list[SequenceState]) -> list[tuple[int, torch.Tensor]]:
        return [(i, s.blocked) for i, s in enumerate(seqs) if s.blocks_now()]

    def _decode_step(self) -> None:
        kv = self._kv
        assert kv is not None and kv.rows == len(self._seqs)
        mask = kv.step_mask() if self._lean is not None else kv.decode_mask()
        logits, broken = self._forward_isolated(slice(0, kv.rows), mask)
        kv.commit(1)
        tokens, logprobs, failed = self._sampler.sample(logits, self._blocked(self._seqs), self._generator)
        failed.update(broken)  # a row whose forward failed was sampled from placeholder logits
        self._positions += 1
        self._next_ids = tokens.view(-1, 1)
        self._counters["steps"] += 1
        leave = set()
        for i, (seq, tok, lp) in enumerate(zip(self._seqs, tokens.tolist(), logprobs.tolist())):
            if i in failed:
                self._fail(seq.handle, failed[i])
                leave.add(i)
            elif self._append(seq, tok, lp):
                leave.add(i)
        if leave:
            self._leave(leave)

    def _forward_rows(self, rows: slice, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Next-token logits ``[n, vocab]`` of the running rows ``rows``; writes their cache column."""
        ids, positions = self._next_ids[rows], self._positions[rows]
        part_mask = mask[rows] if mask is not None else None
        if self._lean is not None:
            return self._lean.step(ids.view(-1), positions, self._kv, rows, part_mask)
        with self._kv.rows_only(rows):
            out = self.model(
                input_ids=ids,
                attention_mask=part_mask,
                position_ids=positions.view(-1, 1),
                past_key_values=self._kv.cache,
                use_cache=True,
                logits_to_keep=1,
            )
        return out.logits[:, -1]

    def _forward_isolated(self, rows: slice, mask: Optional[torch.Tensor],
                          retry: bool = False) -> tuple[torch.Tensor, dict[int, str]]:
        """:meth:`_forward_rows`; when it raises, each half of ``rows`` is run on its own, down to single
        rows. Returns the logits of every row (zeros for a row that failed alone) and the failed rows
        with the reason."""
        try:
            return self._forward_rows(rows, mask), {}
        except Exception as err:
            reason = f"the decode forward pass failed: {type(err).__name__}: {err}"
            size = rows.stop - rows.start
            if size == 1:
                return torch.zeros(1, self._logits_width), {rows.start: reason}
            if not retry:
                self._counters["decode_retries"] += 1
                logger.warning("decode forward of %d requests failed (%s: %s); running it again in parts to find "
                               "the request that breaks it", size, type(err).__name__, err)
            mid = rows.start + size // 2
            first, failed = self._forward_isolated(slice(rows.start, mid), mask, True)
            second, more = self._forward_isolated(slice(mid, rows.stop), mask, True)
            return torch.cat([first, second]), {**failed, **more}

    def _fail(self, handle: RequestHandle, message: str) -> None:
        """Finish one request with an engine error, alone (counted and logged once)."""
        if handle.done.is_set():
            return
        self._counters["request_errors"] += 1
        logger.warning("request %s failed alone: %s", handle.rid, message)
        self._finish(handle, engine_error(f"engine error: {message}"))

    def _append(self, seq: SequenceState, token: int, logprob: float) -> bool:
        """Record one generated token; finish the request when a stop condition holds (or when recording
        the token fails: that request alone). True = finished."""
        self._counters["tokens"] += 1
        try:
            reason = seq.append(token, logprob, self.tokenizer)
        except Exception as err:
            self._fail(seq.handle, f"recording token {token} failed: {type(err).__name__}: {err}")
            return True
        if reason is not None:
            self._finish(seq.handle, reason)
            return True
        if seq.handle.stream:
            seq.handle.notify()
        return False

    def _leave(self, rows: set[int]) -> None:
        assert self._kv is not None
        for row in rows:
            try:
                self._cache_conversation(row)
            except Exception:  # the prefix cache is an optimisation: keeping a conversation may fail alone
                self._counters["prefix_cache_errors"] += 1
                logger.exception("keeping request %s in the prefix cache failed", self._seqs[row].handle.rid)
        order = self._kv.remove(sorted(rows))
        idx = torch.tensor(order, dtype=torch.long)
        self._seqs = [self._seqs[i] for i in order]
        self._positions = self._positions[idx]
        self._next_ids = self._next_ids[idx]
        self._sampler = BatchSampler([s.row for s in self._seqs])

    # ------------------------------------------------------------------ finishing

    def _finish(self, handle: RequestHandle, reason: dict[str, Any]) -> None:
        if handle.done.is_set():
            return
        versions = handle.token_versions()
        if versions:
            version = versions[-1]
        elif handle.output_ids and handle.start_version is not None:
            version = handle.start_version
        else:
            version = self._weight_version
        try:
            text = final_text(handle, reason, self.tokenizer)
        except Exception as err:
            self._counters["request_errors"] += 1
            logger.warning("request %s failed alone: decoding its output failed: %s", handle.rid, err)
            text = ""
            reason = engine_error(f"engine error: decoding the output failed: {type(err).__name__}: {err}")
        result = GenerationResult(
            rid=handle.rid,
            prompt_tokens=len(handle.prompt_ids),
            output_ids=list(handle.output_ids),
            output_logprobs=list(handle.output_logprobs),
            text=text,
            finish_reason=reason,
            weight_version=version,
            token_versions=versions,
            input_token_logprobs=handle.input_logprobs,
            e2e_latency=time.perf_counter() - handle.submitted_at,
            cached_tokens=handle.cached_tokens,
        )
        with self._lock:
            self._active.pop(handle.rid, None)
        self._counters["finished"] += 1
        handle.finish(result)
