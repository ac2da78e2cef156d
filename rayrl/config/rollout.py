"""The config sections of rollout: sandboxes, their pool, the episodes (agent, groups) and AgentCore.

Part of the run configuration (rayrl/config/schema.py has the conventions and ``RunConfig``); the
comment beside each field is its documentation (docs/config.md is generated from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional

from rayrl.config.checks import ConfigError, non_negative, positive
from rayrl.config.host_rules import parse_rules

# rollout.agent and rollout.reward when rollout.environment runs and scores the episodes. A keyword of the config's
# own, as "auto" is elsewhere: the harness and reward tables key their environment rows by it (rayrl/agents/,
# rayrl/rewards/), and no plug-in's name is compared here.
ENVIRONMENT = "environment"


@dataclass
class SandboxConfig:
    """One sandbox: isolation and limits."""

    backend: Literal["local", "e2b"] = "local"  # local | e2b
    isolation: Literal["auto", "bwrap", "unshare", "none"] = "auto"  # auto | bwrap | unshare | none  (none: trusted
    # development only)
    network: bool = False  # no network unless enabled
    allowed_hosts: list[str] = field(default_factory=list)  # network on: only these, proxied ([]: host net)
    memory_mb: int = 1024  # address-space limit per process
    cpu_seconds: int = 60  # CPU-time limit per exec
    max_processes: int = 64  # process limit inside the sandbox
    max_file_mb: int = 64  # largest file a process may write
    timeout_s: float = 30.0  # default wall-clock limit per exec (the whole process tree is killed)
    image: Optional[str] = None  # e2b template / container image
    files: dict[str, str] = field(default_factory=dict)  # path inside the sandbox -> content, preloaded

    def __post_init__(self) -> None:
        positive(self, "sandbox.", "timeout_s", "memory_mb")
        try:  # entries are host / host:port / *.domain (rayrl/config/host_rules.py)
            parse_rules(list(self.allowed_hosts))
        except ValueError as err:
            raise ConfigError(f"sandbox.allowed_hosts{err}") from None
        if self.allowed_hosts and not self.network:
            raise ConfigError("sandbox.allowed_hosts: set while sandbox.network is false (nothing would be "
                              "reachable); set sandbox.network: true or drop allowed_hosts")


@dataclass
class SandboxPoolConfig:
    """The warm pool that leases sandboxes to episodes."""

    min_warm: int = 2  # sandboxes kept ready
    max_size: int = 32  # hard cap on live sandboxes
    lease_s: float = 600.0  # a lease expires after this long and its sandbox is reclaimed
    acquire_timeout_s: float = 60.0  # wait this long for a free sandbox, then fail clearly
    recycle_after: int = 16  # a sandbox is replaced after this many leases (reset in between)
    health_interval_s: float = 10.0  # how often idle sandboxes are health-checked

    def __post_init__(self) -> None:
        positive(self, "sandbox_pool.", "max_size", "lease_s")
        non_negative(self, "sandbox_pool.", "min_warm")
        if self.min_warm > self.max_size:
            raise ConfigError("sandbox_pool.min_warm: must not exceed sandbox_pool.max_size")


DEFAULT_JUDGE_PROMPT = (
    "You grade an answer to a question.\n\nQuestion:\n{question}\n\nReference answer:\n{answer}\n\n"
    "Answer to grade:\n{response}\n\nIs the answer to grade correct? Reply with one word: yes or no.")


@dataclass
class JudgeConfig:
    """A frozen model that grades episodes (``rollout.reward: judge``; an environment's JudgeRubric asks it too)."""

    base_url: Optional[str] = None  # its OpenAI-compatible endpoint (…/v1): SGLang's or vLLM's own server, a hosted
    # API, rayrl's standalone gateway (python -m rayrl.gateway serve)
    serve: Optional[str] = None  # instead of base_url: a model path (or smollm2-135m-instruct) the run serves as the
    # judge, on engines of its own (engine.* settings) behind an OpenAI-compatible endpoint; frozen: no weight
    # update, pause or memory release reaches it
    num_engines: int = 1  # rollout.judge.serve: engines serving the judge
    model: str = ""  # the model name sent to it (rollout.judge.serve: default the served model's name)
    api_key_env: Optional[str] = None  # the environment variable holding its API key (None: no key)
    prompt: str = DEFAULT_JUDGE_PROMPT  # the user message; {question} (the task's prompt), {answer} (metadata.answer),
    # {response} (the agent's final answer) and any other metadata key in braces are filled in
    system_prompt: Optional[str] = None  # a system message before it
    verdicts: dict[str, float] = field(default_factory=lambda: {"yes": 1.0, "no": 0.0})  # the reply's first word
    # (case-insensitive, punctuation stripped) -> reward; a reply that matches none is a judge failure
    score_pattern: Optional[str] = None  # instead of verdicts: a regular expression whose first group is the reward
    # (a number), e.g. 'Score: ([0-9.]+)'
    function: Optional[str] = None  # instead of prompt and parse rules: package.module:function (task, result, judge)
    # -> float, calling judge.ask(messages) -> str (bounded and retried like every judge call)
    max_tokens: int = 16  # per judge call
    temperature: float = 0.0  # the judge samples greedily by default
    timeout_s: float = 60.0  # one judge call's limit
    max_retries: int = 3  # retries of a call that failed for the infrastructure (connection, timeout, 429, 5xx)
    backoff_s: float = 1.0  # the first retry waits this long, each next one twice as long
    max_concurrent: int = 8  # judge calls in flight per rollout worker

    def __post_init__(self) -> None:
        positive(self, "rollout.judge.", "max_tokens", "timeout_s", "max_concurrent", "num_engines")
        non_negative(self, "rollout.judge.", "temperature", "max_retries", "backoff_s")
        self._check_serve()
        if self.base_url is not None and not self.base_url.startswith(("http://", "https://")):
            raise ConfigError("rollout.judge.base_url: an http(s):// URL of an OpenAI-compatible API, got "
                              f"{self.base_url!r}")
        if self.base_url and not self.model:
            raise ConfigError("rollout.judge.model: name the model the judge endpoint serves")
        if self.score_pattern is not None:
            import re

            try:
                groups = re.compile(self.score_pattern).groups
            except re.error as err:
                raise ConfigError(f"rollout.judge.score_pattern: not a regular expression: {err}") from None
            if groups < 1:
                raise ConfigError("rollout.judge.score_pattern: needs a group around the score, e.g. "
                                  "'Score: ([0-9.]+)'")
        elif not self.verdicts:
            raise ConfigError("rollout.judge.verdicts: give verdict words and their rewards, or "
                              "rollout.judge.score_pattern")

    def _check_serve(self) -> None:
        """``serve`` (the run starts the judge) and ``base_url`` (the user runs it) are the two ways, one at a time."""
        if self.serve is None:
            if self.num_engines != 1:
                raise ConfigError("rollout.judge.num_engines: only read with rollout.judge.serve (a judge the run "
                                  "serves)")
            return
        if not self.serve:
            raise ConfigError("rollout.judge.serve: must not be empty (unset it to use rollout.judge.base_url)")
        if self.serve.startswith(("http://", "https://")):
            raise ConfigError(f"rollout.judge.serve: a model path or name the run serves, got the URL {self.serve!r}; "
                              "give a running endpoint as rollout.judge.base_url")
        if self.base_url:
            raise ConfigError("rollout.judge.serve: the run serves this judge itself, so rollout.judge.base_url must "
                              "be unset (set one or the other)")
        if self.api_key_env:
            raise ConfigError("rollout.judge.api_key_env: the judge the run serves (rollout.judge.serve) takes no API "
                              "key; unset it")


@dataclass
class RolloutConfig:
    """Episodes: which agent, how many, how long."""

    environment: Optional[str] = None  # an environment written for another framework, run unchanged: verifiers:<env id>
    # or verifiers:package.module:load_environment; it then gives the tasks, runs the episodes and scores them
    # (rollout.agent and rollout.reward become environment); docs/environments.md
    environment_args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the environment's
    # load_environment
    agent: str = "python_tool_agent"  # python_tool_agent | chat | claude_code | codex | agentcore | command |
    # package.module:function (async def agent(task, endpoint) -> str) | package.module:Class (a BaseHarness);
    # docs/agents.md
    agent_command: list[str] = field(default_factory=list)  # rollout.agent command: the program and its arguments; it
    # reads OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL, gets the task as JSON on stdin and prints the answer
    # (docs/agents.md)
    tools: list[str] = field(default_factory=lambda: ["calculator"])  # tools of the python agent
    reward: str = "calculator"  # reward function: calculator | math | gsm8k | agent_reported | hidden_tests |
    # reasoning_gym (the task's dataset's own score_answer on the text in <answer> tags, 0 without them, as
    # reasoning-gym's trainer scores) | reasoning_gym_lenient (the same, a reply without tags scored whole) |
    # environment (rollout.environment's own score) | judge (rollout.judge's model grades the final answer) |
    # package.module:function (reward(task, result) -> float); docs/agents.md
    prompts_per_step: int = 4  # distinct tasks per training step
    group_size: int = 4  # episodes per task (GRPO group)
    num_workers: int = 1  # rollout worker actors
    max_concurrent_episodes: int = 0  # episodes in flight per worker (0: every episode of the groups the schedule keeps
    # in flight, over num_workers)
    episode_timeout_s: float = 180.0  # an episode still running after this is failed
    max_turns: int = 4  # LLM calls per episode for the python agent
    temperature: float = 1.0  # sampling temperature the agent requests
    top_p: float = 1.0  # nucleus sampling the agent requests
    max_tokens: int = 96  # per LLM call
    system_prompt: Optional[str] = None  # the system prompt of the python agent (overrides its own) and the chat agent
    few_shot_examples: int = 2  # worked tool-use examples the python agent puts before the question
    example_turns: list[dict[str, str]] = field(default_factory=list)  # the chat agent's worked examples, sent as
    # earlier turns ({user: ..., assistant: ...} each) between the system prompt and the task; unlike
    # few_shot_examples (a count of the python agent's built-in tool-use demos) these are the examples themselves
    tool_delay_s: list[float] = field(default_factory=list)  # [min, max]: each tool call also sleeps that long
    # (uniform) in the sandbox, as slow real tools do; [] none
    step_deadline_s: float = 0.0  # a step stops waiting for episodes after this (0: no deadline)
    min_groups_fraction: float = 1.0  # finish the step once this fraction of groups completed
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    min_group_episodes: int = 2  # a group trains only if at least this many (capped at group_size) of its episodes were
    # scored; else its task runs again (only infrastructure failures are not scored; the agent's own count with the
    # reward they got)

    def __post_init__(self) -> None:
        positive(self, "rollout.", "prompts_per_step", "group_size", "num_workers", "episode_timeout_s",
                 "max_turns", "max_tokens", "min_group_episodes")
        non_negative(self, "rollout.", "max_concurrent_episodes", "temperature", "few_shot_examples",
                     "step_deadline_s")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"rollout.top_p: must be in (0, 1], got {self.top_p}")
        if not 0.0 < self.min_groups_fraction <= 1.0:
            raise ConfigError("rollout.min_groups_fraction: must be in (0, 1]")
        delay = list(self.tool_delay_s)
        if delay and (len(delay) != 2 or not 0.0 <= delay[0] <= delay[1]):
            raise ConfigError(f"rollout.tool_delay_s: need [] or [min, max] with 0 <= min <= max, "
                              f"got {delay}")
        self._check_example_turns()
        self._check_environment()

    def _check_example_turns(self) -> None:
        """Each entry is exactly {user: ..., assistant: ...}, both non-empty text."""
        for i, turn in enumerate(self.example_turns):
            where = f"rollout.example_turns[{i}]"
            if not isinstance(turn, dict):
                raise ConfigError(f"{where}: need {{user: ..., assistant: ...}}, got {turn!r}")
            extra = sorted(set(turn) - {"user", "assistant"})
            if extra:
                raise ConfigError(f"{where}.{extra[0]}: unknown key; an example turn has only user and assistant")
            for name in ("user", "assistant"):
                if not isinstance(turn.get(name), str) or not turn[name].strip():
                    raise ConfigError(f"{where}.{name}: must be a non-empty string")

    def _check_environment(self) -> None:
        """With an environment, it is the agent and the reward (left at their defaults or set to environment)."""
        if not self.environment:
            for name in ("agent", "reward"):
                if getattr(self, name) == ENVIRONMENT:
                    raise ConfigError(f"rollout.{name}: {ENVIRONMENT} needs rollout.environment (e.g. verifiers:<env>)")
            if self.environment_args:
                raise ConfigError("rollout.environment_args: set without rollout.environment")
            return
        defaults = {f.name: f.default for f in fields(self)}
        for name in ("agent", "reward"):
            if getattr(self, name) not in (defaults[name], ENVIRONMENT):
                raise ConfigError(f"rollout.{name}: rollout.environment runs the episodes and scores them; leave "
                                  f"rollout.{name} unset (or {ENVIRONMENT}), got {getattr(self, name)!r}")
            setattr(self, name, ENVIRONMENT)


@dataclass
class AgentCoreConfig:
    """Agents hosted on Amazon Bedrock AgentCore Runtime (``rollout.agent: agentcore``); docs/agentcore.md."""

    runtime_arn: str = ""  # the agent runtime's ARN (local mode: may stay empty, a local ARN is used)
    qualifier: Optional[str] = None  # runtime endpoint qualifier (None: the DEFAULT endpoint)
    region: str = "us-west-2"  # AWS region of the runtime and the result bucket
    endpoint_url: Optional[str] = None  # AgentCore Runtime endpoint override (local mode sets the emulator's)
    s3_bucket: str = ""  # bucket the agents write results to (local mode: created in the moto server)
    s3_prefix: str = "rollouts"  # results at s3://<bucket>/<prefix>/<exp_id>/<task_id>/<session_id>.json
    s3_endpoint_url: Optional[str] = None  # S3 endpoint override (local mode sets the moto server's)
    max_concurrent: int = 100  # AgentCore sessions in flight for the whole run (all rollout workers together)
    acr_tps_limit: float = 25.0  # invoke requests per second for the whole run, retries included
    acr_burst: int = 1  # requests the rate limiter lets through back to back after an idle spell
    max_pool_connections: int = 256  # botocore HTTP connection pool size (>= max_concurrent avoids pool churn)
    session_timeout_s: float = 900.0  # a session with no result this long after its invoke fails
    # (rollout.episode_timeout_s bounds it too)
    max_retries: int = 6  # retries of a throttled / 429 / 5xx invoke, exponential backoff with full jitter
    backoff_base_s: float = 0.5  # the first retry waits up to this long; each further retry doubles it
    backoff_max_s: float = 20.0  # longest wait between two retries
    poll_interval_s: float = 2.0  # how often S3 is checked for a session's result
    connect_timeout_s: float = 10.0  # botocore connect timeout
    read_timeout_s: float = 60.0  # botocore read timeout of one request
    gateway_public_host: Optional[str] = None  # host agents use to reach the gateway (None: the host it bound)
    local_agent_command: list[str] = field(default_factory=list)  # local mode: run this agent app with the emulator and
    # a moto S3 server

    def __post_init__(self) -> None:
        positive(self, "agentcore.", "max_concurrent", "acr_tps_limit", "acr_burst", "max_pool_connections",
                 "session_timeout_s", "poll_interval_s", "connect_timeout_s", "read_timeout_s")
        non_negative(self, "agentcore.", "max_retries", "backoff_base_s", "backoff_max_s")
