"""Judge rewards: a frozen model grades the episode (``rollout.reward: judge``, ``rollout.judge``).

The judge is any OpenAI-compatible endpoint (SGLang's or vLLM's own server, a hosted API, rayrl's
standalone gateway). Its prompt and parse rules come from the config (a template filled from the task and
the answer; verdict words or a score pattern) or from a function ``(task, result, judge) -> float`` that
calls :meth:`Judge.ask`. Every call goes through one :class:`Judge` per process: at most
``max_concurrent`` in flight, each bounded by ``timeout_s``, retried with backoff when the infrastructure
failed (connection, timeout, 429, 5xx). A judge that still gives no verdict raises
:class:`~rayrl.rl.failures.JudgeError`: the episode is an infrastructure failure (``judge_failed``), left
out of the advantages, never a reward of 0. Each call's tokens and latency land on the episode
(``info["judge_calls"]``) and in the step metrics (``judge/*``).

With ``rollout.judge.serve`` the run starts the judge itself (actors/judge_server.py: engines of its own
behind rayrl/gateway/frozen.py) and hands the workers its endpoint (:func:`served_judge_config`).

verifiers' JudgeRubric asks the same judge (rayrl/environments/verifiers_env.py hands it
:meth:`Judge.async_client`).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import os
import re
import threading
import time
from typing import Any, Callable

from rayrl.config import ConfigError, JudgeConfig, RolloutConfig
from rayrl.rl.failures import JudgeError
from rayrl.types import Task

CALLS: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar("rayrl_judge_calls", default=None)
RETRY_STATUS = (408, 409, 429)  # besides 5xx: the request may succeed if sent again


class Judge:
    """The judge endpoint, bounded and retried; thread-safe (rollout workers run episodes in threads)."""

    def __init__(self, cfg: JudgeConfig) -> None:
        if not (cfg.base_url or cfg.serve):  # serve: the run sets base_url once it started the judge
            raise ConfigError("rollout.judge.base_url: set the judge's OpenAI-compatible endpoint (or "
                              "rollout.judge.serve: a model the run serves as the judge)")
        self.cfg = cfg
        self._slots = threading.BoundedSemaphore(cfg.max_concurrent)
        self._client: Any = None
        self._lock = threading.Lock()

    def _openai(self) -> Any:
        with self._lock:
            if self._client is None:
                import openai

                key = os.environ.get(self.cfg.api_key_env, "") if self.cfg.api_key_env else ""
                self._client = openai.OpenAI(base_url=self.cfg.base_url, api_key=key or "none", max_retries=0,
                                             timeout=self.cfg.timeout_s)
            return self._client

    def ask(self, messages: list[dict[str, Any]], **sampling: Any) -> str:
        """The judge's reply to ``messages``; JudgeError when it gives none (after the retries)."""
        return self.complete(messages, **sampling)[0]

    def complete(self, messages: list[dict[str, Any]], **sampling: Any) -> tuple[str, Any]:
        """``(text, the raw response)``: one judge call, its stats recorded for the episode."""
        import openai

        if not self.cfg.base_url:  # never the SDK's default endpoint
            raise JudgeError(f"the judge rollout.judge.serve names ({self.cfg.serve}) was not started: the run "
                             "starts it and hands the workers its endpoint (actors/judge_server.py)")
        args = {"max_tokens": self.cfg.max_tokens, "temperature": self.cfg.temperature, **sampling}
        if "max_completion_tokens" in sampling:  # the caller's own limit (verifiers' judge rubric sends this one)
            args.pop("max_tokens")
        model = args.pop("model", None) or self.cfg.model
        started, attempts = time.monotonic(), 0
        error = ""
        with self._slots:
            waited = time.monotonic() - started
            while attempts <= self.cfg.max_retries:
                attempts += 1
                t0 = time.monotonic()
                try:
                    resp = self._openai().chat.completions.create(model=model, messages=messages, **args)
                except (openai.APIConnectionError, openai.APITimeoutError) as err:
                    error = f"{type(err).__name__}: {err}"
                except openai.APIStatusError as err:
                    error = f"HTTP {err.status_code}: {err.message}"
                    if err.status_code < 500 and err.status_code not in RETRY_STATUS:
                        break  # the request itself is wrong: sending it again will not help
                else:
                    text = (resp.choices[0].message.content or "") if resp.choices else ""
                    usage = getattr(resp, "usage", None)
                    _record({"ok": True, "latency_s": time.monotonic() - t0, "queue_s": waited, "attempts": attempts,
                             "prompt_tokens": getattr(usage, "prompt_tokens", 0) or 0,
                             "completion_tokens": getattr(usage, "completion_tokens", 0) or 0})
                    return text, resp
                if attempts <= self.cfg.max_retries:
                    time.sleep(self.cfg.backoff_s * 2 ** (attempts - 1))
        _record({"ok": False, "latency_s": time.monotonic() - started - waited, "queue_s": waited,
                 "attempts": attempts, "prompt_tokens": 0, "completion_tokens": 0})
        raise JudgeError(f"the judge at {self.cfg.base_url} gave no answer after {attempts} attempt(s): {error}")

    def async_client(self) -> Any:
        """An object shaped like ``openai.AsyncOpenAI`` for ``chat.completions.create`` (what verifiers'
        JudgeRubric calls), whose calls go through this judge's bounds, retries and accounting."""
        return _AsyncJudgeClient(self)


class _AsyncJudgeClient:
    def __init__(self, judge: Judge) -> None:
        self.chat = _Chat(judge)
        self.base_url = judge.cfg.base_url


class _Chat:
    def __init__(self, judge: Judge) -> None:
        self.completions = _Completions(judge)


class _Completions:
    def __init__(self, judge: Judge) -> None:
        self.judge = judge

    async def create(self, *, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        kwargs.pop("stream", None)
        ctx = contextvars.copy_context()  # the episode's call list travels with the thread
        return (await asyncio.to_thread(ctx.run, self.judge.complete, list(messages), **kwargs))[1]


def _record(call: dict[str, Any]) -> None:
    calls = CALLS.get()
    if calls is not None:
        calls.append(call)


class _Fields(dict):
    """Template fields; an unknown ``{name}`` stays as written."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def fill(template: str, task: Task, response: str) -> str:
    """The judge prompt for one episode: ``{question}``, ``{answer}``, ``{response}`` and the task's other
    metadata keys filled in."""
    meta = task.metadata if isinstance(task.metadata, dict) else {}
    fields = _Fields({k: v for k, v in meta.items() if isinstance(k, str)})
    fields.setdefault("question", task.prompt)
    fields.setdefault("answer", "")
    fields["response"] = response
    return template.format_map(fields)


def parse(cfg: JudgeConfig, reply: str) -> float:
    """The reward a reply says, by ``score_pattern`` or ``verdicts``; JudgeError when it says none."""
    if cfg.score_pattern:
        match = re.search(cfg.score_pattern, reply)
        try:
            return float(match.group(1)) if match else _unread(reply)
        except ValueError:
            return _unread(reply)
    words = reply.strip().split()
    first = re.sub(r"[^\w]", "", words[0]).lower() if words else ""
    verdicts = {k.lower(): v for k, v in cfg.verdicts.items()}
    return float(verdicts[first]) if first in verdicts else _unread(reply)


def _unread(reply: str) -> float:
    raise JudgeError(f"the judge's reply matches no parse rule: {' '.join(reply.split())[:200]!r}")


class JudgeReward:
    """``rollout.reward: judge``: one judge call per episode (or the configured function's calls)."""

    def __init__(self, cfg: JudgeConfig, function: Callable[..., float] | None = None) -> None:
        self.cfg = cfg
        self.judge = Judge(cfg)
        self.function = function

    def __call__(self, task: Task, result: Any) -> float:
        if getattr(result, "status", "completed") == "error":
            return 0.0  # the agent failed by its own doing: nothing to grade
        calls: list[dict[str, Any]] = []
        token = CALLS.set(calls)
        try:
            if self.function is not None:
                return float(self.function(task, result, self.judge))
            messages = ([{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else [])
            messages.append({"role": "user", "content": fill(self.cfg.prompt, task, result.final_answer or "")})
            return parse(self.cfg, self.judge.ask(messages))
        finally:
            CALLS.reset(token)
            result.info.setdefault("judge_calls", []).extend(calls)


def served_judge_config(cfg: JudgeConfig, base_url: str) -> JudgeConfig:
    """``rollout.judge`` once the run serves its ``serve`` model at ``base_url`` (rayrl/gateway/frozen.py):
    an endpoint like any other, asked for the served model by name unless ``model`` names another."""
    return dataclasses.replace(cfg, serve=None, num_engines=1, base_url=base_url, model=cfg.model or cfg.serve or "")


def judge_reward(cfg: JudgeConfig) -> JudgeReward:
    """The judge reward of ``rollout.judge`` (its function imported and checked when it names one)."""
    function = None
    if cfg.function:
        from rayrl.extensions import check_call, load_reference

        function = load_reference(cfg.function, "rollout.judge.function")
        check_call(function, "rollout.judge.function", cfg.function, ("task", "result", "judge"),
                   "judge_fn(task, result, judge) -> float")
    return JudgeReward(cfg, function)


def judge_reward_for(rollout: RolloutConfig) -> JudgeReward:
    """``rollout.reward: judge``: the judge reward of the run's ``rollout.judge`` (its row in rayrl/rewards/)."""
    return judge_reward(rollout.judge)
