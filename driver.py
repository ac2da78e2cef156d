"""rayrl entry point.

    python driver.py                                  # the embedded default: examples/calculator on CPU
    python driver.py --dry-run                        # one episode of one task first: does the agent work?
    python driver.py --config examples/calculator/config.yaml trainer.steps=3 rollout.group_size=4
    ray job submit --working-dir . -- python driver.py --config examples/calculator/config.yaml
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples", "calculator", "config.yaml")


def model_paths(cfg) -> list[tuple[str, str]]:
    """The other models a run loads, by config field: the reference (a KL is on), a distillation teacher
    given as a path and a judge the run serves."""
    algo, out = cfg.algorithm, []
    if algo.uses_reference and algo.reference_path:
        out.append(("algorithm.reference_path", algo.reference_path))
    if algo.distill_teacher and not algo.distill_teacher.startswith(("http://", "https://")):
        out.append(("algorithm.distill_teacher", algo.distill_teacher))
    if cfg.rollout.judge.serve:
        out.append(("rollout.judge.serve", cfg.rollout.judge.serve))
    return out


STOP_SIGNAL = [signal.SIGINT]  # the signal that stopped the run (Ray re-raises a bare KeyboardInterrupt)


def stop_on_sigterm() -> None:
    """SIGTERM (``ray job stop``, ``timeout``, a scheduler taking the node back) stops the run as Ctrl-C does:
    the actors shut down, Ray is released and one line says where to resume from. Python's default would end
    the driver at once, leaving a local Ray, its engines and their memory behind."""
    def interrupt(signum: int, frame: object) -> None:
        STOP_SIGNAL[0] = signal.Signals(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def stopped_line(pipeline) -> tuple[str, int]:
    """The one line a stopped run prints, and its exit code (128 + the signal, as a shell reports it)."""
    sig = STOP_SIGNAL[0]
    if pipeline is None:
        return f"[rayrl] stopped by {sig.name} while starting: nothing was trained in this run.", 128 + sig
    where = pipeline.checkpoints.latest()
    return (f"[rayrl] stopped by {sig.name} at step {pipeline.step}. Newest checkpoint: {where or 'none'} (steps "
            f"since it are not saved). Resume with: {pipeline.checkpoints.resume_command(where)}"), 128 + sig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train an LLM agent with RL on Ray.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML run config (default: the calculator example)")
    parser.add_argument("--resume", action="store_true", help="continue from the run's newest checkpoint")
    parser.add_argument("--dry-run", action="store_true",
                        help="instead of the run: one episode of the first task against the real engine, its outcome "
                             "printed; exit 1 if it failed (actors/dry_run.py)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=3")
    args = parser.parse_args(argv)

    from rayrl.config import ConfigError, load_config
    from rayrl.config.paths import absolute_outputs
    from rayrl.models import ModelNotFoundError, resolve_model_path
    from rayrl.preflight import preflight
    from rayrl.startup import StartupClock

    clock = StartupClock(resume=args.resume)  # the phases of this start, from the process's start (startup.json)
    clock.mark("imports_done")
    try:  # everything that can be checked is checked before Ray starts: one line, exit 2
        cfg = absolute_outputs(load_config(args.config, args.overrides))  # outputs: rayrl/config/paths.py
        preflight(cfg)  # the names the plug-in tables hold; your agent, reward and callback import; the data parses
        print(f"[rayrl] run directory: {cfg.run_dir}", flush=True)
        clock.mark("config_loaded")
        resolve_model_path(cfg.model.path)  # provisions the built-in model once
        for field, path in model_paths(cfg):
            resolve_model_path(path, field)
        clock.mark("model_ready")
    except ConfigError as err:
        print(f"config error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except ModelNotFoundError as err:
        print(f"model error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.logging.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    # the local cluster gets token authentication (Ray reads this when it is imported; see actors/runtime.py)
    if not (cfg.ray.address or os.environ.get("RAY_ADDRESS")):
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    from actors.pipeline import Pipeline, WeightSyncError
    from actors.runtime import init_ray
    from actors.trainer import TrainerFailure
    from rayrl.checkpoint import CheckpointError
    from rayrl.rl.guards import GuardStop

    before_init = clock.now()
    context = init_ray(cfg.ray)
    clock.mark("ray_up", init_s=round(clock.now() - before_init, 3))  # the rest of its wait: the imports above
    if context.dashboard_url:
        print(f"[rayrl] Ray dashboard: http://{context.dashboard_url} (token: `ray get-auth-token`; "
              "docs/operations.md says how to reach it)", flush=True)
    if args.dry_run:
        from actors.dry_run import dry_run

        try:
            return 0 if dry_run(cfg) else 1
        finally:
            ray.shutdown()
    pipeline = None
    stop_on_sigterm()
    try:
        pipeline = Pipeline(cfg, startup=clock, resume=args.resume)  # resuming: the trainer loads as it starts
        if args.resume:
            pipeline.resume()  # marks checkpoint_loaded
        pipeline.run()
    except TrainerFailure as failure:  # the pipeline printed the one line: cause, checkpoint, how to resume
        if pipeline is None:  # lost while the pipeline started: nothing trained in this run
            print(f"[rayrl] run stopped while starting: {failure}. Nothing was trained in this run; run the "
                  "same command again once that is fixed (a lost node back, ...).", flush=True)
        return 3
    except (WeightSyncError, CheckpointError) as err:
        print(f"[rayrl] stopped: {err}", file=sys.stderr)
        return 3
    except GuardStop:  # the pipeline printed the guard's line, the checkpoint and how to resume
        return 4
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (stop_on_sigterm)
        line, code = stopped_line(pipeline)
        print(line, file=sys.stderr, flush=True)
        return code
    finally:
        if pipeline is not None:
            pipeline.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
