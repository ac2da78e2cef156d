"""Claude Code (``claude -p``) as an agent harness.

Claude Code talks the Anthropic Messages API to ``ANTHROPIC_BASE_URL`` (the gateway root) with the
session token as its API key; the switches below keep it off every other host (no telemetry, error
reports, update checks or feature flags) and make it fail fast instead of retrying for minutes when
something is wrong. As root it refuses ``--dangerously-skip-permissions`` unless ``IS_SANDBOX=1``.

Useful options for small models: ``tools`` (e.g. ``"Bash"``: fewer tool schemas in the prompt) and
``system_prompt`` (replaces Claude Code's long default system prompt).
"""

from __future__ import annotations

import json
import os
from typing import Any

from rayrl.agents.base import AgentResult, EpisodeContext, gateway_root
from rayrl.agents.harness_cli import CLIHarness, CLIInvocation, CLIOutcome
from rayrl.types import Task

# Environment that keeps Claude Code offline except for the gateway (see docs/gateway.md).
OFFLINE_ENV = {
    "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",  # no per-request attribution block in the system prompt
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_UPDATES": "1",
    "DISABLE_GROWTHBOOK": "1",
}


class ClaudeCodeHarness(CLIHarness):
    """Runs ``claude -p PROMPT --output-format json`` against the gateway; the answer is ``result``."""

    name = "claude_code"
    cli_name = "claude"

    def __init__(
        self,
        tools: str | None = None,
        system_prompt: str | None = None,
        max_turns: int | None = None,
        skip_permissions: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.tools = tools
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.skip_permissions = skip_permissions

    def invocation(
        self, task: Task, ctx: EpisodeContext, binary: str, home: str, prompt: str, sandboxed: bool
    ) -> CLIInvocation:
        env = {
            **self.base_env(home, sandboxed),
            **OFFLINE_ENV,
            "ANTHROPIC_BASE_URL": gateway_root(ctx.base_url),
            "ANTHROPIC_API_KEY": ctx.api_key,  # -> x-api-key
            "ANTHROPIC_AUTH_TOKEN": ctx.api_key,  # -> Authorization: Bearer
            "ANTHROPIC_MODEL": ctx.model,
            "ANTHROPIC_SMALL_FAST_MODEL": ctx.model,
            "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(ctx.max_tokens),
            "CLAUDE_CODE_MAX_RETRIES": str(self.max_retries),
        }
        left = ctx.time_left()
        if left != float("inf"):
            env["API_TIMEOUT_MS"] = str(int(max(left, 1.0) * 1000))
        if not sandboxed and hasattr(os, "geteuid") and os.geteuid() == 0:
            env["IS_SANDBOX"] = "1"  # root may skip permissions only when it says it is sandboxed
        env.update(self.extra_env)
        argv = [binary, "-p", prompt, "--output-format", "json"]
        if self.skip_permissions:
            argv.append("--dangerously-skip-permissions")
        if self.tools is not None:
            argv += ["--tools", self.tools]
        if self.system_prompt is not None or ctx.system_prompt:
            argv += ["--system-prompt", self.system_prompt or ctx.system_prompt or ""]
        max_turns = self.max_turns or ctx.max_turns
        if max_turns:
            argv += ["--max-turns", str(max_turns)]
        argv += self.extra_args
        return CLIInvocation(argv=argv, env=env)

    def read_result(self, outcome: CLIOutcome) -> AgentResult:
        """``--output-format json`` prints one object: result text, num_turns, is_error, subtype."""
        result = AgentResult(status="completed" if outcome.exit_code == 0 else "error")
        text = outcome.stdout.strip()
        try:
            data = json.loads(text.splitlines()[-1]) if text else {}
        except (json.JSONDecodeError, IndexError):
            data = {}
        if isinstance(data, dict) and data:
            result.final_answer = data.get("result") if isinstance(data.get("result"), str) else None
            result.turns = int(data.get("num_turns") or 0)
            if data.get("subtype") == "error_max_turns":
                result.status = "max_turns"
            elif data.get("is_error"):
                result.status, result.error = "error", str(data.get("result") or data.get("subtype"))[:2000]
        else:
            result.final_answer = text or None
        if result.status == "error" and not result.error:
            result.error = (outcome.stderr or outcome.stdout).strip()[-2000:]
        return result
