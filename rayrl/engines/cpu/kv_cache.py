"""The running batch's KV cache: left-padded rows in persistent buffers that requests join and leave.

Layout: per layer, keys and values live in buffers ``[row_capacity, kv_heads, col_capacity, head_dim]``;
rows ``[0, rows)`` are the running requests, columns ``[0, length)`` are valid, and every row is
right-aligned (left padding), so one decode step appends one column for all rows. A layer's keys and
values are the two halves of one ``[2, rows, heads, cols, dim]`` buffer (``kv_buffers``), so a decode
step writes both with one copy; where every layer's buffer has the same shape (always, for the models the
lean decode path serves) they are the layers of one ``[layers, 2, rows, heads, cols, dim]`` buffer
(``all_kv``), so a decode step takes its column and attention views for all layers at once. A boolean
``mask [row_capacity, col_capacity]`` marks real tokens.

Why this shape: a decode step writes its column in place and attends over a view, so no step copies the
cache (transformers' DynamicCache concatenates, copying everything every step). Joins and leaves touch
only the rows that change: a joining request is written into free rows (existing rows move only when
the newcomer's prompt is longer than the batch's length), a leaving request's row is filled by the last
row (swap-remove). Buffers are reused across events and grow by chunks; fresh allocations are costly
on CPU (page faults), so the engine avoids them on the hot path.

Decode attention (:func:`batch_attention`, registered with transformers as ``rayrl_cpu``): the query
heads sharing a KV head are handed to SDPA as several queries of that head, so grouped-query attention
never materialises repeated keys (``repeat_kv`` would copy the cache once per layer per step). The model
receives ready 4-D boolean masks (True = attend), which transformers passes through unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer

ATTENTION_NAME = "rayrl_cpu"
GROW_MIN = 128  # columns added when the buffers are full (at least), so growth copies are rare


def batch_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for the CPU engine; same contract as transformers' ``sdpa_attention_forward``.

    ``query`` ``[B, Hq, q, D]``; ``key``/``value`` ``[B, Hkv, L, D]`` (views into cache buffers);
    ``attention_mask`` ``[B, 1, q, L]`` boolean or None. Returns ``[B, q, Hq, D]``.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len == 1 and q_heads % kv_heads == 0:
        # Decode: the group's query heads become `group` queries of one KV head (no causal mask needed,
        # they all sit at the same position), so SDPA reads the shared keys once.
        group = q_heads // kv_heads
        q = query.reshape(batch, kv_heads, group, dim)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(batch, q_heads, 1, dim).transpose(1, 2), None
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        scale=scaling,
        is_causal=attention_mask is None and q_len > 1,
        enable_gqa=kv_heads != q_heads,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, batch_attention)


def prefill_mask(mask: torch.Tensor) -> torch.Tensor:
    """4-D boolean attention mask for a left-padded prefill: causal AND key-is-real.

    Every query also attends to itself, so a padding query never has an empty row (SDPA would return
    NaN there, and NaN values in the cache would poison later attention: 0 * NaN = NaN).
    """
    length = mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril_()
    full = causal.view(1, 1, length, length) & mask.view(-1, 1, 1, length)
    return full | torch.eye(length, dtype=torch.bool).view(1, 1, length, length)


def _grow(needed: int) -> int:
    return needed + max(GROW_MIN, needed // 4)


@dataclass
class KVBlock:
    """Rows to join the batch: per-layer keys/values ``[b, H, L, D]`` and their real-token mask ``[b, L]``."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor


class _BufferLayer(DynamicLayer):
    """One layer's keys/values in a shared buffer; ``update`` writes in place and returns views."""

    def __init__(self, owner: "BatchKV", index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:  # type: ignore[override]
        o = self.owner
        if not o.key_buffers:
            return torch.empty(0)
        return o.key_buffers[self.index][o.window, :, : o.length + o.pending]

    @keys.setter
    def keys(self, value: Any) -> None:  # DynamicLayer.__init__ assigns None; the views are computed
        pass

    @property
    def values(self) -> torch.Tensor:  # type: ignore[override]
        o = self.owner
        if not o.value_buffers:
            return torch.empty(0)
        return o.value_buffers[self.index][o.window, :, : o.length + o.pending]

    @values.setter
    def values(self, value: Any) -> None:
        pass

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: Optional[dict[str, Any]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.owner
        start, end = o.length, o.length + key_states.shape[2]
        o.key_buffers[self.index][o.window, :, start:end] = key_states
        o.value_buffers[self.index][o.window, :, start:end] = value_states
        o.pending = end - o.length
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.owner.length + cache_position.shape[0], 0


class BatchKV:
    """The running batch's cache, as a transformers ``DynamicCache`` (``.cache``) over shared buffers.

    The engine calls :meth:`decode_mask` (or :meth:`step_mask`) before a decode forward and
    :meth:`commit` after it; :meth:`append` adds prefilled rows, :meth:`remove` drops finished rows.
    A decode forward may run for part of the rows (:meth:`rows_only`): the cache views the model sees
    are then those rows', which is how a batch whose forward failed is retried in parts.
    """

    def __init__(self, num_layers: int, max_rows: int) -> None:
        self.num_layers = num_layers
        self.max_rows = max_rows
        self.kv_buffers: list[torch.Tensor] = []  # per layer [2, rows, heads, cols, dim]: keys, values
        self.all_kv: Optional[torch.Tensor] = None  # [layers, 2, rows, heads, cols, dim] when layers are alike
        self.key_buffers: list[torch.Tensor] = []  # views: kv_buffers[i][0]
        self.value_buffers: list[torch.Tensor] = []  # views: kv_buffers[i][1]
        self.mask_buffer = torch.zeros(0, 0, dtype=torch.bool)
        self.rows = 0
        self.length = 0
        self.pending = 0  # columns written by the current forward, not yet committed
        self._part: Optional[slice] = None  # rows the current forward runs for (None: all)
        self._dense: Optional[bool] = None  # no running row has padding (None: not known since a change)
        self.cache = DynamicCache()
        self.cache.layers = [_BufferLayer(self, i) for i in range(num_layers)]
        self.cache.layer_class_to_replicate = None

    # ------------------------------------------------------------------ sizes

    @property
    def row_capacity(self) -> int:
        return self.mask_buffer.shape[0]

    @property
    def col_capacity(self) -> int:
        return self.mask_buffer.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        """Real-token mask of the running rows ``[rows, length]`` (a view)."""
        return self.mask_buffer[: self.rows, : self.length]

    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.key_buffers) + sum(b.nbytes for b in self.value_buffers)

    def _reserve(self, rows: int, cols: int, like: Optional[KVBlock] = None) -> None:
        """Make the buffers at least ``rows x cols`` (one copy of the live region when they grow)."""
        if rows <= self.row_capacity and cols <= self.col_capacity:
            return
        # All rows up front: untouched pages of an empty tensor cost no memory, and row growth would
        # otherwise copy the cache at every join.
        new_rows = max(rows, self.row_capacity, self.max_rows)
        new_cols = max(_grow(cols), self.col_capacity) if cols > self.col_capacity else self.col_capacity
        refs = self.key_buffers or (like.keys if like is not None else [])
        if not refs:
            raise ValueError("the first append needs a block to size the buffers")
        r, c = self.rows, self.length
        shapes = {(refs[i].shape[1], refs[i].shape[3]) for i in range(self.num_layers)}
        if len(shapes) == 1:  # every layer alike: one buffer, so a decode step takes its views once
            heads, dim = shapes.pop()
            self.all_kv = torch.empty((self.num_layers, 2, new_rows, heads, new_cols, dim), dtype=refs[0].dtype,
                                      device=refs[0].device)
            new_kv = list(self.all_kv.unbind(0))
        else:
            self.all_kv = None
            new_kv = [torch.empty((2, new_rows, refs[i].shape[1], new_cols, refs[i].shape[3]), dtype=refs[i].dtype,
                                  device=refs[i].device) for i in range(self.num_layers)]
        if self.kv_buffers and r and c:
            for i, kv in enumerate(new_kv):
                kv[:, :r, :, :c] = self.kv_buffers[i][:, :r, :, :c]
        self.kv_buffers = new_kv
        self.key_buffers = [kv[0] for kv in new_kv]
        self.value_buffers = [kv[1] for kv in new_kv]
        mask = torch.zeros(new_rows, new_cols, dtype=torch.bool)
        mask[:r, :c] = self.mask_buffer[:r, :c]
        self.mask_buffer = mask

    @property
    def window(self) -> slice:
        """The rows a forward runs for: all running rows, or the part :meth:`rows_only` set."""
        return self._part if self._part is not None else slice(0, self.rows)

    @contextlib.contextmanager
    def rows_only(self, rows: slice) -> Iterator[None]:
        """Within the block, the cache views (``.cache``) cover rows ``rows`` only."""
        self._part = rows
        try:
            yield
        finally:
            self._part = None

    # ------------------------------------------------------------------ decode

    def decode_mask(self) -> torch.Tensor:
        """Mark the next column real for every row and return the step's 4-D mask (a view)."""
        self._reserve(self.rows, self.length + 1)
        self.mask_buffer[: self.rows, self.length] = True
        return self.mask_buffer[: self.rows, None, None, : self.length + 1]

    def step_mask(self) -> Optional[torch.Tensor]:
        """:meth:`decode_mask`, or None when no running row has padding: attention over every column is
        then what the mask would say, and SDPA runs without one. Whether rows are padded changes only
        when rows join or leave, so it is worked out once after such a change."""
        mask = self.decode_mask()
        if self._dense is None:
            self._dense = bool(self.mask_buffer[: self.rows, : self.length].all())
        return None if self._dense else mask

    def commit(self, columns: Optional[int] = None) -> None:
        """Accept the columns the last forward wrote (``columns``: written directly into the buffers)."""
        self.length += self.pending if columns is None else columns
        self.pending = 0

    def clear(self) -> None:
        """Drop every row (buffers are kept for reuse)."""
        self.rows = self.length = self.pending = 0
        self._dense = None

    # ------------------------------------------------------------------ join / leave

    def append(self, block: KVBlock, rows: Optional[torch.Tensor] = None) -> None:
        """Add prefilled rows (optionally a subset) after the running rows."""
        mask = block.mask if rows is None else block.mask.index_select(0, rows)
        n = mask.shape[0]
        if n == 0:
            return
        real = mask.any(dim=0)
        start = int(real.to(torch.int8).argmax()) if bool(real.any()) else mask.shape[1]
        span = mask.shape[1] - start  # the block's length without all-padding leading columns
        if self.rows == 0:
            self.length = 0
        shift = max(0, span - self.length)  # existing rows move right when the newcomer is longer
        new_length = self.length + shift
        self._reserve(self.rows + n, new_length + 1, like=block)
        r0, r1, pad = self.rows, self.rows + n, new_length - span
        if shift and self.rows:
            self._shift_right(shift)
        pad_cols = ~mask[:, None, start:, None]  # padding inside the block's span
        for i in range(self.num_layers):
            for dst, src in ((self.key_buffers[i], block.keys[i]), (self.value_buffers[i], block.values[i])):
                if rows is not None:
                    src = src.index_select(0, rows)
                # Padding must be finite: attention weighs it by exactly 0, but 0 * NaN is NaN.
                dst[r0:r1, :, :pad].zero_()
                dst[r0:r1, :, pad:new_length] = src[:, :, start:].masked_fill(pad_cols, 0)
        self.mask_buffer[r0:r1, :pad] = False
        self.mask_buffer[r0:r1, pad:new_length] = mask[:, start:]
        self.rows, self.length = r1, new_length
        self._dense = None

    def _shift_right(self, shift: int) -> None:
        r, c = self.rows, self.length
        for buffers in (self.key_buffers, self.value_buffers):
            for buf in buffers:
                buf[:r, :, shift : shift + c] = buf[:r, :, :c].clone()
                buf[:r, :, :shift].zero_()
        self.mask_buffer[:r, shift : shift + c] = self.mask_buffer[:r, :c].clone()
        self.mask_buffer[:r, :shift] = False

    def remove(self, drop: Sequence[int]) -> list[int]:
        """Remove rows ``drop``; returns ``order`` with ``order[new_row] = old_row`` for the survivors.

        Holes below the new row count are filled with survivors from above it (swap-remove), so only
        those rows are copied. Leading columns that became padding in every row are trimmed when they
        are a large share of the length (attention cost), which costs one copy of the live region.
        """
        dropped = set(drop)
        survivors = [i for i in range(self.rows) if i not in dropped]
        keep = len(survivors)
        holes = [i for i in sorted(dropped) if i < keep]
        movers = [i for i in survivors if i >= keep]
        order = list(range(keep))
        for h, m in zip(holes, movers):
            order[h] = m
        if holes:
            dst = torch.tensor(holes, dtype=torch.long)
            src = torch.tensor(movers, dtype=torch.long)
            c = self.length
            for buffers in (self.key_buffers, self.value_buffers):
                for buf in buffers:
                    buf[dst, :, :c] = buf[src, :, :c]
            self.mask_buffer[dst, :c] = self.mask_buffer[src, :c]
        self.rows = keep
        self._dense = None
        if keep == 0:
            self.length = 0
        else:
            self._trim()
        return order

    def _trim(self) -> None:
        real = self.mask.any(dim=0)
        start = int(real.to(torch.int8).argmax())
        if start < max(32, self.length // 4):
            return  # not worth a copy
        r, c = self.rows, self.length
        for buffers in (self.key_buffers, self.value_buffers):
            for buf in buffers:
                buf[:r, :, : c - start] = buf[:r, :, start:c].clone()
        self.mask_buffer[:r, : c - start] = self.mask_buffer[:r, start:c].clone()
        self.length = c - start
