"""``python driver.py --dry-run``: one episode of one task against the real engine, instead of the run.

Why: a mistake that fails every episode (an SDK argument the installed version refuses, a wrong
endpoint variable, a reward that raises) should cost seconds, not a run. The dry run starts what an
episode needs and nothing it does not: one engine (as ``engine.*`` configures it, without the shared
placement group: no trainer is built), the judge it serves if any, the gateway, the sandbox pool and one
rollout worker; it runs the first task of ``data.train_path`` through them exactly as a training step
would (the same harness, reward and recording), prints the outcome (status, reward, the error whole, the
program's stderr, every turn and tool call the gateway recorded and the token view of what would train:
rayrl/inspect/text.py), stops everything and says whether the episode failed. driver.py exits 1 when it
did, 0 when it did not.
"""

from __future__ import annotations

import dataclasses
import time

import ray

from actors.engine_fleet import EngineFleet
from actors.gateway_shard import start_gateway_shards
from actors.judge_server import ServedJudge
from actors.rollout_worker import RolloutWorker
from actors.runtime import on_driver_node
from actors.sandbox_pool import SandboxPoolActor
from rayrl.config import RunConfig
from rayrl.config.paths import absolute_outputs
from rayrl.data import FileDataset
from rayrl.inspect.text import episode_lines
from rayrl.models import resolve_model_path
from rayrl.records import episode_row, sample_detail, task_text, tokenizer_text
from rayrl.resolve import resolve
from rayrl.types import Episode, Task


def first_task(cfg: RunConfig) -> Task:
    """The first row of ``data.train_path``, mapped as the run maps it."""
    data = cfg.data
    return FileDataset(data.train_path, data.max_prompt_chars, data.fields, data.format)[0]


def run_one_episode(cfg: RunConfig, task: Task) -> Episode:
    """``task``'s episode through one engine, the gateway, the pool and one worker; all stopped after."""
    cfg = resolve(absolute_outputs(cfg))
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, num_engines=1),
                              trajectory=dataclasses.replace(cfg.trajectory, num_shards=1),
                              sandbox_pool=dataclasses.replace(cfg.sandbox_pool, min_warm=min(
                                  cfg.sandbox_pool.min_warm, 1)),
                              logging=dataclasses.replace(cfg.logging, inspect_episodes_per_step=max(
                                  cfg.logging.inspect_episodes_per_step, 1)))  # the gateway describes the tree
    model_path = str(resolve_model_path(cfg.model.path))
    logs = cfg.run_dir / "dry_run" / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    name = f"rayrl-{cfg.exp_id}-dry-run"
    print(f"[rayrl] dry run: starting one engine (logs: {logs}), the gateway and one rollout worker...", flush=True)
    engines = EngineFleet(cfg.engine, model_path, str(logs), [None], name_prefix=name)
    gateway = pool = worker = judge = None
    try:
        judge = ServedJudge.start(cfg, name, str(logs))  # rollout.judge.serve: the reward asks it
        cfg = judge.run_config(cfg) if judge is not None else cfg
        gateway = start_gateway_shards(dataclasses.replace(cfg, exp_id=f"{cfg.exp_id}-dry-run"),
                                       model_path, engines.urls)
        pool = SandboxPoolActor.options(name=f"{name}-sandbox-pool", **on_driver_node()).remote(
            cfg.sandbox, cfg.sandbox_pool)
        worker = RolloutWorker.options(name=f"{name}-rollout", max_concurrency=2, **on_driver_node()).remote(
            cfg, gateway.handles, pool, 0)
        print(f"[rayrl] dry run: task {task.task_id} against the engine at {engines.urls[0]}", flush=True)
        return ray.get(worker.run_episode.remote(task, "dry-run", 0))
    finally:
        graceful = [*(gateway.shutdown() if gateway is not None else []),
                    *([pool.shutdown.remote()] if pool is not None else [])]
        try:
            ray.get(graceful, timeout=60)
        except Exception:  # an actor that died cannot be stopped politely; it is killed below
            pass
        engines.shutdown()
        if judge is not None:
            judge.shutdown()
        for handle in [*(gateway.handles if gateway is not None else []), pool, worker]:
            if handle is not None:
                ray.kill(handle)


def outcome(cfg: RunConfig, episode: Episode, seconds: float) -> str:
    """What the dry run prints: the episode (rayrl/inspect/text.py) and one closing line."""
    row = episode_row(episode, harness=cfg.rollout.agent)
    row["prompt"] = task_text(episode.tree) or row["prompt"]
    samples = [sample_detail(s, None) for s in episode.samples]
    ids = sorted({int(t) for s in episode.samples for t in s.tokens})
    own = cfg.model.tokenizer_path not in (None, cfg.model.path)
    tokenizer = cfg.model.tokenizer_path if own else str(resolve_model_path(cfg.model.path))
    vocab = dict(zip(map(str, ids), tokenizer_text(str(tokenizer))(ids))) if ids else {}
    lines = episode_lines(row, episode.tree, samples, vocab, prompt_chars=300)
    turns, calls = episode.info.get("turns", 0), episode.info.get("tool_calls", 0)
    figures = f"reward {episode.reward:g}, {turns} LLM call(s), {calls} tool call(s), {seconds:.1f} s"
    if episode.ok:
        lines.append(f"[rayrl] dry run ok: {figures}; the full run is the same command without --dry-run")
    else:
        last = [line for line in (episode.error or "").splitlines() if line.strip()]
        lines.append(f"[rayrl] dry run FAILED ({episode.failure}): {last[-1].strip() if last else '?'} ({figures}); "
                     "every episode of the run would likely fail the same way")
    return "\n".join(lines)


def dry_run(cfg: RunConfig) -> bool:
    """Run, print and judge the dry run's episode; True when it did not fail."""
    task = first_task(cfg)
    started = time.monotonic()
    episode = run_one_episode(cfg, task)
    print(outcome(cfg, episode, time.monotonic() - started), flush=True)
    return episode.ok
