"""Validation of request fields shared by the three wire APIs, and the canonical turn request.

Each API module turns its request body into a :class:`TurnSpec`: canonical OpenAI-shape messages and
tools plus sampling settings. Everything after that (rendering, the engine call, parsing, recording)
is API-independent, which is what lets routing and cumulative token mode work across APIs. Bad values
raise :class:`RequestError` (HTTP 400 naming the field), never anything else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rayrl.gateway.errors import RequestError
from rayrl.gateway.tools import AUTO, ToolChoice

MAX_STOP_SEQUENCES = 16


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


def positive_int(body: dict[str, Any], key: str) -> int | None:
    """``body[key]`` as an int >= 1, or None when absent."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{key} must be a positive integer", param=key)
    return value


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
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= MAX_STOP_SEQUENCES:
        return [s for s in value if s]
    raise RequestError(f"{key} must be a string or a list of at most {MAX_STOP_SEQUENCES} strings", param=key)


def seed(body: dict[str, Any]) -> int | None:
    value = body.get("seed")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError("seed must be an integer", param="seed")
    return value


@dataclass
class TurnSpec:
    """One LLM call in canonical form, whichever API it arrived through.

    ``messages``/``tools`` are canonical OpenAI shape (see render.normalize_message); ``max_tokens``
    None means the gateway default. ``tool_choice`` is already applied to ``tools`` (``none`` hides
    them); a choice that forces a call is enforced by the turn pipeline. ``id_prefix`` names tool-call ids the way the client's API does
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
    want_logprobs: bool = False
    id_prefix: str = "call_"

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
        return params
