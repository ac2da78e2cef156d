"""Sampling parameters (SGLang's ``sampling_params`` semantics) and batched token sampling.

Parsing lives here so the HTTP server and the in-process engine reject the same bad values with the same
messages (a ``ValueError`` becomes a 400). Sampling runs on the whole batch with tensor ops: one
``log_softmax`` for the returned log-probs, and only the filters some row actually asked for (a batch of
greedy rows costs one ``argmax``). Per-row Python work is limited to rows with a seed, a penalty or a
logit bias.

Log-probs are always taken from the RAW model distribution: ``log_softmax(logits)`` before temperature,
top-p/top-k/min-p, penalties or biases. That is the distribution the trainer recomputes, so importance
ratios compare like with like; a sampler-adjusted log-prob would differ for every temperature != 1.

Isolation: the batch is one tensor, so one request must never be able to break the step for the others.
Parsing bounds every value to what the sampler can hold (a seed a ``torch.Generator`` takes, floats
float32 can represent, ``top_k`` a tensor can hold). What parsing cannot foresee is caught per row:
:meth:`BatchSampler.sample` reports rows whose logits are NaN or infinite after that row's own
penalties and biases, or whose distribution has nothing left to sample from, and rows whose own
adjustment raised; the engine then fails those requests alone. Every operation is row-wise, so such a
row never changes another row's token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

GREEDY_EPS = 1e-6  # temperature below this means greedy, as in SGLang
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # sampling runs in float32
TOP_K_ALL = 1 << 30  # top_k at or above the vocabulary: every token (SGLang stores -1 the same way)
MAX_STOP_STRINGS = 64  # every stop string is looked for after every step: bounded work per request
MAX_STOP_CHARS = 1024

_UNSUPPORTED_IF_SET = ("json_schema", "regex", "ebnf", "stop_regex", "custom_params")
_ACCEPTED_AND_IGNORED = ("spaces_between_special_tokens", "stream_interval")


@dataclass
class SamplingParams:
    """One request's sampling parameters, validated. Field meanings follow SGLang's SamplingParams."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None, vocab_size: int | None = None) -> "SamplingParams":
        """Validate a JSON ``sampling_params`` object; ``None`` values mean "use the default".

        Raises ValueError naming the field, so the server can answer 400 instead of failing later
        inside the decode loop where one bad request would hurt the whole batch.
        """
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ValueError("sampling_params must be an object")
        known = set(cls.__dataclass_fields__) | set(_UNSUPPORTED_IF_SET) | set(_ACCEPTED_AND_IGNORED)
        unknown = sorted(k for k in raw if k not in known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {', '.join(map(str, unknown))}")
        for key in _UNSUPPORTED_IF_SET:
            if raw.get(key) not in (None, "", {}, []):
                raise ValueError(f"sampling_params.{key} is not supported by the CPU engine")
        p = cls()
        get = {k: v for k, v in raw.items() if v is not None}
        p.max_new_tokens = _int(get, "max_new_tokens", p.max_new_tokens, lo=0)
        p.min_new_tokens = _int(get, "min_new_tokens", p.min_new_tokens, lo=0)
        if p.min_new_tokens > p.max_new_tokens:
            raise ValueError("sampling_params.min_new_tokens must be at most max_new_tokens")
        p.temperature = _float(get, "temperature", p.temperature, lo=0.0, hi=FLOAT32_MAX)
        p.top_p = _float(get, "top_p", p.top_p, lo=0.0, hi=1.0, lo_open=True)
        p.top_k = _int(get, "top_k", p.top_k, lo=-1)
        if p.top_k == 0:
            raise ValueError("sampling_params.top_k must be -1 (disabled) or at least 1")
        p.top_k = min(p.top_k, TOP_K_ALL)
        p.min_p = _float(get, "min_p", p.min_p, lo=0.0, hi=1.0)
        p.frequency_penalty = _float(get, "frequency_penalty", 0.0, lo=-2.0, hi=2.0)
        p.presence_penalty = _float(get, "presence_penalty", 0.0, lo=-2.0, hi=2.0)
        p.repetition_penalty = _float(get, "repetition_penalty", 1.0, lo=0.0, hi=2.0, lo_open=True)
        p.n = _int(get, "n", 1, lo=1)
        stop = get.get("stop", [])
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ValueError("sampling_params.stop must be a string or a list of strings")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise ValueError(f"sampling_params.stop: at most {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        p.stop = [s for s in stop if s]
        ids = get.get("stop_token_ids", [])
        if not isinstance(ids, list) or not all(is_int(i) for i in ids):
            raise ValueError("sampling_params.stop_token_ids must be a list of integers")
        if vocab_size is not None and any(not 0 <= i < vocab_size for i in ids):
            raise ValueError(f"sampling_params.stop_token_ids must be in [0, {vocab_size})")
        p.stop_token_ids = [int(i) for i in ids]
        for key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if key in get:
                if not isinstance(get[key], bool):
                    raise ValueError(f"sampling_params.{key} must be a boolean")
                setattr(p, key, get[key])
        bias = get.get("logit_bias", {})
        if not isinstance(bias, Mapping):
            raise ValueError("sampling_params.logit_bias must be an object {token_id: bias}")
        p.logit_bias = {}
        for k, v in bias.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"sampling_params.logit_bias: key {k!r} is not a token id") from None
            if vocab_size is not None and not 0 <= tok < vocab_size:
                raise ValueError(f"sampling_params.logit_bias: token id {tok} is outside the vocabulary")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= FLOAT32_MAX:
                raise ValueError("sampling_params.logit_bias values must be finite float32 numbers")
            p.logit_bias[tok] = float(v)
        if "sampling_seed" in get:
            p.sampling_seed = _int(get, "sampling_seed", 0, lo=SEED_MIN, hi=SEED_MAX)
        return p


def is_int(value: Any) -> bool:
    """An int that is not a bool (JSON true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int(raw: Mapping[str, Any], key: str, default: int, lo: int | None = None, hi: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not is_int(value):
        raise ValueError(f"sampling_params.{key} must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"sampling_params.{key} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"sampling_params.{key} must be <= {hi}, got {value}")
    return int(value)


def _float(
    raw: Mapping[str, Any],
    key: str,
    default: float,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"sampling_params.{key} must be a finite number, got {value!r}")
    value = float(value)
    if lo is not None and (value < lo or (lo_open and value == lo)):
        raise ValueError(f"sampling_params.{key} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"sampling_params.{key} must be <= {hi}, got {value}")
    return value


class RowState:
    """Per-request sampling state that lives across steps: its seeded generator and token counts."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], vocab_size: int) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if params.sampling_seed is not None:
            self.generator = torch.Generator().manual_seed(params.sampling_seed)
        self.counts: torch.Tensor | None = None  # output-token counts (frequency/presence penalties)
        self.seen: torch.Tensor | None = None  # prompt + output tokens (repetition penalty)
        if params.frequency_penalty or params.presence_penalty:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            if len(prompt_ids):
                self.seen[torch.as_tensor(list(prompt_ids), dtype=torch.long)] = True
        self.bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        self.bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)

    def observe(self, token: int) -> None:
        """Record a generated token (only rows with penalties keep counts)."""
        if self.counts is not None:
            self.counts[token] += 1.0
        if self.seen is not None:
            self.seen[token] = True

    def adjust(self, logits: torch.Tensor) -> None:
        """Apply this row's penalties and logit bias to its float32 logits, in place."""
        p = self.params
        if self.seen is not None:
            sel = logits[self.seen]
            logits[self.seen] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
        if self.counts is not None:
            logits -= self.counts * p.frequency_penalty + (self.counts > 0).float() * p.presence_penalty
        if len(self.bias_ids):
            logits[self.bias_ids] += self.bias_values


class BatchSampler:
    """Samples one token per row of a batch; rebuilt only when the batch's rows change.

    ``rows`` are the requests' :class:`RowState` in batch order; ``blocked`` (from the engine) lists
    per-row token ids that must not be sampled this step (stop tokens before ``min_new_tokens``).
    """

    def __init__(self, rows: Sequence[RowState]) -> None:
        self.rows = list(rows)
        params = [r.params for r in self.rows]
        n = len(params)
        self.all_greedy = all(p.greedy for p in params)
        self.greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool)
        temps = [1.0 if p.greedy else p.temperature for p in params]
        self.temperature = torch.tensor(temps, dtype=torch.float32).view(n, 1)
        self.any_temperature = any(t != 1.0 for t in temps)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).view(n, 1)
        self.any_top_p = any(p.top_p < 1.0 and not p.greedy for p in params)
        self.top_k = torch.tensor(
            [p.top_k if p.top_k > 0 and not p.greedy else 1 << 30 for p in params], dtype=torch.long
        ).view(n, 1)
        self.any_top_k = any(p.top_k > 0 and not p.greedy for p in params)
        self.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).view(n, 1)
        self.any_min_p = any(p.min_p > 0 and not p.greedy for p in params)
        self.adjusted_rows = [i for i, r in enumerate(self.rows) if r.params.penalized]
        self.seeded_rows = [
            i for i, r in enumerate(self.rows) if r.generator is not None and not r.params.greedy
        ]

    def sample(
        self,
        logits: torch.Tensor,
        blocked: Sequence[tuple[int, torch.Tensor]] = (),
        default_generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, str]]:
        """Return (token ids [B] int64, raw log-probs of those tokens [B] float32, failed rows).

        ``failed`` maps the index of each row that could not be sampled to the reason; such a row gets
        token 0 as a placeholder, and the caller fails its request alone. The other rows are sampled
        exactly as they would be without it.
        """
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        failed: dict[int, str] = {}
        if self.adjusted_rows or blocked:
            logits = logits.clone()
            for i in self.adjusted_rows:
                try:
                    self.rows[i].adjust(logits[i])
                except Exception as err:  # this row's penalties or bias: its failure alone
                    failed[i] = f"applying penalties/logit_bias failed: {type(err).__name__}: {err}"
            for i, ids in blocked:
                logits[i, ids] = float("-inf")
        # one reduction finds NaN anywhere in a row, +inf, and rows with every token at -inf
        bad = ~torch.isfinite(logits.amax(dim=-1))
        if self.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens, unsampleable = self._sample_stochastic(logits, default_generator)
            bad |= unsampleable
        if failed or bool(bad.any()):
            for i in bad.nonzero().view(-1).tolist():
                failed.setdefault(i, "the row's logits are not finite after its sampling parameters "
                                     "(NaN, infinity, or no token left to sample)")
            tokens = tokens.masked_fill(torch.tensor([i in failed for i in range(len(tokens))]), 0)
        return tokens, raw_logprobs.gather(1, tokens.view(-1, 1)).view(-1), failed

    def _sample_stochastic(
        self, logits: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled tokens, and the rows whose tempered, filtered distribution has no finite positive mass."""
        greedy_tokens = logits.argmax(dim=-1)
        scaled = logits / self.temperature if self.any_temperature else logits
        if self.any_top_k or self.any_top_p:
            scaled = self._top_k_top_p(scaled)
        probs = torch.softmax(scaled, dim=-1)
        if self.any_min_p:
            cutoff = probs.max(dim=-1, keepdim=True).values * self.min_p
            probs = probs.masked_fill(probs < cutoff, 0.0)
        # Inverse CDF: one uniform per row, located in the row's cumulative distribution. It needs B random
        # numbers where an exponential race needs B x vocab (that alone cost 6 ms of a 35 ms decode step
        # at batch 8). Seeded rows draw their uniform from their own generator, so their samples do not
        # depend on which other requests share the batch. A token of probability 0 is never picked: its
        # cumulative value equals its predecessor's and searchsorted(right=True) skips it.
        cdf = probs.cumsum(dim=-1)
        uniform = torch.rand(probs.shape[0], 1, generator=generator)
        for i in self.seeded_rows:
            uniform[i] = torch.rand(1, generator=self.rows[i].generator)
        total = cdf[:, -1]
        unsampleable = ~(torch.isfinite(total) & (total > 0)) & ~self.greedy
        sampled = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).view(-1)
        sampled = sampled.clamp_(max=probs.shape[-1] - 1)
        return torch.where(self.greedy, greedy_tokens, sampled), unsampleable

    def _top_k_top_p(self, scaled: torch.Tensor) -> torch.Tensor:
        if self.any_top_k and not self.any_top_p:
            k = int(self.top_k.clamp(max=scaled.shape[-1]).max())
            values = scaled.topk(k, dim=-1).values
            kth = values.gather(1, (self.top_k.clamp(max=k) - 1))
            kth = kth.masked_fill(self.top_k >= scaled.shape[-1], float("-inf"))  # rows without top_k
            return scaled.masked_fill(scaled < kth, float("-inf"))
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        ranks = torch.arange(scaled.shape[-1]).view(1, -1)
        remove = ranks >= self.top_k
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each token
        remove |= before > self.top_p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        return torch.empty_like(scaled).scatter_(1, order, sorted_logits)
