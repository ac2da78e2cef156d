"""rayrl.resolve: every auto value made concrete for a machine, once, without touching the input."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayrl.config import ConfigError, load_config, to_yaml
from rayrl.machine import Machine
from rayrl.resolve import capacity_warnings, resolve

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calculator" / "config.yaml"
CPU = Machine(cores=8, cuda=False)


def _cfg(*overrides: str):
    return load_config(EXAMPLE, ["rollout.prompts_per_step=2", "rollout.group_size=4", *overrides])


def _resolved(*overrides: str, machine: Machine = CPU):
    return resolve(_cfg(*overrides), machine)


# -- groups in flight and episodes per rollout worker ---------------------------------------------------


def test_sync_runs_one_step_of_groups():
    cfg = _resolved("pipeline.schedule=sync", "pipeline.groups_in_flight=10")
    assert cfg.pipeline.groups_in_flight == 2  # sync ignores the configured number
    assert cfg.rollout.max_concurrent_episodes == 8


@pytest.mark.parametrize("schedule", ["async", "colocated_async"])
def test_async_keeps_staleness_bound_batches_and_threads_for_all_of_them(schedule):
    cfg = _resolved(f"pipeline.schedule={schedule}", "pipeline.max_staleness=2",
                    "rollout.max_concurrent_episodes=0")
    assert cfg.pipeline.groups_in_flight == 6  # (2 + 1) batches of 2 groups
    assert cfg.rollout.max_concurrent_episodes == 24
    split = _resolved(f"pipeline.schedule={schedule}", "pipeline.max_staleness=2", "rollout.num_workers=5")
    assert split.rollout.max_concurrent_episodes == 5  # ceil(24 / 5): every episode has a thread
    validating = _resolved(f"pipeline.schedule={schedule}", "pipeline.max_staleness=2",
                           "pipeline.eval_interval=2", "pipeline.eval_max_concurrent=8",
                           "data.val_path=examples/calculator/data/val.jsonl")
    assert validating.rollout.max_concurrent_episodes == 32  # validation's own bound on top


def test_explicit_values_win_and_the_input_is_untouched():
    cfg = _resolved("pipeline.schedule=async", "pipeline.groups_in_flight=3",
                    "rollout.max_concurrent_episodes=7")
    assert (cfg.pipeline.groups_in_flight, cfg.rollout.max_concurrent_episodes) == (3, 7)
    auto = _cfg("pipeline.schedule=async", "pipeline.max_staleness=1")
    before = copy.deepcopy(auto)
    resolved = resolve(auto, CPU)
    assert (resolved.pipeline.groups_in_flight, resolved.rollout.max_concurrent_episodes) == (4, 16)
    assert auto == before  # the caller's config is not changed
    assert (auto.pipeline.groups_in_flight, auto.rollout.max_concurrent_episodes) == (0, 0)
    resolved.gateway.port = 1234  # no section is shared with the input either
    assert auto.gateway.port == before.gateway.port


def test_negative_concurrency_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.max_concurrent_episodes"):
        _cfg("rollout.max_concurrent_episodes=-1")


def test_capacity_warnings_name_the_limit():
    assert capacity_warnings(_resolved("pipeline.schedule=async", "pipeline.max_staleness=2",
                                       "sandbox_pool.max_size=32")) == []
    short = capacity_warnings(_resolved("pipeline.schedule=async", "pipeline.max_staleness=2",
                                        "rollout.max_concurrent_episodes=16", "sandbox_pool.max_size=8",
                                        "sandbox_pool.min_warm=4"))
    assert len(short) == 2
    assert "rollout.max_concurrent_episodes=16" in short[0] and "(24)" in short[0]
    assert short[1].startswith("sandbox_pool.max_size=8 is below the 16 episodes")


def test_capacity_warnings_refuse_an_unresolved_config():
    with pytest.raises(ValueError, match="resolved"):
        capacity_warnings(_cfg("pipeline.schedule=async"))


# -- CPU threads ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "cores", "engines", "ranks", "expected"),
    [
        ("sync", 2, 1, 1, (2, 2)),  # the phases take turns: each gets every core
        ("colocated_async", 16, 2, 4, (8, 4)),
        ("async", 2, 1, 1, (1, 1)),  # both run at once: half each
        ("async", 16, 2, 2, (4, 4)),
        ("async", 7, 1, 1, (3, 4)),
        ("async", 1, 1, 1, (1, 1)),  # never zero threads
        ("sync", 4, 8, 8, (1, 1)),
    ],
)
def test_cpu_threads_follow_the_schedule(schedule, cores, engines, ranks, expected):
    cfg = resolve(load_config(None, [f"pipeline.schedule={schedule}", f"engine.num_engines={engines}",
                                     f"trainer.num_ranks={ranks}"]), Machine(cores=cores, cuda=False))
    assert (cfg.engine.num_threads, cfg.trainer.num_threads) == expected


def test_cpu_threads_set_in_the_config_are_kept():
    cfg = resolve(load_config(None, ["engine.num_threads=3", "trainer.num_threads=5"]), Machine(16, False))
    assert (cfg.engine.num_threads, cfg.trainer.num_threads) == (3, 5)


def test_detected_machine_is_this_process_affinity():
    """Ray starts actors with OMP_NUM_THREADS=1: "auto" must become an explicit count before the engines
    and the trainer start, or torch would use one core of the machine."""
    machine = Machine.detect()
    assert machine.cores == len(os.sched_getaffinity(0)) and isinstance(machine.cuda, bool)
    cfg = resolve(load_config(None, ["pipeline.schedule=sync"]))
    assert (cfg.engine.num_threads, cfg.trainer.num_threads) == (machine.cores, machine.cores)
    with pytest.raises(AttributeError):
        machine.cores = 1  # frozen


# -- the other auto values -----------------------------------------------------------------------------


def test_engine_backend_follows_cuda():
    assert resolve(load_config(None), Machine(4, cuda=False)).engine.backend == "cpu"
    assert resolve(load_config(None), Machine(4, cuda=True)).engine.backend == "sglang"
    assert resolve(load_config(None, ["engine.backend=cpu"]), Machine(4, cuda=True)).engine.backend == "cpu"


def test_dtypes_are_bf16_only_where_computed_natively():
    plain, native = Machine(4, cuda=False, native_bf16=False), Machine(4, cuda=False, native_bf16=True)
    cfg = resolve(load_config(None), plain)
    assert (cfg.engine.dtype, cfg.trainer.compute_dtype) == ("float32", "float32")  # emulated bf16 is slower
    cfg = resolve(load_config(None), native)
    assert (cfg.engine.dtype, cfg.trainer.compute_dtype) == ("bfloat16", "bfloat16")
    assert resolve(load_config(None), Machine(4, cuda=True)).engine.dtype == "bfloat16"  # SGLang on GPU
    kept = resolve(load_config(None, ["engine.dtype=bfloat16", "trainer.compute_dtype=float32"]), plain)
    assert (kept.engine.dtype, kept.trainer.compute_dtype) == ("bfloat16", "float32")


@pytest.mark.parametrize("arch, avx512_bf16, amx, onednn, native", [
    ("x86_64", False, False, True, False),  # AVX512 without BF16: oneDNN emulates bf16 and says yes anyway
    ("x86_64", True, False, True, True),
    ("x86_64", False, True, True, True),
    ("x86_64", False, False, False, False),  # AVX2
    ("aarch64", False, False, True, True),  # Arm: oneDNN's own check
    ("aarch64", False, False, False, False),
])
def test_native_bf16_is_avx512_bf16_or_amx_on_x86(monkeypatch, arch, avx512_bf16, amx, onednn, native):
    import platform

    import torch

    from rayrl.machine import cpu_has_native_bf16

    monkeypatch.setattr(platform, "machine", lambda: arch)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn, raising=False)
    assert cpu_has_native_bf16() is native


def test_native_bf16_agrees_with_the_cpu_flags_on_this_machine():
    """No stand-in: on an x86 Linux machine the answer is the kernel's avx512_bf16/amx_bf16 flags."""
    import platform

    from rayrl.machine import cpu_flags, cpu_has_native_bf16

    flags = cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64") or not flags:
        pytest.skip("not an x86 Linux machine")
    assert cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_tis_cap_is_on_where_samples_can_be_stale():
    assert _resolved("pipeline.schedule=sync").algorithm.tis_cap == 0.0
    assert _resolved("pipeline.schedule=async").algorithm.tis_cap == 2.0
    assert _resolved("pipeline.schedule=colocated_async").algorithm.tis_cap == 2.0
    assert _resolved("pipeline.schedule=async", "algorithm.tis_cap=0").algorithm.tis_cap == 0.0
    assert _cfg("pipeline.schedule=async").algorithm.tis_cap is None  # load_config leaves it to resolve


def test_gspo_takes_its_ratio_against_the_trainers_own_logprobs_by_default():
    # GSPO's 3e-4 band is narrower than the engine-trainer gap: tis_cap > 0 puts the proximal (trainer) log-probs
    # in the ratio's denominator (rayrl/rl/objective.py) even in sync; set explicitly, it stays as set.
    assert _resolved("pipeline.schedule=sync", "algorithm.policy_loss=gspo").algorithm.tis_cap == 2.0
    explicit = _resolved("pipeline.schedule=sync", "algorithm.policy_loss=gspo", "algorithm.tis_cap=0")
    assert explicit.algorithm.tis_cap == 0.0
    assert _resolved("pipeline.schedule=sync", "algorithm.policy_loss=cispo").algorithm.tis_cap == 0.0


def test_tokenizer_path_defaults_to_the_model_path():
    assert _resolved("model.path=/models/m").model.tokenizer_path == "/models/m"
    assert _resolved("model.tokenizer_path=/tok").model.tokenizer_path == "/tok"


def test_weight_transfer_is_left_for_the_pipeline():
    assert _resolved().pipeline.weight_transfer == "auto"


@pytest.mark.parametrize(
    "overrides",
    [(), ("pipeline.schedule=async",), ("pipeline.schedule=colocated_async", "pipeline.eval_interval=1",
                                         "data.val_path=examples/calculator/data/val.jsonl"),
     ("pipeline.schedule=async", "pipeline.groups_in_flight=5", "algorithm.tis_cap=1.0", "engine.backend=cpu")],
)
def test_resolve_is_idempotent_and_what_the_run_records(overrides, tmp_path):
    once = _resolved(*overrides)
    assert resolve(once, CPU) == once
    assert resolve(once, Machine(cores=64, cuda=True)) == once  # nothing auto is left to depend on the machine
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(once))
    assert load_config(saved) == once


# -- the package imports nothing above it --------------------------------------------------------------


def test_config_imports_no_other_rayrl_module():
    code = ("import sys, rayrl.config\n"
            "print(' '.join(m for m in sys.modules\n"
            "               if m.startswith('rayrl.') and not m.startswith('rayrl.config')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == ""
