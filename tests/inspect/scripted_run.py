"""A run directory made of scripted episodes through the real gateway, trajectory tree and run records.

Why scripted: a random tiny model never writes a tool call, and the inspector's tests need an episode
with a known drift point, a fork-merge and a sub-agent branch. Everything but the completions is real:
the gateway renders with SmolLM2's tokenizer and chat template, the scripted engine answers over
loopback HTTP with token ids and log-probs (tests/gateway/scripted_engine.py), the trajectory tree
records and linearizes the turns, the admin route's describe_session reads the tree, and
rayrl/records.py and rayrl/rl/step_metrics.py write the files a training run writes.

The ``tangle`` episode, call by call (cumulative token mode off, as a client that re-renders history):

0. [system, user] -> a tool call written compactly: ``{"name":"calculator",...}``;
1. history echoes the parsed call, which the template renders with spaces, plus the tool result: the
   prompt's tokens differ inside call 0's response -> TITO drift, class ``response``;
2. history re-renders call 1's answer (a trailing space) -> fork-merge onto call 1's node;
3. a sub-agent with another system prompt -> a second root branch.
"""

from __future__ import annotations

import json
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from rayrl.config import GatewayConfig, RunConfig, TrajectoryConfig, to_yaml
from rayrl.engines.router import Router
from rayrl.gateway.admin_trees import describe_session
from rayrl.gateway.app import Gateway
from rayrl.records import tokenizer_text, write_episodes, write_inspection
from rayrl.rl.batch import build_batch
from rayrl.rl.failures import SANDBOX_FAILED
from rayrl.rl.step_metrics import EngineWork, step_metrics
from rayrl.types import Episode
from tests.gateway.scripted_engine import ScriptedEngine, last_role
from tests.loop_support import LoopThread

SYSTEM = "You are a calculator agent. Use the calculator tool."
SUB_SYSTEM = "You are a sub-agent that checks arithmetic."
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]
DETAIL_EPISODES = 2  # per step, as logging.inspect_episodes_per_step
COMPACT_CALL = '<tool_call>{"name":"calculator","arguments":{"expression":"2+3"}}</tool_call>'


def script(prompt: str) -> str:
    tail = prompt[prompt.rfind("<|im_start|>user"):]
    if SUB_SYSTEM in prompt:
        return "Checked: 2 + 3 = 5."
    if last_role(prompt) == "tool":
        return "The answer is 5."
    if "thanks" in tail:
        return "You're welcome."
    if "calculator" in tail:
        return COMPACT_CALL
    return "Plain answer: " + tail.split("\n", 1)[-1][:20].strip()


class ScriptedGateway:
    """The real gateway over a ScriptedEngine on a background loop (cumulative token mode off)."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.loop = LoopThread()
        self.engine = ScriptedEngine(self.tokenizer, script)
        self.router = Router([self.loop.run(self.engine.start())])
        cfg = GatewayConfig(tool_parser="hermes", cumulative_token_mode=False)
        self.gateway = Gateway(cfg, TrajectoryConfig(), self.tokenizer, self.router, model_name="tiny")
        self.loop.run(self.gateway.start())

    def chat(self, token: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = json.dumps({"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": 64}).encode()
        request = urllib.request.Request(self.gateway.base_url + "/chat/completions", data=body, method="POST",
                                         headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            return json.load(resp)["choices"][0]["message"]

    def finish(self, session_id: str, reward: float) -> tuple[list, dict[str, Any]]:
        tree = describe_session(self.gateway.sessions, session_id)  # as the gateway does
        samples = self.loop.run(self.gateway.finish_session(session_id, reward, {"reward": reward}))
        return samples, tree

    def close(self) -> None:
        self.loop.run(self.gateway.stop())
        self.loop.run(self.router.close())
        self.loop.run(self.engine.stop())
        self.loop.close()


def _assistant(message: dict[str, Any]) -> dict[str, Any]:
    out = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    return out


def tangle_episode(gw: ScriptedGateway, group_id: str) -> Episode:
    """The episode with a drift point, a fork-merge and a sub-agent branch (module docstring)."""
    info = gw.gateway.open_session({"group_id": group_id})
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3? Use the calculator."}]
    call = gw.chat(info.token, history)
    history += [_assistant(call), {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "5"}]
    answer = gw.chat(info.token, history)
    history += [{"role": "assistant", "content": answer["content"] + " "}, {"role": "user", "content": "thanks!"}]
    gw.chat(info.token, history)
    gw.chat(info.token, [{"role": "system", "content": SUB_SYSTEM}, {"role": "user", "content": "Check 2 + 3 = 5."}])
    samples, tree = gw.finish(info.session_id, 1.0)
    return Episode(info.session_id, "task-tangle", group_id, samples, reward=1.0, timings={"total_s": 0.5},
                   info={"agent_status": "completed", "turns": 4, "tool_calls": 1, "tool_errors": 0,
                         "final_answer": "The answer is 5.",
                         # an environment's rubric functions and a judge call, as rayrl/agents/episode.py keeps them
                         "reward_breakdown": {"correct_answer": 1.0, "answer_format": 0.5},
                         "judge_calls": [{"ok": True, "latency_s": 0.25, "queue_s": 0.0, "attempts": 2,
                                          "prompt_tokens": 40, "completion_tokens": 2}]}, tree=tree)


def plain_episode(gw: ScriptedGateway, task_id: str, group_id: str, question: str, reward: float) -> Episode:
    """Two LLM calls, no tools: the second extends the first token for token, so they join one sample
    whose bridge (the end of turn 1, the user's follow-up, the template's glue) is masked."""
    info = gw.gateway.open_session({"group_id": group_id})
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    answer = gw.chat(info.token, history)
    history += [{"role": "assistant", "content": answer["content"]}, {"role": "user", "content": "Once more."}]
    answer = gw.chat(info.token, history)
    samples, tree = gw.finish(info.session_id, reward)
    return Episode(info.session_id, task_id, group_id, samples, reward=reward, timings={"total_s": 0.2},
                   info={"agent_status": "completed", "turns": 2, "tool_calls": 0, "tool_errors": 0,
                         "final_answer": answer["content"]}, tree=tree)


def build_run(run_dir: Path, model_dir: Path, harness: str = "scripted_agent") -> dict[str, Any]:
    """Two steps of scripted episodes written as a training run writes them; returns what was made."""
    cfg = RunConfig(exp_id=run_dir.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    gw = ScriptedGateway(model_dir)
    made: dict[str, Any] = {"steps": {}}
    try:
        for step in (1, 2):
            episodes = [tangle_episode(gw, f"g{step}-a")] if step == 1 else []
            episodes += [plain_episode(gw, f"task-plain-{step}", f"g{step}-b", f"Say hello number {step}.", 0.0),
                         plain_episode(gw, f"task-plain-{step}", f"g{step}-b", f"Say hello again {step}.", 1.0)]
            failed = Episode("", f"task-broken-{step}", f"g{step}-c", status="failed", failure=SANDBOX_FAILED,
                             error="sandbox_failed: SandboxError: the sandbox died")
            episodes.append(failed)
            batch = build_batch(episodes)
            write_episodes(run_dir, step, episodes, batch, harness, detail_episodes=DETAIL_EPISODES)
            write_inspection(run_dir, step, episodes, batch, DETAIL_EPISODES, tokenizer_text(str(model_dir)))
            gap = {"train/engine_gap/mean_abs": 4e-4 * step, "train/engine_gap/max_abs": 3e-3 * step,
                   "train/engine_gap/kl": 1e-6 * step}  # what a trainer step reports (rayrl/rl/logprob_gap.py)
            metrics = step_metrics(episodes, batch, version=step - 1, policy_version=step, train=gap,
                                   pipeline_counts=Counter(), groups_in_flight=0, failures={},
                                   engines=EngineWork(0, 0, {}, 1.0, 1), extra={}, rollout_s=1.0, step_s=2.0,
                                   run_episodes=4 * step, run_s=2.0 * step)
            with (run_dir / "metrics.jsonl").open("a") as fh:
                fh.write(json.dumps({"step": step, **metrics}) + "\n")
            made["steps"][step] = episodes
    finally:
        gw.close()
    return made
