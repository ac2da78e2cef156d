"""The pipeline: one RunConfig in, every actor started, then the training loop. Read it top to bottom.

Allocation, in order (each step names what it starts and where):

1. the placement: one placement group of GPU bundles shared by trainer ranks and engines, over as
   many nodes as it takes (``placement.mode`` colocated or split; none: each part places itself);
2. the engines: one EngineActor per engine on its own bundle(s), started in parallel (and, for on-policy
   distillation, the teacher's engine when ``algorithm.distill_teacher`` is a model path; for a judge
   the run serves, ``rollout.judge.serve``, the judge's engines and endpoint: actors/judge_server.py);
3. the trainer: TrainerGroup ranks on their bundles, joined by torch.distributed; the weight plan
   from the ranks to the engines are planned from where both landed (actors/weight_sync.py);
4. the gateway: gateway shards that serve the agents' LLM calls and record every turn;
5. the sandbox pool;
6. the rollout workers, kept busy by a GroupDispatcher (4-6 on the driver's node: a local sandbox is a
   process tree on the pool's node, used directly by the worker that leased it);
7. the schedule (sync, async or colocated_async; rayrl/orchestration/schedules.py spells out each one's
   phases).

Then the loop: each step collects its groups (the schedule), builds the batch (the configured
advantage estimator, rayrl/rl/batch.py; a distillation teacher's per-token scores, rayrl/rl/distill.py),
trains and updates the engines (the schedule), and logs one line and its metrics
(rayrl/rl/step_metrics.py); checkpoints and validation when due.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import Counter
from typing import Any

import numpy as np
import ray

from actors.dispatch import GroupDispatcher
from actors.engine_fleet import EngineFleet
from actors.evaluation import evaluate
from actors.gateway_shard import start_gateway_shards
from actors.judge_server import ServedJudge
from actors.placement_group import SharedPlacement
from actors.ray_metrics import RayMetricsSink
from actors.rollout_worker import RolloutWorker, start_workers
from actors.runtime import on_driver_node
from actors.sandbox_pool import SandboxPoolActor
from actors.trainer import TrainerFailure, TrainerGroup
from actors.weight_sync import WeightSync
from rayrl.agents import harness_row
from rayrl.checkpoint import CheckpointStore
from rayrl.config import RunConfig, to_yaml
from rayrl.config.paths import absolute_outputs
from rayrl.data import TaskSampler
from rayrl.data.load import load_tasks
from rayrl.engines.backends import engine_backend
from rayrl.metrics import CounterDeltas, MetricsLogger, summary_line
from rayrl.models import resolve_model_path
from rayrl.orchestration.part_failures import WeightSyncError
from rayrl.orchestration.parts import RunParts, RunState
from rayrl.orchestration.run_checkpoint import PreloadedCheckpoint, RunCheckpoints, preload_checkpoint
from rayrl.orchestration.schedules import make_schedule, schedule_kind
from rayrl.orchestration.start_together import StartTogether
from rayrl.preflight import preflight
from rayrl.records import tokenizer_text, write_episodes, write_inspection
from rayrl.resolve import capacity_warnings, resolve
from rayrl.rl.batch import Batch, build_batch
from rayrl.rl.distill import TeacherScorer, distill_batch
from rayrl.rl.failure_log import FailureLog
from rayrl.rl.failures import failure_kind
from rayrl.rl.guards import GuardMonitor, GuardStop, StepView, teacher_trains_equal_groups, write_crossings
from rayrl.rl.logprob_gap import gap_crossed
from rayrl.rl.step_metrics import EngineWork, gateway_metrics, step_metrics
from rayrl.startup import StartupClock

__all__ = ["Pipeline", "WeightSyncError"]

logger = logging.getLogger("rayrl.pipeline")


class Pipeline:
    """Builds every actor from one RunConfig and runs the training loop."""

    def __init__(self, cfg: RunConfig, startup: StartupClock | None = None, resume: bool = False) -> None:
        """``startup``: the clock of this start (the driver's counts from its process's start; without one,
        from now); its record goes to the run directory's startup.json (rayrl/startup.py). ``resume``: the
        caller will :meth:`resume`; the trainer loads the newest checkpoint as it starts, while the engines
        and the other parts still load (where the schedule keeps the trainer's memory live)."""
        self.startup = startup if startup is not None else StartupClock(from_process=False)
        preflight(cfg, data=False)  # the agent, reward and callback import (the datasets load below)
        # every auto value and output path made concrete, as config.yaml records it
        self.cfg = cfg = resolve(absolute_outputs(cfg))
        self.run_dir = cfg.run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.startup.attach(self.run_dir)
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        for warning in capacity_warnings(cfg):
            logger.warning(warning)
        self.model_path = str(resolve_model_path(cfg.model.path))
        dataset, self.val_dataset = load_tasks(cfg)
        self.sampler = TaskSampler(dataset, seed=cfg.seed, shuffle=cfg.data.shuffle)
        store = CheckpointStore(cfg.pipeline.checkpoint_dir or self.run_dir / "checkpoints",
                                staging_root=self.run_dir / "checkpoint-staging",
                                keep_last=cfg.pipeline.keep_checkpoints)
        store.verify()  # a bad bucket fails now, not at the first save
        self.state = RunState()
        self._preloaded: PreloadedCheckpoint | None = None  # resume: what the trainer loaded as it started
        name = f"rayrl-{cfg.exp_id}"

        # 1. the placement
        self.placement = SharedPlacement.from_config(cfg)
        if self.placement is not None:
            print(f"[rayrl] placement: {self.placement.describe()}", flush=True)
        # 2-6 start together (rayrl/orchestration/start_together.py): each part loads in its own processes and none
        # needs another to do so; what joins them (engine addresses, weight plan) follows once all are up
        print("[rayrl] starting engines, trainer, gateway, sandbox pool and rollout workers...", flush=True)
        start = StartTogether(self.startup)
        # 2. the engines
        seats = self.placement.engine_seats() if self.placement is not None else [None] * cfg.engine.num_engines
        logs = str((self.run_dir / "logs").resolve())
        engines = start.part("engines", lambda: EngineFleet(cfg.engine, self.model_path, logs, seats, name_prefix=name),
                             stop=EngineFleet.shutdown)
        teacher = None  # on-policy distillation's engine (rayrl/rl/distill.py), when the teacher is a model path
        if cfg.algorithm.distill_teacher:
            teacher = start.part("teacher", lambda: self._start_teacher(name),
                                 stop=lambda t: t[1].shutdown() if t[1] is not None else None)
        judge = None  # rollout.judge.serve's engines and endpoint; the workers ask that endpoint
        if cfg.rollout.judge.serve:
            judge = start.part("judge", lambda: ServedJudge.start(cfg, name, logs), stop=ServedJudge.shutdown)

        # 3. the trainer (colocated: once the engines have released their memory, which it is built in; the
        #    schedule gives it back once the trainer is offloaded)
        kind = schedule_kind(cfg.pipeline.schedule)

        def start_trainer() -> TrainerGroup:
            if kind.trainer_after_engines:
                start.after(engines)
                kind.before_trainer(engines.result())
            group = TrainerGroup(cfg.trainer, self.model_path, seed=cfg.seed, name_prefix=name,
                                 placement=self.placement, algorithm=cfg.algorithm)
            if resume and not kind.trainer_after_engines:
                self._preloaded = preload_checkpoint(group, store)
            return group

        trainer = start.part("trainer", start_trainer, stop=TrainerGroup.shutdown)
        # 4. the gateway: its shards load the tokenizer meanwhile; they learn the engines' addresses below
        self.gateway = start_gateway_shards(cfg, self.model_path, [], wait=False)
        start.part("gateway", self.gateway.started, stop=lambda _: self.gateway.kill())
        # 5. the sandbox pool, filled to sandbox_pool.min_warm
        self.pool = SandboxPoolActor.options(name=f"{name}-sandbox-pool", **on_driver_node()).remote(
            cfg.sandbox, cfg.sandbox_pool)
        start.part("sandboxes", lambda: ray.get(self.pool.warm.remote()), stop=lambda _: ray.kill(self.pool))

        # 6. the rollout workers (with a served judge, once its endpoint is known)
        def start_rollout_workers() -> list[Any]:
            run_cfg = cfg
            if judge is not None:
                start.after(judge)
                run_cfg = judge.result().run_config(cfg)
            return start_workers(run_cfg, self.gateway.handles, self.pool)

        workers = start.part("workers", start_rollout_workers, stop=lambda started: [ray.kill(w) for w in started])
        start.wait()  # all of them up, or the first failure raised and every part stopped
        self.engines, self.trainer = engines.result(), trainer.result()
        self.teacher, self.teacher_engine = teacher.result() if teacher is not None else (None, None)
        self.judge = judge.result() if judge is not None else None
        if self.judge is not None:
            self.cfg = cfg = self.judge.run_config(cfg)
        # the joins: the gateway routes to the engines; the weight plan from the trainer's ranks to them
        self.gateway.set_engines(self.engines.urls)
        self.weights = WeightSync(cfg, self.trainer)
        plan = self.weights.connect(self.engines.endpoints())
        if self.placement is not None and plan is not None:
            print(f"[rayrl] weights: {plan.describe()}", flush=True)
        if self.weights.adapter_only:  # requests name the adapter: the engines load version 0 before any
            self.weights.push(0, self.engines.endpoints())
        self.dispatcher = GroupDispatcher(workers.result(), cfg.rollout.group_size, cfg.pipeline.groups_in_flight,
                                          self._replace_worker, cfg.pipeline.max_episode_retries)
        self.startup.mark("all_actors_ready")
        print(f"[rayrl] {self.startup.summary('all_actors_ready')}", flush=True)
        # 7. the schedule
        self.schedule = make_schedule(RunParts(cfg, self.state, self.sampler, self.dispatcher, self.trainer,
                                               self.engines, self.weights, self.gateway))
        self.checkpoints = RunCheckpoints(store, self.trainer, self.sampler, self.dispatcher, self.schedule,
                                          self.run_dir)
        self.checkpoints.check_shared()
        self.ray_sink = RayMetricsSink(cfg.exp_id)
        self.metrics = MetricsLogger(cfg.logging, self.run_dir, extra_sink=self.ray_sink)
        self.guards = GuardMonitor(cfg.guards)  # the silent-failure guards, with their streaks (docs/guards.md)
        self._engine_busy = CounterDeltas(time.monotonic())
        self._episodes_total = 0
        self._started_at = time.monotonic()
        self.failure_log = FailureLog()  # failure causes logged so far: a repeated one is logged short
        self._gap_fallback = False  # engine.max_logprob_gap was crossed: the engines decode in float32

    # -- the loop ------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, Any]]:
        cfg, history = self.cfg, []
        if self._preloaded is not None:  # built to resume, and the trainer holds the checkpoint: so must the rest
            self.resume()
        eval_every, save_every = cfg.pipeline.eval_interval, cfg.pipeline.checkpoint_interval  # -1: never
        if eval_every and self.step == 0:
            self.metrics.log(0, self.evaluate(0))
        try:  # a trainer rank lost in any phase, checkpoints included, stops the run the same way
            while self.step < cfg.trainer.steps and not self.budget_spent:
                history.append(self.run_step())
                if save_every > 0 and self.step % save_every == 0:
                    self.save_checkpoint()
                if eval_every and (self.step % eval_every == 0 or self.step == cfg.trainer.steps or self.budget_spent):
                    self.metrics.log(self.step, self.evaluate(self.step))
            if history and save_every >= 0 and not (save_every > 0 and self.step % save_every == 0):
                self.save_checkpoint()
            if history and cfg.trainer.lora.enabled:
                written = self.trainer.export_lora(str(self.run_dir), cfg.trainer.lora.export_merged)
                print(f"[rayrl] LoRA adapter (PEFT format): {'  merged model: '.join(written)}", flush=True)
        except TrainerFailure as failure:
            self.checkpoints.after_trainer_failure(failure)
            raise
        except GuardStop as stop:  # the step trained and logged; keep it, then say how to go on
            name = stop.crossing.guard
            if save_every < 0:
                how = "Checkpoint: none (pipeline.checkpoint_interval: -1). Start the run again"
            else:
                where = self.save_checkpoint()
                how = f"Checkpoint: {where}. Resume with: {self.checkpoints.resume_command(where)}"
            print(f"[rayrl] run stopped by guard {name} (guards.{name}: stop). {how} (add guards.{name}=warn to go "
                  "on past it)", flush=True)
            raise
        if self.failure_counts:
            print(f"[rayrl] failed episodes by cause: {dict(self.failure_counts)}", flush=True)
        print(f"[rayrl] metrics: {self.metrics.jsonl_path}  reward curve: {self.run_dir / 'reward_curve.png'}",
              flush=True)
        return history

    def run_step(self) -> dict[str, Any]:
        """Collect the step's groups, train on them, update the engines, log."""
        cfg, state = self.cfg, self.state
        state.step += 1
        self.checkpoints.start_step()
        started = time.monotonic()
        counts: Counter = Counter()
        groups = self.schedule.collect(counts)
        self.checkpoints.untrained_taken = groups
        rollout_s = time.monotonic() - started
        self.startup.mark("first_rollout_done")
        episodes = [e for g in groups for e in g.ordered()]
        set_aside = [e for g in state.set_aside for e in g.ordered()]  # groups run again or dropped as stale
        state.set_aside = []
        batch = self.build_batch(episodes)
        drawn = episodes + [e for g in self.schedule.dropped for e in g.ordered()]  # dynamic sampling's too
        self._record(drawn, batch, set_aside)
        version = state.version  # the weights this batch trains against
        in_flight = self.dispatcher.groups_in_flight  # before the train phase (async: groups go on)
        self.ray_sink.staleness(batch.staleness(version))
        train = self.schedule.train(batch) if batch.trains else None
        if train is None and not groups and counts["budget_stopped_draws"]:
            logger.info("step %d: the episode budget ran out before the step kept a group; no gradient step",
                        state.step)
        elif train is None:
            logger.info("step %d: every group had equal rewards; no gradient step", state.step)
        self._check_engine_gap(train)
        self.checkpoints.step_trained()  # trained (or nothing to learn: equal rewards in every group)
        self._episodes_total += len(drawn)
        metrics = step_metrics(
            drawn, batch, version=version, policy_version=state.version, train=train,
            pipeline_counts=counts, groups_in_flight=in_flight,
            failures={**state.failures, **self.dispatcher.counts}, engines=self._engine_work(),
            extra={**gateway_metrics(self.gateway.stats()), **self._agentcore_metrics(),
                   "engine/float32_fallback": float(self._gap_fallback),
                   "rollout/episodes_set_aside": len(set_aside)},
            rollout_s=rollout_s, step_s=time.monotonic() - started,
            run_episodes=self._episodes_total,
            run_s=time.monotonic() - self._started_at,
        )
        view = StepView(drawn, cfg.rollout.max_turns,
                        per_token_term=teacher_trains_equal_groups(cfg.algorithm, self.teacher is not None))
        guards = self.guards.check(view, state.step,
                                   str(self.run_dir / "episodes" / f"step{state.step:06d}.jsonl"))
        metrics.update(guards.metrics)
        self.metrics.log(state.step, metrics)
        print(summary_line(state.step, cfg.trainer.steps, metrics)
              + f" | episodes {len(drawn)} | staleness {metrics['pipeline/staleness_mean']:.2f}"
              + f" | dropped {counts['dropped_stale_groups']}"
              + (f" | {guards.summary()}" if guards.crossings else ""), flush=True)
        if not self.startup.seen("first_step_trained"):
            self.startup.mark("first_step_trained")
            print(f"[rayrl] {self.startup.summary('first_step_trained')}", flush=True)
        for crossing in guards.crossings:
            print(crossing.line(), flush=True)
        write_crossings(self.run_dir, guards.crossings)
        if guards.stop is not None:
            raise GuardStop(guards.stop)
        return metrics

    @property
    def budget_spent(self) -> bool:
        """``pipeline.episode_budget`` is set, has no room for another group and every group it paid for
        was taken (rayrl/orchestration/schedules.py counts episodes when their group is queued)."""
        return self.schedule.budget_spent

    def build_batch(self, episodes: list) -> Batch:
        """The step's batch (rayrl/rl/batch.py); with a distillation teacher, its per-token advantages."""
        batch = build_batch(episodes, self.cfg.algorithm)
        if self.teacher is not None and batch.samples:
            scores = self.schedule.while_dispatching(lambda: self.teacher.score(batch.samples))
            batch = distill_batch(batch, scores, self.cfg.algorithm.distill_coef)
        return batch

    def _start_teacher(self, name: str) -> tuple[TeacherScorer | None, EngineFleet | None]:
        """The scorer of ``algorithm.distill_teacher``: its URL, or an engine of its own serving its path."""
        cfg = self.cfg
        teacher = cfg.algorithm.distill_teacher
        if not teacher:
            return None, None
        if teacher.startswith(("http://", "https://")):
            return TeacherScorer(teacher.rstrip("/"), cfg.engine.request_timeout_s), None
        fleet = EngineFleet(dataclasses.replace(cfg.engine, num_engines=1), str(resolve_model_path(teacher)),
                            str((self.run_dir / "logs").resolve()), [None], name_prefix=f"{name}-teacher")
        print(f"[rayrl] distillation teacher {teacher} at {fleet.urls[0]}", flush=True)
        return TeacherScorer(fleet.urls[0], cfg.engine.request_timeout_s), fleet

    def evaluate(self, step: int) -> dict[str, Any]:
        """One episode per validation task (``pipeline.eval_tasks`` of them, 0: all)."""
        assert self.val_dataset is not None
        n = min(self.cfg.pipeline.eval_tasks or len(self.val_dataset), len(self.val_dataset))
        return evaluate(self.workers, [self.val_dataset[i] for i in range(n)], self.cfg.pipeline.eval_max_concurrent,
                        step)

    # -- checkpoints -----------------------------------------------------------------------------------

    def save_checkpoint(self) -> str:
        return self.checkpoints.save()

    def resume(self) -> bool:
        """Continue from the newest complete checkpoint: the next step takes exactly the next tasks. A trainer
        rank lost while loading it or pushing its weights stops the run with the one line, naming it."""
        try:
            started = time.monotonic()
            preloaded, self._preloaded = self._preloaded, None
            if not self.checkpoints.resume(preloaded):
                return False
            loaded = time.monotonic()
            self.schedule.weights_loaded()
        except TrainerFailure as failure:
            self.checkpoints.after_trainer_failure(failure, save=False)
            raise
        # what it waited for, for startup.json: the trainer loading the checkpoint (0 when it did as it
        # started: ``preload_s`` then, overlapped with the other parts' start), the engines its weights
        self.startup.mark("checkpoint_loaded", trainer_load_s=round(loaded - started, 3),
                          weight_push_s=round(time.monotonic() - loaded, 3),
                          **({"preload_s": preloaded.seconds} if preloaded is not None else {}))
        return True

    # -- what tests, notebooks and the driver look at ------------------------------------------------

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def version(self) -> int:
        return self.state.version

    @property
    def failure_counts(self) -> Counter:
        return self.state.failures

    @property
    def workers(self) -> list[Any]:
        """The live rollout workers (a dead one is replaced by the dispatcher)."""
        return self.dispatcher.workers

    @property
    def engine_urls(self) -> list[str]:
        return self.engines.urls

    # -- helpers -------------------------------------------------------------------------------------

    def _record(self, episodes: list, batch: Batch, set_aside: list) -> None:
        """Write the step's episodes, then those of the groups set aside during it, and the inspection data
        (rayrl/records.py, docs/inspector.md); count each failed episode by kind, and log the failures once
        per cause with their count (rayrl/rl/failure_log.py)."""
        cfg = self.cfg
        detail = cfg.logging.inspect_episodes_per_step
        written = episodes + set_aside
        write_episodes(self.run_dir, self.step, written, batch, cfg.rollout.agent, detail)
        if detail > 0:
            tokenizer = self.model_path if cfg.model.tokenizer_path == cfg.model.path else cfg.model.tokenizer_path
            write_inspection(self.run_dir, self.step, written, batch, detail, tokenizer_text(str(tokenizer)))
        for e in written:
            if not e.ok:
                self.state.failures[failure_kind(e)] += 1
        for line in self.failure_log.lines(self.step, written):  # once per cause, with its count
            logger.warning("%s", line)

    def _check_engine_gap(self, train: dict[str, Any] | None) -> None:
        """``engine.max_logprob_gap``: once a step's engine-trainer gap crosses it, the CPU engines hold
        their decode weights in float32 for the rest of the run (said once, here)."""
        engine = self.cfg.engine
        gap = gap_crossed(train, engine.max_logprob_gap)
        if (gap is None or self._gap_fallback or not engine_backend(engine.backend).switch_weight_format
                or engine.weight_format == "float32"):
            return
        self._gap_fallback = True
        switched = self.engines.set_weight_format("float32")
        logger.warning("step %d: engine-trainer log-prob gap %.4g > engine.max_logprob_gap %g; %s", self.step, gap,
                       engine.max_logprob_gap, f"{switched} fp16-packed engine(s) decode with float32 weights from "
                       "now on" if switched else "no engine decodes with packed weights, so nothing changes")

    def _engine_work(self) -> EngineWork:
        """The engines' counters: cumulative tokens, and forward-pass seconds since the last reading (per
        engine incarnation, so a replaced engine's fresh counters count from zero)."""
        work = self.engines.work_stats()
        busy, window = self._engine_busy.update(
            {f"{key}/{kind}": stats[kind] for key, stats in work.items()
             for kind in ("prefill_s", "decode_s", "weight_pack_s")},
            time.monotonic())
        by_kind = {kind: sum(v for k, v in busy.items() if k.endswith("/" + kind))
                   for kind in ("prefill_s", "decode_s", "weight_pack_s")}
        return EngineWork(int(sum(s["prompt_tokens"] for s in work.values())),
                          int(sum(s["cached_prompt_tokens"] for s in work.values())), by_kind, window,
                          max(len(work), 1))

    def _replace_worker(self, index: int) -> Any:
        return RolloutWorker.options(
            name=f"rayrl-{self.cfg.exp_id}-rollout-{index}-r{self.dispatcher.counts['rollout_worker_deaths']}",
            max_concurrency=self.cfg.rollout.max_concurrent_episodes + 1, **on_driver_node(),
        ).remote(self.cfg, self.gateway.handles, self.pool, index)

    def _agentcore_launcher(self) -> Any:
        """The run's AgentCore launcher actor (created by the first rollout worker that needs it), if any."""
        row = harness_row(self.cfg.rollout.agent)
        if row is None or not row.run_launcher:
            return None
        try:
            return ray.get_actor(f"rayrl-{self.cfg.exp_id}-agentcore-launcher")
        except ValueError:
            return None

    def _agentcore_metrics(self) -> dict[str, Any]:
        launcher = self._agentcore_launcher()
        if launcher is None:
            return {}
        return {f"agentcore/{k}": v for k, v in ray.get(launcher.stats.remote()).items()}

    def shutdown(self) -> None:
        """Stop every actor gracefully, then release it (names become free for the next pipeline)."""
        self.metrics.close()
        self.weights.close()  # leave the broadcast group before the engines stop
        graceful = [*self.gateway.shutdown(), self.pool.shutdown.remote()]
        launcher = self._agentcore_launcher()
        if launcher is not None:  # stops its local agent, emulator and S3 processes politely
            graceful.append(launcher.shutdown.remote())
        try:
            ray.get(graceful, timeout=60)
        except Exception as err:  # an actor that already died cannot be stopped politely
            logger.warning("graceful shutdown incomplete: %s", err)
        self.engines.shutdown()
        if self.teacher_engine is not None:
            self.teacher_engine.shutdown()
        if self.judge is not None:
            self.judge.shutdown()
        for ref in self.dispatcher.running:  # episodes of groups the run did not need
            ray.cancel(ref)
        for handle in [*self.gateway.handles, *self.workers, self.pool, *([launcher] if launcher else [])]:
            ray.kill(handle)
        self.trainer.shutdown()
        if self.placement is not None:
            self.placement.remove()
