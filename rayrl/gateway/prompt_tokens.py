"""Prompt text -> token ids, exactly as ``tokenizer(text, add_special_tokens=False)``, without retokenizing
what the gateway has tokenized before.

Why: tokenizing is most of a call's work in the gateway (bench/gateway_profile.py), and most prompt text
repeats: every episode of a run sends the same system prompt and tool schemas (thousands of tokens for
agent CLIs), every sample of a GRPO group the same task, every turn the same history.

How, and why it is exact: a fast (Rust) tokenizer first cuts the text at its added tokens (``<|im_start|>``,
``<|im_end|>``...), then normalizes, pre-tokenizes and encodes each piece between them on its own. So the
ids of a rendered prompt are the ids of its pieces, with the added tokens' ids between them, and each
piece's ids can be kept and reused. This holds only when nothing crosses a cut: no added token strips the
whitespace beside it (``lstrip``/``rstrip``) or must stand alone as a word (``single_word``), and no
normalizer or pre-tokenizer step looks at the whole text (Metaspace's "prepend to the first piece only",
a normalizer that rewrites what an added token would match). :class:`PromptTokenizer` checks this from
the tokenizer's own description and with probes at start; a tokenizer that does not qualify is called
whole every time (through its Rust backend when it has one, without transformers' wrappers around it).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

CACHE_CHARS = 8_000_000  # text kept with its ids (about 2x this in bytes); least recently used goes first
MAX_PIECE_CHARS = 262_144  # longer pieces are tokenized every time (a one-off tool output, say)
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}
_PROBES = (
    "hello world",
    "  leading and trailing spaces  ",
    "line one\nline two\n\n\ttabbed 123 4567 ünïcödé 漢字 emoji 🙂",
    "x",
    "\n",
    "don't stop; it's fine",
)


def _pre_tokenizer_is_local(cfg: Any) -> bool:
    """Whether a pre-tokenizer (its JSON description) treats each piece the same wherever it stands."""
    if cfg is None:
        return True
    kind = cfg.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_is_local(p) for p in cfg.get("pretokenizers", []))
    if kind == "ByteLevel":
        return not cfg.get("add_prefix_space", False)
    return kind in _SAFE_PRE_TOKENIZERS


def _description(part: Any) -> Any:
    """The JSON description of a backend normalizer or pre-tokenizer, as ``Tokenizer.to_str()`` gives it,
    from that part alone (its pickled state): the whole tokenizer's, vocabulary and merges included, took
    0.2-0.5 s to write and parse, at every gateway start."""
    return None if part is None else json.loads(part.__getstate__())


def _normalizer_is_identity(cfg: Any) -> bool:
    if cfg is None:
        return True
    return cfg.get("type") == "Sequence" and all(_normalizer_is_identity(n) for n in cfg.get("normalizers", []))


class PromptTokenizer:
    """``encode(text)``: the ids ``tokenizer(text, add_special_tokens=False)`` gives, as int32, reusing the
    ids of pieces seen before when the tokenizer allows it (module docstring). Thread-safe: the gateway
    tokenizes large requests in worker threads."""

    def __init__(self, tokenizer: Any, cache_chars: int = CACHE_CHARS) -> None:
        self.tokenizer = tokenizer
        self.cache_chars = cache_chars
        self._backend = self._backend_of(tokenizer)
        self._patterns: list[re.Pattern[str]] = []  # added tokens matched on the raw text, then the rest
        self._added: dict[str, np.ndarray] = {}
        self._cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cached_chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        if self._backend is not None and self._pieces_are_independent():
            tokens = self._backend.get_added_tokens_decoder()
            self._added = {tok.content: np.asarray([tid], dtype=np.int32) for tid, tok in tokens.items()}
            # the Rust tokenizer cuts at non-normalized added tokens first, then (after normalizing, here
            # the identity) at normalized ones; each pass takes the leftmost, then longest, match
            for normalized in (False, True):
                group = sorted((t.content for t in tokens.values() if bool(t.normalized) == normalized),
                               key=len, reverse=True)
                if group:
                    self._patterns.append(re.compile("(" + "|".join(re.escape(t) for t in group) + ")"))
            if self._patterns and not self._probes_agree():
                self._patterns = []

    @staticmethod
    def _backend_of(tokenizer: Any) -> Any:
        """The Rust tokenizer, when calling it directly gives what ``tokenizer(...)`` gives."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "split_special_tokens", False):
            return None
        if getattr(backend, "encode_special_tokens", False):
            return None
        return backend

    def _pieces_are_independent(self) -> bool:
        try:
            normalizer = _description(self._backend.normalizer)
            pre_tokenizer = _description(self._backend.pre_tokenizer)
        except (ValueError, TypeError, AttributeError):
            return False
        for tok in self._backend.get_added_tokens_decoder().values():
            if tok.lstrip or tok.rstrip or tok.single_word:
                return False
        return _normalizer_is_identity(normalizer) and _pre_tokenizer_is_local(pre_tokenizer)

    def _probes_agree(self) -> bool:
        """Piecewise ids equal whole-text ids on texts that mix added tokens with hard cases."""
        added = sorted(self._added)[:8]
        texts = list(_PROBES) + [a.join(_PROBES) for a in added] + [a + b for a in added for b in added]
        texts += ["".join(added), added[0] + " " + added[-1] + " tail"] if added else []
        for text in texts:
            whole = self._backend.encode(text, add_special_tokens=False).ids
            if self._split_encode(text, cache=False).tolist() != whole:
                return False
        return True

    @property
    def cached(self) -> bool:
        """Whether pieces are reused (False: every text is tokenized whole)."""
        return bool(self._patterns)

    def encode(self, text: str) -> np.ndarray:
        if self._patterns:
            return self._split_encode(text, cache=True)
        if self._backend is not None:
            return np.asarray(self._backend.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        ids = self.tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return np.asarray(ids, dtype=np.int32)

    def _split_encode(self, text: str, cache: bool) -> np.ndarray:
        pieces: list[str | np.ndarray] = []  # text between added tokens, and the added tokens' ids
        self._cut(text, 0, pieces)
        parts = self._pieces_ids(pieces, cache)
        if not parts:
            return np.zeros(0, dtype=np.int32)
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def _cut(self, text: str, level: int, pieces: list[str | np.ndarray]) -> None:
        """Append ``text`` cut at its added tokens of pass ``level`` and on: the pieces between them (str)
        and the tokens' ids."""
        if level == len(self._patterns):
            pieces.append(text)
            return
        # the pattern has one group: split() alternates text between tokens (maybe empty) and a token
        last = level + 1 == len(self._patterns)
        for i, part in enumerate(self._patterns[level].split(text)):
            if i % 2:
                pieces.append(self._added[part])
            elif part:
                if last:
                    pieces.append(part)
                else:
                    self._cut(part, level + 1, pieces)

    def _pieces_ids(self, pieces: list[str | np.ndarray], cache: bool) -> list[np.ndarray]:
        """The ids of every piece: cached ones looked up under one taking of the lock (a prompt is
        mostly cached pieces), the others tokenized outside it (and cached)."""
        parts: list[Any] = list(pieces)
        missing: list[int] = []
        with self._lock:
            for at, piece in enumerate(pieces):
                if isinstance(piece, np.ndarray):
                    continue
                ids = self._cache.get(piece) if cache and len(piece) <= MAX_PIECE_CHARS else None
                if ids is None:
                    missing.append(at)
                else:
                    self._cache.move_to_end(piece)
                    self.hits += 1
                    parts[at] = ids
        for at in missing:
            parts[at] = self._piece(pieces[at], cache)  # type: ignore[arg-type]
        return parts

    def _piece(self, piece: str, cache: bool) -> np.ndarray:
        """A piece not in the cache: tokenized, and cached when ``cache`` and not too long."""
        ids = np.asarray(self._backend.encode(piece, add_special_tokens=False).ids, dtype=np.int32)
        if cache and len(piece) <= MAX_PIECE_CHARS:
            ids.flags.writeable = False  # shared by every prompt that holds the piece
            with self._lock:
                self.misses += 1
                if piece not in self._cache:
                    self._cache[piece] = ids
                    self._cached_chars += len(piece)
                while self._cached_chars > self.cache_chars and self._cache:
                    old, _ = self._cache.popitem(last=False)
                    self._cached_chars -= len(old)
        return ids
