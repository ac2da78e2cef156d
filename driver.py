"""rayrl entry point.

    python driver.py                                  # the embedded default: examples/calculator on CPU
    python driver.py --config examples/calculator/config.yaml trainer.steps=3 rollout.group_size=4
    ray job submit --working-dir . -- python driver.py --config examples/calculator/config.yaml
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "examples", "calculator", "config.yaml")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train an LLM agent with RL on Ray.")
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="YAML run config (default: the calculator example)")
    parser.add_argument("--resume", action="store_true", help="continue from the run's newest checkpoint")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.steps=3")
    args = parser.parse_args(argv)

    from rayrl.config import ConfigError, load_config
    from rayrl.models import ModelNotFoundError, resolve_model_path

    try:
        cfg = load_config(args.config, args.overrides)
        resolve_model_path(cfg.model.path)  # fail before starting Ray; provisions the built-in model once
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
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

    context = init_ray(cfg.ray)
    if context.dashboard_url:
        print(f"[rayrl] Ray dashboard: http://{context.dashboard_url} (token: `ray get-auth-token`; "
              "docs/operations.md says how to reach it)", flush=True)
    pipeline = None
    try:
        pipeline = Pipeline(cfg)
        if args.resume:
            pipeline.resume()
        pipeline.run()
    except TrainerFailure:  # the pipeline printed the one line: cause, checkpoint, how to resume
        return 3
    except (WeightSyncError, CheckpointError) as err:
        print(f"[rayrl] stopped: {err}", file=sys.stderr)
        return 3
    finally:
        if pipeline is not None:
            pipeline.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
