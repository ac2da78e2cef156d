"""Validation of request fields shared by the three wire APIs, and the canonical turn request.

Each API module turns its request body into a :class:`TurnSpec`: canonical OpenAI-shape messages and
tools plus sampling settings. Everything after that (rendering, the engine call, parsing, recording)
is API-independent, which is what lets routing and cumulative token mode work across APIs. Bad values
raise :class:`RequestError` (HTTP 400 naming the field), never anything else.

Every number that reaches the engine is checked against the range an engine can hold, not only its
type: a seed in int64 (an ``int`` alone let 2^64 through to the engine, whose batch it broke), token
counts and ``top_k`` in int32, ``logit_bias`` ids non-negative with values in [-100, 100] (OpenAI's
range), penalties in [-2, 2]. The gateway is the first line; the engine checks again (its own ranges,
rayrl/engines/cpu/sampling.py) and fails a request that still breaks alone.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from rayrl.gateway.errors import RequestError
from rayrl.gateway.tools import AUTO, ToolChoice

MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024
INT32_MAX = 2**31 - 1  # token counts and top_k: what an engine stores them in
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64, as OpenAI's API takes it
LOGIT_BIAS_MAX = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
_SURROGATE = re.compile("[\ud800-\udfff]")


def number(body: dict[str, Any], key: str, lo: float, hi: float, default: float | None) -> float | None:
    """``body[key]`` as a float in [lo, hi]; absent or null gives ``default``."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{key} must be a number in [{lo}, {hi}]", param=key)
    if isinstance(value, float) and not math.isfinite(value) or not lo <= value <= hi:
        raise RequestError(f"{key} must be a number in [{lo}, {hi}]", param=key)
    return float(value)


def integer(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    """``body[key]`` as an int in [lo, hi], or None when absent."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RequestError(f"{key} must be an integer in [{lo}, {hi}]", param=key)
    return value


def positive_int(body: dict[str, Any], key: str) -> int | None:
    """``body[key]`` as an int in [1, 2^31 - 1], or None when absent."""
    return integer(body, key, 1, INT32_MAX)


def boolean(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be a boolean", param=key)
    return value


def string(body: dict[str, Any], key: str, default: str | None = None) -> str | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise RequestError(f"{key} must be a string", param=key)
    return value


def stop_list(value: Any, key: str = "stop") -> list[str]:
    """A stop field: a string or a list of at most 16 strings (empty strings dropped)."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if (isinstance(items, list) and len(items) <= MAX_STOP_SEQUENCES
            and all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in items)):
        return [s for s in items if s]
    raise RequestError(f"{key} must be a string or a list of at most {MAX_STOP_SEQUENCES} strings of at most "
                       f"{MAX_STOP_CHARS} characters", param=key)


def seed(body: dict[str, Any]) -> int | None:
    return integer(body, "seed", SEED_MIN, SEED_MAX)


def logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token id (a decimal string) -> bias in [-100, 100]. Ids are checked
    against the vocabulary when the prompt is built (turns.TurnRunner), where the tokenizer is known."""
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestError(f"logit_bias must be an object of at most {MAX_LOGIT_BIAS_ENTRIES} token ids",
                           param="logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise RequestError(f"logit_bias: key {key[:20]!r} is not a token id", param="logit_bias")
        value = raw[key]
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not -LOGIT_BIAS_MAX <= value <= LOGIT_BIAS_MAX):
            raise RequestError(f"logit_bias[{key}] must be a number in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]",
                               param="logit_bias")
        out[int(key)] = float(value)
    return out


def lone_surrogate_path(value: Any) -> str | None:
    """Where the first string (or key) holding a lone UTF-16 surrogate is, e.g. ``messages[0].content``.

    JSON may escape one (``"\\ud800"``) but it is not text: no tokenizer takes it. None when there is
    none. Iterative, so a deep body cannot exhaust the stack.
    """
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "body"
        elif isinstance(item, dict):
            for key in reversed(list(item)):
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and _SURROGATE.search(key):
                    return where
                stack.append((item[key], where))
        elif isinstance(item, list):
            stack.extend((item[i], f"{path}[{i}]") for i in reversed(range(len(item))))
    return None


@dataclass
class TurnSpec:
    """One LLM call in canonical form, whichever API it arrived through.

    ``messages``/``tools`` are canonical OpenAI shape (see render.normalize_message); ``max_tokens``
    None means the gateway default. ``tool_choice`` is already applied to ``tools`` (``none`` hides
    them); a choice that forces a call is enforced by the turn runner (turns.py). ``id_prefix`` names tool-call ids
    the way the client's API does
    (``call_`` for OpenAI, ``toolu_`` for Anthropic) so echoed ids look native and still round-trip.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    model: str
    tool_choice: ToolChoice = AUTO
    stream: bool = False
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    want_logprobs: bool = False
    id_prefix: str = "call_"
    prompt_field: str = "messages"  # the field a too-long prompt's error names (Responses: input)

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """SGLang ``sampling_params`` for this turn."""
        params: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "skip_special_tokens": True,
        }
        if self.top_k is not None:
            params["top_k"] = self.top_k
        if self.stop:
            params["stop"] = list(self.stop)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        if self.frequency_penalty is not None:
            params["frequency_penalty"] = self.frequency_penalty
        if self.presence_penalty is not None:
            params["presence_penalty"] = self.presence_penalty
        if self.logit_bias:
            params["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return params
