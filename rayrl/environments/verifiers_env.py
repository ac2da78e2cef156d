"""verifiers environments (PyPI ``verifiers``), run unchanged: ``rollout.environment: verifiers:<env>``.

Which API: verifiers 0.4 keeps only its new stack (``verifiers.v1``: Env, tasksets, harnesses, judges),
while the environments people publish (the Environments Hub, prime-environments, the examples of
prime-rl, SkyRL and NeMo-RL) are modules whose ``load_environment(**kwargs)`` returns a classic
``vf.Environment`` (SingleTurnEnv, MultiTurnEnv, ToolEnv, with a Rubric or JudgeRubric). verifiers
0.3.1 is the last release that runs those: it keeps the classic stack in ``verifiers.legacy`` and
answers at the historical ``verifiers.*`` paths. So rayrl runs the classic API, on verifiers 0.3.x
(``pip install 'rayrl[verifiers]'``; 0.4 also pins openai below 3, which rayrl does not).

``<env>`` is an environment id (the installed module ``load_environment`` finds, e.g. ``reverse-text``) or
``package.module:attr`` (a ``load_environment``-like function, or an Environment object). Arguments come
from ``rollout.environment_args``. What rayrl takes from the environment:

* tasks: its dataset's rows (``prompt`` messages, ``answer``, ``info``, ...) become rayrl tasks; its eval
  dataset is the held-out set;
* the episode: the environment's own ``run_rollout`` (its multi-turn loop, tools and stop conditions) with a
  verifiers client whose OpenAI SDK points at the episode's gateway session, so every call is recorded;
* sampling: the run's temperature, top_p and max_tokens, overridden by what the environment sets
  (``sampling_args``, extra_body included);
* the reward: its rubric's weighted score; each reward function's score is kept (``reward/<name>``). A
  reward function that raises (verifiers itself scores it 0) fails the episode's scoring with the cause
  (``reward_failed``).

Data from a hub cannot be fetched here: loading runs with the Hugging Face libraries offline, and an
environment that needs them fails at load with one line saying so.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import logging
import os
import threading
from typing import Any

from rayrl.agents.base import AgentResult, BaseHarness, EpisodeContext
from rayrl.config import ConfigError
from rayrl.rl.failures import SERVICE_FAILED, TIMED_OUT
from rayrl.types import Task

logger = logging.getLogger("rayrl.environments")

FIELD = "rollout.environment"
INSTALL = "pip install 'rayrl[verifiers]'"
HUB_ERRORS = ("OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError", "HfHubHTTPError",
              "HFValidationError", "EntryNotFoundError", "RepositoryNotFoundError")
INFRA_ERRORS = ("InfraError", "TunnelError", "SandboxError")  # verifiers' own: the environment's services failed

_LOADED: dict[str, Any] = {}  # one environment per (target, args) and process
_LOAD_LOCK = threading.Lock()
# (judge | reward, message) of each reward function that raised during the episode's rollout
_REWARD_ERRORS: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar("rayrl_reward_errors",
                                                                                           default=None)


def _offline() -> None:
    """No hub at run time: the Hugging Face libraries fail fast instead of retrying a network that is not there."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")
    try:  # building an environment's dataset maps it: no progress bar per map in a run's log
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    except ImportError:
        pass


def load(target: str, args: dict[str, Any]) -> Any:
    """The environment (loaded once per process), its reward functions wrapped so their errors are seen."""
    key = json.dumps([target, args], sort_keys=True, default=str)
    with _LOAD_LOCK:
        if key not in _LOADED:
            env = _guarded(target, lambda: _load(target, args))
            for rubric in _rubrics(env.rubric):
                rubric.funcs = [_watched(f) for f in rubric.funcs]
            _LOADED[key] = env
        return _LOADED[key]


def _load(target: str, args: dict[str, Any]) -> Any:
    _offline()
    try:
        import verifiers
    except ImportError as err:
        raise ConfigError(f"{FIELD}: needs the verifiers package ({err}); {INSTALL}") from None
    try:
        from verifiers.envs.environment import Environment
        from verifiers.utils.env_utils import load_environment
    except ImportError:
        raise ConfigError(f"{FIELD}: verifiers {verifiers.__version__} has no classic Environment API (0.4 moved "
                          f"to verifiers.v1); environments published today use the classic one: {INSTALL} (0.3.x)"
                          ) from None
    if ":" in target:
        from rayrl.extensions import load_reference

        obj = load_reference(target, FIELD)
        if isinstance(obj, Environment):
            if args:
                raise ConfigError(f"rollout.environment_args: {target} is an environment object; it takes none")
            return obj
        _check_args(obj, target, args)
        env = obj(**args)
    else:
        from verifiers.utils.env_utils import import_env_module

        try:
            module = import_env_module(target)
        except ImportError as err:
            raise ConfigError(f"{FIELD}: no installed verifiers environment {target!r} ({err}); install its "
                              "package, or name package.module:load_environment") from None
        _check_args(getattr(module, "load_environment", None), target, args)
        env = load_environment(target, **args)
    if not isinstance(env, Environment):
        raise ConfigError(f"{FIELD}: {target} gave a {type(env).__name__}, not a verifiers Environment")
    _check_supported(env, target)
    return env


def _check_supported(env: Any, target: str) -> None:
    """What rayrl does not run yet fails at load rather than in every episode."""
    if getattr(env, "requires_group_rollouts", False) or getattr(env, "provides_advantages", False):
        raise ConfigError(f"{FIELD}: {target}'s rubric scores whole groups of rollouts (group reward functions or "
                          "its own advantages); rayrl runs and scores each episode on its own, with GRPO's groups "
                          "formed afterwards")
    if getattr(env, "message_type", "chat") != "chat":
        raise ConfigError(f"{FIELD}: {target} is a completion-style environment (message_type "
                          f"{env.message_type!r}); rayrl's gateway serves chat environments")


def _check_args(fn: Any, target: str, args: dict[str, Any]) -> None:
    """``fn(**args)`` can be called: a ConfigError naming rollout.environment_args otherwise."""
    if not callable(fn):
        raise ConfigError(f"{FIELD}: {target} has no load_environment function")
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as err:
        raise ConfigError(f"rollout.environment_args: {target}'s load_environment: {err}") from None
    except ValueError:  # no signature to check
        pass


def _from_the_hub(err: BaseException) -> bool:
    """A hub download failed: by the error's type, or by a message that names one of those types or the Hub
    (datasets re-raises LocalEntryNotFoundError as "ConnectionError: Couldn't reach '<repo>' on the Hub")."""
    text = str(err)
    return (type(err).__name__ in HUB_ERRORS or any(name in text for name in HUB_ERRORS)
            or "offline" in text.lower() or "on the hub" in text.lower())


def _guarded(target: str, fn: Any) -> Any:
    """Run ``fn``; an exception becomes a one-line ConfigError (a hub download says so)."""
    try:
        return fn()
    except ConfigError:
        raise
    except Exception as err:
        chain, cause = [], err
        while cause is not None and len(chain) < 10:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        if any(_from_the_hub(e) for e in chain):
            raise ConfigError(f"{FIELD}: {target} loads its data from the Hugging Face Hub, which rayrl does not "
                              "reach at run time; use an environment that builds its data in code (or from local "
                              f"files): {type(chain[0]).__name__}: {' '.join(str(chain[0]).split())[:200]}") from None
        root = err
        while root.__cause__ is not None:  # what raised, under the wrappers that re-raised it (verifiers' own)
            root = root.__cause__
        raise ConfigError(f"{FIELD}: loading {target} failed: {type(root).__name__}: "
                          f"{' '.join(str(root).split())[:300]}") from None


def _judge_failure(err: BaseException) -> bool:
    """Whether a reward function failed because its judge model did (rayrl's judge, or an OpenAI client's
    connection or status error): the infrastructure, not the episode."""
    import openai

    from rayrl.rl.failures import JudgeError

    seen: BaseException | None = err
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, (JudgeError, openai.APIError)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def attach_judge(env: Any, judge: Any) -> None:
    """Point every JudgeRubric of ``env`` at rayrl's judge (rollout.judge): its endpoint and model, with the
    judge's bounds, retries and accounting."""
    for rubric in _rubrics(env.rubric):
        if hasattr(rubric, "judge_client") and hasattr(rubric, "judge_model"):
            rubric.judge_client, rubric.judge_model = judge.async_client(), judge.cfg.model
            objects = getattr(rubric, "class_objects", None)
            if isinstance(objects, dict):
                objects.update(judge_client=rubric.judge_client, judge_model=rubric.judge_model)


def _rubrics(rubric: Any) -> list[Any]:
    """A rubric and, for a RubricGroup, every rubric inside it."""
    out = [rubric]
    for sub in getattr(rubric, "rubrics", None) or []:
        out += _rubrics(sub)
    return out


def _watched(fn: Any) -> Any:
    """``fn`` with its exceptions noted for the episode before verifiers swallows them (it scores them 0).
    ``functools.wraps`` keeps the name (the metric's) and the signature (verifiers passes arguments by it)."""
    if getattr(fn, "_rayrl_watched", False):
        return fn

    def note(err: Exception) -> None:
        errors = _REWARD_ERRORS.get()
        if errors is not None:
            kind = "judge" if _judge_failure(err) else "reward"
            errors.append((kind, f"{getattr(fn, '__name__', 'reward function')} raised {type(err).__name__}: "
                                 f"{' '.join(str(err).split())[:300]}"))

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def watched(*a: Any, **k: Any) -> Any:
            try:
                return await fn(*a, **k)
            except Exception as err:
                note(err)
                raise
    else:
        @functools.wraps(fn)
        def watched(*a: Any, **k: Any) -> Any:
            try:
                return fn(*a, **k)
            except Exception as err:
                note(err)
                raise
    watched._rayrl_watched = True  # type: ignore[attr-defined]
    return watched


class EnvironmentTasks:
    """An environment dataset's rows as rayrl tasks (the row rides in ``metadata.verifiers``)."""

    def __init__(self, rows: Any, target: str, split: str) -> None:
        self.tasks = [_task(dict(row), target, split, i) for i, row in enumerate(rows)]
        if not self.tasks:
            raise ConfigError(f"{FIELD}: {target}'s {split} dataset is empty")

    def __len__(self) -> int:
        return len(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]


def _task(row: dict[str, Any], target: str, split: str, i: int) -> Task:
    return Task(prompt=prompt_text(row.get("prompt")), metadata={"verifiers": row},
                task_id=f"vf-{target.split(':')[0].rsplit('.', 1)[-1]}-{split}-{row.get('example_id', i)}")


def prompt_text(prompt: Any) -> str:
    """The last user message's text (what the inspector and length checks show)."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


def load_splits(target: str, args: dict[str, Any]) -> tuple[EnvironmentTasks, EnvironmentTasks | None]:
    """Training tasks (its dataset, else its eval dataset) and held-out tasks (its eval dataset, when it has
    both). Building the datasets runs here, so a hub download fails at load."""
    env = load(target, args)

    def build() -> tuple[Any, Any]:
        return env.build_dataset(), env.build_eval_dataset()

    train, val = _guarded(target, build)
    if train is None and val is None:
        raise ConfigError(f"{FIELD}: {target} has neither a dataset nor an eval dataset")
    if train is None:
        logger.warning("%s has only an eval dataset: training on it, no held-out set", target)
        return EnvironmentTasks(val, target, "eval"), None
    held_out = EnvironmentTasks(val, target, "eval") if val is not None else None
    return EnvironmentTasks(train, target, "train"), held_out


class EnvironmentHarness(BaseHarness):
    """One episode = the environment's own ``run_rollout`` against the episode's gateway session."""

    name = "verifiers"
    needs_sandbox = False

    def __init__(self, target: str, args: dict[str, Any], judge: Any = None) -> None:
        """``judge``: ``rollout.judge`` (a JudgeConfig); with its base_url set, the environment's JudgeRubrics
        ask that judge."""
        self.target = target
        self.env = load(target, args)
        if judge is not None and judge.base_url:
            from rayrl.rewards.judge import Judge

            attach_judge(self.env, Judge(judge))

    def run(self, task: Task, ctx: EpisodeContext) -> AgentResult:
        row = task.metadata.get("verifiers") if isinstance(task.metadata, dict) else None
        if not isinstance(row, dict):
            raise ValueError(f"task {task.task_id} is not a verifiers row (no metadata.verifiers)")
        from rayrl.rewards.judge import CALLS

        errors: list[tuple[str, str]] = []
        calls: list[dict[str, Any]] = []
        tokens = _REWARD_ERRORS.set(errors), CALLS.set(calls)
        left = ctx.time_left()
        try:
            output = asyncio.run(asyncio.wait_for(self._rollout(row, ctx), None if left == float("inf") else left))
        except asyncio.TimeoutError:
            return AgentResult(status="error", error=f"{self.target} was cancelled at the episode deadline",
                               failure=TIMED_OUT, info={"judge_calls": calls})
        finally:
            _REWARD_ERRORS.reset(tokens[0])
            CALLS.reset(tokens[1])
        result = self._result(output, errors)
        if calls:
            result.info["judge_calls"] = calls
        return result

    def sampling_args(self, ctx: EpisodeContext) -> dict[str, Any]:
        """The run's settings, overridden by the environment's own (extra_body merged)."""
        args: dict[str, Any] = {"temperature": ctx.temperature, "top_p": ctx.top_p, "max_tokens": ctx.max_tokens}
        env_args = dict(getattr(self.env, "sampling_args", None) or {})
        extra = {**(args.pop("extra_body", None) or {}), **(env_args.pop("extra_body", None) or {})}
        args.update(env_args)
        if extra:
            args["extra_body"] = extra
        return args

    async def _rollout(self, row: dict[str, Any], ctx: EpisodeContext) -> dict[str, Any]:
        from openai import AsyncOpenAI
        from verifiers.clients.openai_chat_completions_client import OpenAIChatCompletionsClient

        openai_client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0,
                                    timeout=max(1.0, ctx.time_left()))
        try:
            return dict(await self.env.run_rollout(row, OpenAIChatCompletionsClient(openai_client), ctx.model,
                                                   self.sampling_args(ctx)))
        finally:
            await openai_client.close()

    def _result(self, output: dict[str, Any], reward_errors: list[tuple[str, str]]) -> AgentResult:
        completion = [_plain(m) for m in output.get("completion") or []]
        turns = [m for m in completion if m.get("role") == "assistant"]
        tool_calls = sum(len(m.get("tool_calls") or []) for m in turns)
        breakdown = {str(k): float(v) for k, v in (output.get("metrics") or {}).items()}
        info: dict[str, Any] = {"environment_reward": output.get("reward"), "reward_breakdown": breakdown,
                                "stop_condition": output.get("stop_condition")}
        for kind, message in reward_errors:  # environment_reward turns these into the episode's failure
            info.setdefault("judge_errors" if kind == "judge" else "reward_errors", []).append(message)
        result = AgentResult(final_answer=str(turns[-1].get("content") or "") if turns else "", status="completed",
                             turns=len(turns), tool_calls=tool_calls, transcript=completion, info=info)
        error = output.get("error")
        if error:
            result.status, result.error = "error", f"{self.target}: {_error_text(error)}"
            if _error_type(error) in INFRA_ERRORS:
                result.failure = SERVICE_FAILED
        elif output.get("is_truncated"):
            result.status = "max_turns"
        return result


def _plain(message: Any) -> dict[str, Any]:
    """A completion message as a dict (verifiers keeps pydantic messages in its output)."""
    if hasattr(message, "model_dump"):
        return message.model_dump(exclude_none=True)
    return dict(message) if isinstance(message, dict) else {"content": str(message)}


def _error_type(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("error") or error.get("type") or "")
    return type(error).__name__


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        return " ".join(f"{v}" for v in (error.get("error"), error.get("message") or error.get("error_chain_str"))
                        if v)
    return f"{type(error).__name__}: {error}"
