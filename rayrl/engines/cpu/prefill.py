"""Admission into the CPU engine's running batch: prefill (plain or on top of a cached prefix), the first
sampled token, and what goes into the prefix cache.

A mixin of :class:`rayrl.engines.cpu.engine.CPUEngine`, kept apart because it is the part that decides
how prompt tokens are computed (left-padded groups, cached prefixes, deduplicated group prompts), while
engine.py holds the request API and the decode loop. Its methods run on the engine thread and use the
engine's model, batch state (``_kv``, ``_seqs``, ``_positions``, ``_next_ids``, ``_sampler``), prefix
cache (``_prefix``, ``_cache_epoch``) and helpers (``_append``, ``_finish``, ``_fail``, ``_blocked``).

Admission isolates requests as the decode step does: a request whose own state cannot be built (its
sampler row) or whose first token cannot be sampled fails alone, and a prefill forward pass that raises
is run again one request at a time, so only the request that makes it fail is failed; the running
batch is never touched by a failed admission.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, TypeVar

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from rayrl.engines.cpu.kv_cache import BatchKV, KVBlock, prefill_mask
from rayrl.engines.cpu.prefix_cache import MIN_REUSE_TOKENS, PrefixEntry, common_prefix
from rayrl.engines.cpu.requests import RequestHandle, SequenceState
from rayrl.engines.cpu.sampling import BatchSampler

PAD_WASTE = 0.2  # largest share of padding in a prefill group

T = TypeVar("T")
logger = logging.getLogger("rayrl.engines.cpu.engine")


def _handle_of(item: Any) -> RequestHandle:
    """The request of a prefill group item (a handle, or a prefix-cache hit ``(handle, matched, entry)``)."""
    return item if isinstance(item, RequestHandle) else item[0]


def pack_by_length(items: list[T], length: Callable[[T], int], budget: int) -> list[list[T]]:
    """``items`` sorted by ``length`` and cut into batches that run as wide as their longest member:
    the columns the shorter ones waste stay under PAD_WASTE of the batch, and the batch's columns
    (count × longest) within ``budget``."""
    groups: list[list[T]] = []
    real = 0
    for item in sorted(items, key=length):
        n = length(item)
        if groups:
            padded = (len(groups[-1]) + 1) * n  # n is the batch's longest (sorted)
            if padded <= budget and padded - (real + n) <= PAD_WASTE * padded:
                groups[-1].append(item)
                real += n
                continue
        groups.append([item])
        real = n
    return groups


class PrefillMixin:
    """Prefill and join for CPUEngine (see the module docstring for the state it uses)."""

    model: Any
    _kv: BatchKV | None

    def _prefill_groups(self, handles: list[RequestHandle]) -> list[list[RequestHandle]]:
        """Prompts sorted by length, cut into groups whose left padding stays under PAD_WASTE of the
        padded tokens and whose padded size fits the prefill budget (padding is wasted compute).
        Requests that want prompt log-probs (full logits) prefill alone."""
        alone = [[h] for h in handles if h.wants_prompt_logprobs]
        rest = [h for h in handles if not h.wants_prompt_logprobs]
        return pack_by_length(rest, lambda h: len(h.prompt_ids), self.prefill_budget_tokens) + alone

    def _admit(self, handles: list[RequestHandle]) -> None:
        """Prefill new requests and append the rows still running to the batch.

        Requests whose prompt starts with a cached prefix prefill only the rest, batched with other such
        requests whose rest is about as long. The others prefill in left-padded groups; a request
        sharing a long prefix with one of those waits for it (its prompt KV is cached right after) and
        then reuses it, so a group's episodes that arrive together pay for their shared prompt once.
        """
        hits: list[tuple[RequestHandle, int, PrefixEntry]] = []
        misses: list[RequestHandle] = []
        later: list[RequestHandle] = []
        for h in handles:
            if h.wants_prompt_logprobs or not self._prefix.enabled:
                misses.append(h)
                continue
            matched, entry = self._prefix.match(h.prompt_ids)
            if entry is not None:
                hits.append((h, matched, entry))
            elif any(self._shares_prefix(h, m) for m in misses):
                later.append(h)
            else:
                misses.append(h)
        joined = False
        for group in self._prefill_groups(misses):
            joined |= self._join_isolated(self._prefill, group)
        for h in later:
            matched, entry = self._prefix.match(h.prompt_ids)
            if entry is not None:
                hits.append((h, matched, entry))
            else:
                joined |= self._join_isolated(self._prefill, [h])
        for group in self._cached_groups(hits):
            joined |= self._join_isolated(self._prefill_cached, group)
        if joined:
            self._sampler = BatchSampler([s.row for s in self._seqs])

    def _join_isolated(self, prefill: Callable[[list[Any]], tuple], group: list[Any]) -> bool:
        """Prefill ``group`` and join it; if that raises, each request is tried alone, so only the one
        that fails is failed (False: nothing joined)."""
        try:
            return self._join(*prefill(group))
        except Exception as err:
            pending = [item for item in group if not _handle_of(item).done.is_set()]
            # alone already, or past the first token (joining failed): these cannot be retried cleanly
            if len(group) == 1 or any(_handle_of(item).output_ids for item in pending):
                for item in pending:
                    self._fail(_handle_of(item), f"prefill failed: {type(err).__name__}: {err}")
                return False
            logger.warning("prefill of %d requests failed (%s: %s); trying each alone", len(group),
                           type(err).__name__, err)
            return any([self._join_isolated(prefill, [item]) for item in pending])

    @staticmethod
    def _shares_prefix(h: RequestHandle, other: RequestHandle) -> bool:
        if other.wants_prompt_logprobs:
            return False
        return common_prefix(np.asarray(h.prompt_ids), np.asarray(other.prompt_ids)) >= MIN_REUSE_TOKENS

    def _join(self, block: KVBlock, seqs: list[Optional[SequenceState]], pos: torch.Tensor,
              next_ids: torch.Tensor, keep: list[int]) -> bool:
        """Append a prefilled block's rows ``keep`` to the running batch (False: nothing joined)."""
        if not keep:
            return False  # every request of the group finished at its first token
        if self._kv is None:
            self._kv = BatchKV(len(block.keys), self.max_batch_size)
        idx = torch.tensor(keep, dtype=torch.long)
        self._kv.append(block, idx)
        self._seqs.extend(seqs[i] for i in keep)
        self._positions = torch.cat([self._positions, pos[idx]])
        self._next_ids = torch.cat([self._next_ids, next_ids[idx]])
        return True

    def _prefill(self, group: list[RequestHandle]):
        """Prefill one left-padded group; sample each request's first token; returns rows still running."""
        length = max(len(h.prompt_ids) for h in group)
        ids = torch.full((len(group), length), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(group), length, dtype=torch.bool)
        for i, h in enumerate(group):
            n = len(h.prompt_ids)
            ids[i, length - n :] = torch.tensor(h.prompt_ids, dtype=torch.long)
            mask[i, length - n :] = True
        positions = (mask.long().cumsum(1) - 1).clamp_(min=0)
        want_prompt_lps = any(h.wants_prompt_logprobs for h in group)
        # no padding (one prompt, or equal lengths): plain causal attention, SDPA's fastest path
        logits, keys, values = self._forward_prompt(
            ids, positions, None if bool(mask.all()) else prefill_mask(mask), None, want_prompt_lps)
        if want_prompt_lps:
            self._prompt_logprobs(group, ids, logits)
        for i, h in enumerate(group):
            self._cache_prompt(h, keys, values, i, length)
        return self._first_tokens(group, logits[:, -1], KVBlock(keys, values, mask), mask.sum(1))

    def _forward_prompt(self, ids: torch.Tensor, positions: torch.Tensor, attention: Optional[torch.Tensor],
                        past: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]], all_logits: bool):
        """One prefill forward: logits (``[n, T, vocab]``, or the last column's ``[n, 1, vocab]``) and every
        layer's keys and values ``[n, kv_heads, past + T, head_dim]``. ``attention``: 4-D boolean mask over
        the past and new columns (None: plain causal, no past). Through the lean path where the engine has
        one (the same weights as its decode steps), else through the transformers model."""
        if self._lean is not None:
            return self._lean.prefill(ids, positions, attention, past, all_logits)
        cache = DynamicCache()
        for layer, (k, v) in enumerate(zip(*past) if past is not None else ()):
            cache.update(k, v, layer)
        out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=0 if all_logits else 1)
        return out.logits, [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]

    def _cached_groups(self, hits: list[tuple[RequestHandle, int, PrefixEntry]]):
        """Cache hits cut into batches by the length of their uncached rest: a batch runs as many new
        columns as its longest rest, so a shorter rest recomputes some of its cached tokens; that extra
        work stays under PAD_WASTE of the batch's columns, and the batch within the prefill budget."""
        return pack_by_length(hits, lambda hit: len(hit[0].prompt_ids) - hit[1], self.prefill_budget_tokens)

    def _prefill_cached(self, group: list[tuple[RequestHandle, int, PrefixEntry]]):
        """Prefill requests on top of their cached prefixes in one forward pass.

        Every row ends at the last column. The batch runs ``new`` columns, its longest uncached rest, on
        top of ``past`` cached columns: row i reuses the first ``n_i - new`` tokens of its match (at most
        all of it) and computes the rest, so rows stay contiguous and left-padded, as the running batch
        and the prefix cache expect.
        """
        handles = [h for h, _, _ in group]
        lengths = [len(h.prompt_ids) for h in handles]
        new = max(n - matched for n, (_, matched, _) in zip(lengths, group))
        total = max(lengths)
        past = total - new
        rows = len(group)
        reused = [max(0, n - new) for n in lengths]
        first = group[0][2]
        keys = [torch.zeros(rows, k.shape[1], past, k.shape[3], dtype=k.dtype) for k in first.keys]
        values = [torch.zeros(rows, v.shape[1], past, v.shape[3], dtype=v.dtype) for v in first.values]
        ids = torch.full((rows, new), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(rows, total, dtype=torch.bool)
        for i, ((h, _, entry), n, c) in enumerate(zip(group, lengths, reused)):
            for layer, (k, v) in enumerate(zip(entry.keys, entry.values)):
                keys[layer][i, :, past - c : past] = k[0, :, :c]
                values[layer][i, :, past - c : past] = v[0, :, :c]
            ids[i, new - (n - c) :] = torch.tensor(h.prompt_ids[c:], dtype=torch.long)
            mask[i, total - n :] = True
            h.cached_tokens = c
            self._prefix.record_reuse(c)
        columns = torch.arange(new).view(1, -1)
        positions = (columns + torch.tensor(lengths).view(-1, 1) - new).clamp_(min=0)
        query_at = (columns + past).view(1, 1, new, 1)  # each new column's place among all columns
        key_at = torch.arange(total).view(1, 1, 1, total)
        attention = ((key_at <= query_at) & mask.view(rows, 1, 1, total)) | (key_at == query_at)
        logits, keys, values = self._forward_prompt(ids, positions, attention, (keys, values) if past else None,
                                                    False)
        for i, h in enumerate(handles):
            self._cache_prompt(h, keys, values, i, total)
        return self._first_tokens(handles, logits[:, -1], KVBlock(keys, values, mask), mask.sum(1))

    def _cache_prompt(self, h: RequestHandle, keys: list[torch.Tensor], values: list[torch.Tensor], row: int,
                      length: int) -> None:
        """Keep the prompt's KV (row ``row`` of a left-padded prefill of ``length`` columns)."""
        h.cache_epoch = self._cache_epoch
        n = len(h.prompt_ids)
        if not self._prefix.enabled or self._prefix.covers(h.prompt_ids):
            return
        self._prefix.insert(
            h.prompt_ids,
            [k[row : row + 1, :, length - n : length].clone() for k in keys],
            [v[row : row + 1, :, length - n : length].clone() for v in values],
        )

    def _first_tokens(self, group: list[RequestHandle], logits: torch.Tensor, block: KVBlock,
                      next_pos: torch.Tensor):
        """Sample each prefilled request's first token; returns what :meth:`_join` takes."""
        seqs: list[Optional[SequenceState]] = []
        version = self._weight_version
        for h in group:
            h.start_version = version
            self._counters["prompt_tokens"] += len(h.prompt_ids)
            try:
                seqs.append(SequenceState(h, self.eos_token_ids, self.vocab_size, self.context_length))
            except Exception as err:  # this request's own sampling state: it fails alone
                self._fail(h, f"setting up its sampling state failed: {type(err).__name__}: {err}")
                seqs.append(None)
        live = [i for i, seq in enumerate(seqs) if seq is not None]
        tokens = torch.zeros(len(group), dtype=torch.long)
        keep: list[int] = []
        if live:
            rows = [seqs[i] for i in live]
            idx = torch.tensor(live, dtype=torch.long)
            sampled, logprobs, failed = BatchSampler([s.row for s in rows]).sample(
                logits[idx], self._blocked(rows), self._generator
            )
            tokens[idx] = sampled
            for j, (seq, tok, lp) in enumerate(zip(rows, sampled.tolist(), logprobs.tolist())):
                if j in failed:
                    self._fail(seq.handle, failed[j])
                elif seq.handle.params.max_new_tokens == 0:
                    self._finish(seq.handle, {"type": "length", "length": 0})
                elif not self._append(seq, tok, lp):
                    keep.append(live[j])
        return block, seqs, next_pos, tokens.view(-1, 1), keep

    def _prompt_logprobs(self, group: list[RequestHandle], ids: torch.Tensor, logits: torch.Tensor) -> None:
        length = ids.shape[1]
        for i, h in enumerate(group):
            if not h.wants_prompt_logprobs:
                continue
            n = len(h.prompt_ids)
            row_logits = logits[i, length - n : length - 1].float()
            targets = ids[i, length - n + 1 :].view(-1, 1)
            lps = torch.log_softmax(row_logits, dim=-1).gather(1, targets).view(-1).tolist()
            values: list[Optional[float]] = [None] + lps
            h.input_logprobs = values[h.logprob_start_len :]

    def _cache_conversation(self, row: int) -> None:
        """Keep a leaving request's KV (prompt and output but the last token, which never ran through
        the model), so the conversation's next turn reuses it. Only KV made entirely by the current
        weights is kept."""
        h, kv = self._seqs[row].handle, self._kv
        if not self._prefix.enabled or h.cache_epoch != self._cache_epoch or h.version_changes or not kv:
            return
        tokens = h.prompt_ids + h.output_ids[:-1]
        n, length = len(tokens), kv.length
        if n > length or self._prefix.covers(tokens) or int(kv.mask_buffer[row, :length].sum()) != n:
            return
        self._prefix.insert(
            tokens,
            [buf[row : row + 1, :, length - n : length].clone() for buf in kv.key_buffers],
            [buf[row : row + 1, :, length - n : length].clone() for buf in kv.value_buffers],
        )

