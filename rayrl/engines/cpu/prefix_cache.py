"""Prefix cache for the CPU engine: KV of token prefixes seen before, reused instead of re-prefilled.

Agent episodes are prefill-heavy: every turn re-sends the whole conversation, and the episodes of a
GRPO group (and often every task) share a long system prompt. SGLang answers this with its radix
cache; this is the CPU engine's counterpart, with the same observable contract: ``cached_tokens`` in
``meta_info``, ``/flush_cache`` empties it, and a weight update empties it (KV computed by old weights
must not be reused by new ones).

Entries are whole token sequences with their per-layer keys/values (``[1, kv_heads, length, head_dim]``,
owned copies). A lookup returns the longest common prefix with any entry; the engine then prefills only
the rest. Entries are inserted when a prompt is prefilled (so the other episodes of a group hit) and
when a request leaves the batch (so the next turn of the conversation hits). An entry that is a prefix
of a newer one is dropped (the newer one serves the same lookups); least recently used entries go when
the byte budget is exceeded. Matching is a scan with numpy comparisons: a few hundred entries of a few
thousand tokens take well under a millisecond next to a prefill of tens of milliseconds.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

MIN_REUSE_TOKENS = 16  # shorter matches are prefilled with the rest of their group (batched is cheaper)


@dataclass
class PrefixEntry:
    """One cached sequence: its tokens and per-layer keys/values ``[1, H, len(tokens), D]``."""

    tokens: np.ndarray
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    nbytes: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class PrefixCache:
    """LRU store of KV prefixes under a byte budget (0 disables it). Used by the engine thread only."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self._entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()
        self._next_key = 0
        self.bytes = 0
        self.lookups = 0
        self.hits = 0
        self.hit_tokens = 0
        self.inserted = 0
        self.evicted = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, ids: Sequence[int]) -> tuple[int, Optional[PrefixEntry]]:
        """The longest reusable prefix of ``ids``: ``(length, entry)``, or ``(0, None)``.

        At most ``len(ids) - 1`` tokens are reused: the last prompt token must run through the model
        to give the logits of the first new token. Matches shorter than MIN_REUSE_TOKENS count as none.
        """
        if not self._entries:
            return 0, None
        self.lookups += 1
        query = np.asarray(ids, dtype=np.int64)
        best, best_key = 0, None
        for key, entry in self._entries.items():
            n = common_prefix(entry.tokens, query)
            if n > best:
                best, best_key = n, key
        best = min(best, len(query) - 1)
        if best < MIN_REUSE_TOKENS or best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        return best, self._entries[best_key]

    def record_reuse(self, tokens: int) -> None:
        """Count prompt tokens a prefill actually took from an entry (a batched prefill may recompute
        part of a match; ``prefix_cache_hit_tokens`` counts only what was reused)."""
        self.hit_tokens += tokens

    def covers(self, ids: Sequence[int]) -> bool:
        """True when an entry already holds all of ``ids`` (so inserting them would add nothing)."""
        if len(ids) < MIN_REUSE_TOKENS:
            return True
        query = np.asarray(ids, dtype=np.int64)
        return any(len(e.tokens) >= len(query) and common_prefix(e.tokens, query) == len(query)
                   for e in self._entries.values())

    def insert(self, ids: Sequence[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> bool:
        """Store ``ids`` with their KV (the caller hands over owned, contiguous copies). False when it
        was not stored: too short, larger than the whole budget, or already covered by an entry."""
        if not self.enabled or len(ids) < MIN_REUSE_TOKENS:
            return False
        tokens = np.asarray(ids, dtype=np.int64)
        nbytes = sum(t.nbytes for t in keys) + sum(t.nbytes for t in values)
        if nbytes > self.budget_bytes:
            return False
        for key, entry in list(self._entries.items()):
            n = common_prefix(entry.tokens, tokens)
            if n == len(tokens):  # already covered (same sequence or a longer one)
                self._entries.move_to_end(key)
                return False
            if n == len(entry.tokens):  # the old entry is a prefix of the new one: it is subsumed
                self._drop(key)
        self._entries[self._next_key] = PrefixEntry(tokens, keys, values, nbytes)
        self._next_key += 1
        self.bytes += nbytes
        self.inserted += 1
        while self.bytes > self.budget_bytes and self._entries:
            self._drop(next(iter(self._entries)))
            self.evicted += 1
        return True

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def clear(self) -> int:
        """Forget every entry (weights changed, or ``/flush_cache``); returns how many there were."""
        n = len(self._entries)
        self._entries.clear()
        self.bytes = 0
        return n

    def stats(self) -> dict[str, int]:
        return {
            "prefix_cache_entries": len(self._entries),
            "prefix_cache_bytes": self.bytes,
            "prefix_cache_budget_bytes": self.budget_bytes,
            "prefix_cache_lookups": self.lookups,
            "prefix_cache_hits": self.hits,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_inserted": self.inserted,
            "prefix_cache_evicted": self.evicted,
        }
