"""The verifiers adapter's overhead per episode, side by side in one run: the same task (examples/verifiers/
sums_env.py) run as a verifiers environment (rollout.environment) and written as a plain rayrl function agent
with a plain reward, both through the real gateway in front of the CPU engine serving the CPU model.

    python bench/environment_overhead.py [--episodes 8] [--model smollm2-135m-instruct] [--quick]

Both sides send the same chat (the environment's system prompt and question) with greedy sampling and the
same max_tokens, so the engine generates the same tokens for both: what differs is the adapter (the
environment's own rollout loop, its verifiers client, its rubric) against a direct openai call and a Python
reward. Each round runs ``--episodes`` episodes one after another on each side (bench/measure.py rotates the
order). Reported: seconds per episode on each side and the per-round ratio. Target: the adapter adds < 5% of
episode time.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.measure import Record, add_common_args, alternate, format_table, paired_ratio  # noqa: E402

ENV = "examples.verifiers.sums_env:load_environment"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=8, help="episodes per side per round")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=16)
    add_common_args(ap)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from rayrl.agents.episode import EpisodeRunner
    from rayrl.agents.function_agent import FunctionAgent
    from rayrl.config import GatewayConfig, RolloutConfig, TrajectoryConfig
    from rayrl.engines.cpu.engine import CPUEngine
    from rayrl.engines.cpu.server import EngineServer
    from rayrl.engines.router import Router
    from rayrl.environments.verifiers_env import EnvironmentHarness, load_splits
    from rayrl.gateway.app import Gateway
    from rayrl.models import resolve_model_path
    from rayrl.rewards import get_reward_fn
    from tests.conftest import LoopThread
    from tests.gateway.episode_kit import InProcessSessions

    sums = importlib.import_module("examples.verifiers.sums_env")
    record = Record("environment_overhead", "verifiers adapter overhead per episode", quick=args.quick,
                    record_dir=args.record_dir)
    model = str(resolve_model_path(args.model))
    loop = LoopThread()
    engine = CPUEngine(model, dtype="float32", max_batch_size=8, context_length=2048).start()
    server = EngineServer(engine)
    url = loop.run(server.start())
    router = Router([url])
    gateway = Gateway(GatewayConfig(tool_parser="none"), TrajectoryConfig(), AutoTokenizer.from_pretrained(model),
                      router, model_name=args.model, context_length=2048)
    loop.run(gateway.start())

    class Stack:
        pass

    stack = Stack()
    stack.gateway, stack.loop = gateway, loop
    sessions = InProcessSessions(stack)
    rollout = RolloutConfig(temperature=0.0, max_tokens=args.max_tokens, episode_timeout_s=120)
    train, _ = load_splits(ENV, {"num_train": 64})
    tasks = [train[i] for i in range(args.episodes)]

    async def plain_agent(task, endpoint):
        import openai

        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as client:
            resp = await client.chat.completions.create(
                model=endpoint.model, messages=task.metadata["verifiers"]["prompt"], temperature=endpoint.temperature,
                top_p=endpoint.top_p, max_tokens=endpoint.max_tokens)
        return resp.choices[0].message.content or ""

    def plain_reward(task, result):
        text = (result.final_answer or "").strip()
        answer = task.metadata["verifiers"]["answer"]
        return float(sums._number(text) == answer) + 0.2 * float(text.lstrip("-").isdigit())

    env_runner = EpisodeRunner(EnvironmentHarness(ENV, {"num_train": 64}), get_reward_fn("environment"), sessions,
                               None, rollout, args.model)
    plain_runner = EpisodeRunner(FunctionAgent(plain_agent), plain_reward, sessions, None, rollout, args.model)
    rewards: dict[str, list[float]] = {"verifiers environment": [], "function agent": []}

    def side(name, runner):
        def run() -> float:
            t0 = time.monotonic()
            for i, task in enumerate(tasks):
                episode = runner.run(task, f"{name}-{i}")
                if not episode.ok:
                    raise RuntimeError(f"{name}: {episode.error}")
                rewards[name].append(episode.reward)
            return (time.monotonic() - t0) / len(tasks)
        return run

    try:
        result = alternate({"verifiers environment": side("verifiers environment", env_runner),
                            "function agent": side("function agent", plain_runner)},
                           min_rounds=2 if args.quick else 5, max_rounds=3 if args.quick else 12, rel_iqr=0.05,
                           label="s/episode")
    finally:
        loop.run(gateway.stop())
        loop.run(router.close())
        loop.run(server.stop())
        engine.shutdown()
        loop.close()
    env_s, plain_s = result["verifiers environment"]["value"], result["function agent"]["value"]
    ratio = paired_ratio(env_s, plain_s)
    rows = [["verifiers environment", env_s.fmt(3, " s")], ["function agent", plain_s.fmt(3, " s")],
            ["ratio (environment / function)", ratio.fmt(3)]]
    record.table(f"seconds per episode ({args.episodes} episodes a round, {args.model}, greedy, "
                 f"max_tokens {args.max_tokens})", ["side", "median [q1-q3] (min-max, n)"], rows)
    same = rewards["verifiers environment"] == rewards["function agent"]
    record.note(f"both sides scored the same episodes alike: {same} (mean reward "
                f"{sum(rewards['verifiers environment']) / max(len(rewards['verifiers environment']), 1):.3f})")
    record.figure("environment_s", env_s)
    record.figure("function_s", plain_s)
    record.figure("ratio", ratio)
    print(format_table(["side", "s/episode"], rows))
    record.save()


if __name__ == "__main__":
    main()
