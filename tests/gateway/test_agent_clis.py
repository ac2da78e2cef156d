"""The real Claude Code and Codex CLIs against the gateway, through their harnesses.

The CLIs are installed by scripts/install_agent_clis.sh (npm); these tests skip, saying why, only when
that install fails. Each run is a host subprocess with an isolated HOME, stdin from /dev/null, capped
retries and a hard timeout.

* With the scripted engine, each CLI goes through a full tool loop: the model asks for a shell
  command, the CLI runs it and sends the output back, the model answers. Checks: exit 0, the tool
  output reached the second prompt, every POST is a recorded turn, and the two turns fold into one
  token-faithful sample (the CLI's echoed history hit cumulative token mode).
* With the real CPU engine and the tiny random model, each CLI runs to a clean end (exit 0, or the
  CLI's own report of a response cut by the token limit, since random text never ends: Claude Code's
  "response exceeded the output token maximum", Codex's "Incomplete response returned, reason:
  max_output_tokens") and every POST is a recorded turn with no protocol error.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from rayrl.agents import make_harness
from rayrl.agents.base import EpisodeContext
from rayrl.types import Task
from tests.gateway.scripted_engine import last_role

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cli_dir() -> str:
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install_agent_clis.sh")], capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        pytest.skip(f"agent CLIs could not be installed from npm: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip().splitlines()[-1]


def _run(stack, harness_name: str, cli_dir: str, prompt: str, max_tokens: int = 256, **kwargs):
    info = stack.open()
    harness = make_harness(harness_name, cli_dir=cli_dir, **kwargs)
    ctx = EpisodeContext(base_url=info.base_url, api_key=info.token, model="tiny", max_tokens=max_tokens,
                         deadline=time.monotonic() + 180, max_turns=4)
    errors_before = stack.gateway.counters["errors_4xx"]
    result = harness.run(Task(prompt=prompt), ctx)
    assert stack.gateway.counters["errors_4xx"] == errors_before, "the CLI got a 4xx from the gateway"
    assert stack.gateway.counters["errors_internal"] == 0
    return info, result


def _tool_loop_script(call: str):
    def script(prompt: str) -> str:
        return "The command printed hi." if last_role(prompt) == "tool" else call
    return script


def test_claude_code_tool_loop(scripted, cli_dir):
    call = '<tool_call>{"name": "Bash", "arguments": {"command": "echo hi", "description": "Print hi"}}</tool_call>'
    stack = scripted(_tool_loop_script(call))
    info, result = _run(stack, "claude_code", cli_dir, "Run echo hi", tools="Bash",
                        system_prompt="You are a shell assistant.")
    assert result.status == "completed", result.error
    assert result.final_answer == "The command printed hi."
    assert "hi" in stack.engine.prompts[-1].split("<|im_start|>tool")[-1]  # the tool ran; its output came back
    stats = stack.stats(info)
    assert stats["turns"] == stats["api_calls"] == 2
    samples = stack.loop.run(stack.gateway.finish_session(info.session_id, 1.0))
    assert len(samples) == 1 and stats["cumulative_hits"] == 1


def test_codex_tool_loop(scripted, cli_dir):
    call = '<tool_call>{"name": "exec_command", "arguments": {"cmd": "echo hi"}}</tool_call>'
    stack = scripted(_tool_loop_script(call))
    info, result = _run(stack, "codex", cli_dir, "Run echo hi", instructions="You are a shell assistant.")
    assert result.status == "completed", result.error
    assert result.final_answer.strip() == "The command printed hi."
    tool_part = stack.engine.prompts[-1].split("<|im_start|>tool")[-1]
    assert "hi" in tool_part and "exited with code 0" in tool_part
    stats = stack.stats(info)
    assert stats["turns"] == stats["api_calls"] == 2
    samples = stack.loop.run(stack.gateway.finish_session(info.session_id, 1.0))
    assert len(samples) == 1 and stats["cumulative_hits"] == 1


@pytest.fixture
def capped_tiny_stack(tiny_stack):
    """The tiny-model stack with generations capped short (random text never stops by itself)."""
    old = tiny_stack.gateway.cfg.max_tokens_cap
    tiny_stack.gateway.cfg.max_tokens_cap = 24
    yield tiny_stack
    tiny_stack.gateway.cfg.max_tokens_cap = old


def test_claude_code_on_tiny_model(capped_tiny_stack, cli_dir):
    info, result = _run(capped_tiny_stack, "claude_code", cli_dir, "Say hello", max_tokens=24, tools="Bash",
                        system_prompt="You are terse.")
    clean_limit = result.error is not None and "output token maximum" in result.error
    assert result.status == "completed" or clean_limit, result.error
    stats = capped_tiny_stack.stats(info)
    assert stats["api_calls"] >= 1 and stats["turns"] == stats["api_calls"]


def test_codex_on_tiny_model(capped_tiny_stack, cli_dir):
    info, result = _run(capped_tiny_stack, "codex", cli_dir, "Say hello", instructions="You are terse.")
    # random text runs into the token cap: the gateway ends the stream with response.incomplete (as
    # OpenAI does) and Codex reports that as its own clean error
    clean_limit = result.error is not None and "Incomplete response returned, reason: max_output_tokens" in result.error
    assert (result.status == "completed" and result.final_answer) or clean_limit, result.error
    stats = capped_tiny_stack.stats(info)
    assert stats["turns"] == stats["api_calls"] == 1


SANDBOX_CLIS = "/usr/local/lib/rayrl-agent-clis"  # under /usr: visible (read-only) inside local sandboxes


@pytest.fixture(scope="module")
def sandbox_cli_dir() -> str:
    if not os.access("/usr/local/lib", os.W_OK):
        pytest.skip("cannot install the CLIs under /usr/local/lib, where a local sandbox could see them")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install_agent_clis.sh")], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "RAYRL_AGENT_CLIS_DIR": SANDBOX_CLIS})
    if proc.returncode != 0:
        pytest.skip(f"agent CLIs could not be installed from npm: {proc.stderr.strip()[-500:]}")
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("name,call,options", [
    ("claude_code", '<tool_call>{"name": "Bash", "arguments": {"command": "echo hi", "description": "x"}}</tool_call>',
     {"tools": "Bash", "system_prompt": "You are a shell assistant."}),
    ("codex", '<tool_call>{"name": "exec_command", "arguments": {"cmd": "echo hi"}}</tool_call>',
     {"instructions": "You are a shell assistant."}),
])
def test_cli_tool_loop_in_local_sandbox(scripted, sandbox_cli_dir, name, call, options):
    """The same tool loop with the CLI running inside a bubblewrap sandbox via Sandbox.exec."""
    from rayrl.config import SandboxConfig
    from rayrl.sandboxes.base import SandboxUnavailable
    from rayrl.sandboxes.factory import create_sandbox

    stack = scripted(_tool_loop_script(call))
    try:
        # network: the sandbox reaches the gateway on the host's loopback. memory_mb: Claude Code's
        # runtime (bun) reserves a large address space and dies under the 1 GB default limit.
        sandbox = create_sandbox(SandboxConfig(network=True, memory_mb=8192, timeout_s=120))
    except SandboxUnavailable as err:
        pytest.skip(f"no local sandbox here: {err}")
    try:
        info = stack.open()
        ctx = EpisodeContext(base_url=info.base_url, api_key=info.token, model="tiny", sandbox=sandbox,
                             deadline=time.monotonic() + 120)
        result = make_harness(name, cli_dir=sandbox_cli_dir, **options).run(Task(prompt="Run echo hi"), ctx)
    finally:
        sandbox.close()
    assert result.status == "completed", result.error
    assert result.final_answer.strip() == "The command printed hi."
    stats = stack.stats(info)
    assert stats["turns"] == stats["api_calls"] == 2
