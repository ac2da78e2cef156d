"""Codex CLI (``codex exec``) as an agent harness.

Codex 0.169 speaks only the OpenAI Responses API (``wire_api = "responses"``; "chat" is refused). The
harness writes ``$CODEX_HOME/config.toml`` with a model provider whose ``base_url`` is the gateway and
whose ``env_key`` carries the session token, turns off everything that would reach other hosts
(update checks, analytics, plugin/app sync, web search, multi-agent), caps retries, and runs
``codex exec --skip-git-repo-check -o answer.txt PROMPT </dev/null``.

Options for small models: ``instructions`` replaces Codex's ~17 KB base instructions and
``skill_instructions=False`` drops the skills catalogue, which together shrink the first prompt from
about 7K to about 1.5K tokens. Inside a rayrl sandbox Codex's own bubblewrap cannot nest, so its
sandbox mode is ``danger-full-access`` there (the rayrl sandbox is the isolation); on the host it
defaults to ``workspace-write``.
"""

from __future__ import annotations

import json
from typing import Any

from rayrl.agents.base import AgentResult, EpisodeContext
from rayrl.agents.harness_cli import CLIHarness, CLIInvocation, CLIOutcome
from rayrl.types import Task

API_KEY_ENV = "RAYRL_GATEWAY_API_KEY"
ANSWER_FILE = ".codex-last-message.txt"


def _toml(value: Any) -> str:
    """A TOML value (strings via JSON escaping, which TOML basic strings accept)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def config_toml(base_url: str, model: str, *, max_retries: int, instructions: str | None,
                skill_instructions: bool) -> str:
    """$CODEX_HOME/config.toml pointing Codex at the gateway with every outside switch off."""
    lines = [
        f"model = {_toml(model)}",
        'model_provider = "rayrl"',
        "check_for_update_on_startup = false",
        'web_search = "disabled"',
    ]
    if instructions is not None:
        lines.append(f"instructions = {_toml(instructions)}")
    lines += [
        "",
        "[model_providers.rayrl]",
        'name = "rayrl gateway"',
        f"base_url = {_toml(base_url)}",  # Codex appends /responses
        f"env_key = {_toml(API_KEY_ENV)}",  # -> Authorization: Bearer <session token>
        'wire_api = "responses"',
        f"stream_max_retries = {int(max_retries)}",
        f"request_max_retries = {int(max_retries)}",
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[skills]",
        f"include_instructions = {_toml(skill_instructions)}",
        "",
        "[features]",
        "plugins = false",  # else plugin sync reaches github.com / chatgpt.com
        "apps = false",
        "multi_agent = false",  # drops the namespace tool
        "goals = false",
        "",
    ]
    return "\n".join(lines)


class CodexHarness(CLIHarness):
    """Runs ``codex exec`` against the gateway; the answer is Codex's last message."""

    name = "codex"
    cli_name = "codex"

    def __init__(
        self,
        instructions: str | None = None,
        skill_instructions: bool = False,
        sandbox_mode: str = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.instructions = instructions
        self.skill_instructions = skill_instructions
        self.sandbox_mode = sandbox_mode

    def invocation(
        self, task: Task, ctx: EpisodeContext, binary: str, home: str, prompt: str, sandboxed: bool
    ) -> CLIInvocation:
        codex_home = f"{home}/.codex"
        config = config_toml(ctx.base_url, ctx.model, max_retries=self.max_retries,
                             instructions=self.instructions or ctx.system_prompt,
                             skill_instructions=self.skill_instructions)
        env = {**self.base_env(home, sandboxed), "CODEX_HOME": codex_home, API_KEY_ENV: ctx.api_key}
        env.update(self.extra_env)
        mode = self.sandbox_mode
        if mode == "auto":
            mode = "danger-full-access" if sandboxed else "workspace-write"
        argv = [binary, "exec", "--skip-git-repo-check", "--ephemeral", "-s", mode,
                "-o", ANSWER_FILE, *self.extra_args, prompt]
        return CLIInvocation(argv=argv, env=env, home_files={".codex/config.toml": config}, output_file=ANSWER_FILE)

    def read_result(self, outcome: CLIOutcome) -> AgentResult:
        result = AgentResult(status="completed" if outcome.exit_code == 0 else "error")
        answer = outcome.output_file_text
        if answer is None:
            answer = outcome.stdout.strip() or None
        result.final_answer = answer
        if result.status == "error":
            result.error = (outcome.stderr or outcome.stdout).strip()[-2000:]
        return result
