"""Config: YAML -> typed dataclasses; unknown keys, wrong types and bad values fail naming the field.

``load_config`` checks the schema (types, choices, ranges, rules across sections); ``load_checked``
(rayrl/resolve.py, what driver.py runs before Ray) adds what the plug-in tables say: names and traits."""

from pathlib import Path

import pytest

from rayrl.config import ConfigError, RunConfig, SGLangConfig, TrainerConfig, load_config, to_yaml
from rayrl.resolve import check, load_checked

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "calculator" / "config.yaml"


def test_example_config_loads_typed():
    cfg = load_config(EXAMPLE)
    assert isinstance(cfg, RunConfig)
    assert isinstance(cfg.trainer, TrainerConfig)
    assert cfg.rollout.group_size == 4 and cfg.rollout.prompts_per_step == 4
    assert cfg.gateway.inject_tool_schemas is False


def test_dotted_overrides_apply_with_types():
    cfg = load_config(EXAMPLE, ["trainer.steps=3", "rollout.group_size=8", "trainer.lr=1e-4"])
    assert cfg.trainer.steps == 3 and cfg.rollout.group_size == 8
    assert cfg.trainer.lr == pytest.approx(1e-4)


@pytest.mark.parametrize(
    "override, field",
    [
        (["trainer.stepz=3"], "trainer.stepz"),
        (["trainer.steps=many"], "trainer.steps"),
        (["pipeline.schedule=fast"], "pipeline.schedule"),
        (["rollout.group_size=1"], "rollout.group_size"),
        (["trainer.lr=0"], "trainer.lr"),
        (["rollout.top_p=1.5"], "rollout.top_p"),
        (["exp_id=a/b"], "exp_id"),
        (["nosuchsection.x=1"], "nosuchsection"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_checked(EXAMPLE, override)
    assert str(err.value).startswith(field), str(err.value)


def test_bad_yaml_file_names_the_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  steps: 3\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match="trainer.learning_rate"):
        load_config(path)
    path.write_text("rollout:\n  max_turns: [1, 2]\n")
    with pytest.raises(ConfigError, match="rollout.max_turns"):
        load_config(path)


def test_missing_file_and_malformed_override():
    with pytest.raises(ConfigError, match="not found"):
        load_config("/nonexistent/config.yaml")
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(EXAMPLE, ["trainer.steps"])


def test_round_trip_yaml(tmp_path):
    cfg = load_config(EXAMPLE, ["trainer.steps=5"])
    path = tmp_path / "saved.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(path) == cfg


def test_every_field_documented():
    """docs/config.md mentions every config field by its dotted name."""
    import dataclasses

    doc = (ROOT / "docs" / "config.md").read_text()

    def walk(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            name = f"{prefix}{f.name}"
            if dataclasses.is_dataclass(value):
                yield from walk(value, name + ".")
            else:
                yield name

    missing = [name for name in walk(RunConfig()) if f"`{name}`" not in doc]
    assert not missing, f"undocumented config fields: {missing}"


def _literal_fields():
    """(dotted name, allowed values) of every field whose type is a Literal."""
    import dataclasses
    import typing

    for section in dataclasses.fields(RunConfig):
        cls = section.default_factory if section.default_factory is not dataclasses.MISSING else None
        if cls is None or not dataclasses.is_dataclass(cls):
            continue
        for name, hint in typing.get_type_hints(cls).items():
            if typing.get_origin(hint) is typing.Literal:
                yield f"{section.name}.{name}", typing.get_args(hint)


LITERAL_FIELDS = dict(_literal_fields())


def test_choices_are_literal_types():
    assert LITERAL_FIELDS["pipeline.schedule"] == ("sync", "async", "colocated_async")
    assert {"engine.dtype", "algorithm.loss_agg", "trajectory.on_drift", "sandbox.isolation", "placement.mode",
            "pipeline.weight_transfer", "logging.log_level"} <= set(LITERAL_FIELDS)


@pytest.mark.parametrize("old", ["mem_fraction_static", "enable_memory_saver"])
def test_sglangs_own_options_moved_to_their_section(old, tmp_path):
    """engine.<SGLang flag> of an older rayrl fails at load, from the command line or a YAML file, naming
    the key and where it lives now; there it loads and reaches only the sglang backend's command."""
    value = {"mem_fraction_static": "0.55", "enable_memory_saver": "false"}[old]
    with pytest.raises(ConfigError, match=rf"^engine.{old}: moved; write engine.sglang.{old} "):
        load_config(None, [f"engine.{old}={value}"])
    path = tmp_path / "old.yaml"
    path.write_text(f"engine:\n  backend: sglang\n  {old}: {value}\n")
    with pytest.raises(ConfigError, match=rf"^engine.{old}: moved; write engine.sglang.{old} "):
        load_config(path)
    path.write_text(f"engine:\n  backend: sglang\n  sglang:\n    {old}: {value}\n")
    engine = load_config(path).engine
    assert engine.sglang == SGLangConfig(**{old: {"0.55": 0.55, "false": False}[value]})
    from rayrl.engines.backends import BACKENDS

    sglang, cpu = (" ".join(BACKENDS[name].command(engine, "/m", 1)) for name in ("sglang", "cpu"))
    assert ("--mem-fraction-static 0.55" in sglang) is (old == "mem_fraction_static")
    assert ("--enable-memory-saver" in sglang) is (old != "enable_memory_saver")
    assert "mem-fraction" not in cpu and "memory-saver" not in cpu


@pytest.mark.parametrize("field", sorted(LITERAL_FIELDS))
def test_a_value_outside_a_literal_names_the_field(field):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{field}=bogus"])
    assert type(err.value) is ConfigError and str(err.value).startswith(f"{field}: "), str(err.value)
    assert "bogus" in str(err.value) and all(choice in str(err.value) for choice in LITERAL_FIELDS[field])


@pytest.mark.parametrize(
    "override, message",
    [
        ("engine.num_engines=0", "engine.num_engines: must be > 0, got 0"),
        ("engine.tp_size=0", "engine.tp_size: must be >= 1"),
        ("engine.max_logprob_gap=-0.1", "engine.max_logprob_gap: must be >= 0"),
        ("engine.max_logprob_gap=nan", "engine.max_logprob_gap: must be a finite number"),
        ("engine.backend=tgi", "engine.backend: 'tgi' is not one of auto, cpu, sglang, vllm, vllm-cpu"),
        ("engine.sglang.mem_fraction_static=0", "engine.sglang.mem_fraction_static: must be in (0, 1], got 0"),
        ("engine.sglang.mem_fraction_static=1.5", "engine.sglang.mem_fraction_static: must be in (0, 1]"),
        ("engine.weight_format=int3", "engine.weight_format"),
        ("gateway.port=-1", "gateway.port: must be >= 0, got -1"),
        ("sandbox.timeout_s=0", "sandbox.timeout_s: must be > 0"),
        ("sandbox_pool.min_warm=64", "sandbox_pool.min_warm: must not exceed sandbox_pool.max_size"),
        ("rollout.min_groups_fraction=0", "rollout.min_groups_fraction: must be in (0, 1]"),
        ("rollout.tool_delay_s=[3,1]", "rollout.tool_delay_s: need [] or [min, max]"),
        ("agentcore.acr_burst=0", "agentcore.acr_burst: must be > 0"),
        ("agentcore.max_retries=-1", "agentcore.max_retries: must be >= 0"),
        ("trainer.betas=[0.9]", "trainer.betas: need two values"),
        ("algorithm.tis_cap=-1", "algorithm.tis_cap: must be >= 0"),
        ("trainer.weight_bucket_mb=0", "trainer.weight_bucket_mb: must be >= 1"),
        ("placement.cpus_per_bundle=-1", "placement.cpus_per_bundle: must be >= 0"),
        ("pipeline.max_staleness=-1", "pipeline.max_staleness: must be >= 0"),
        ("pipeline.eval_max_concurrent=0", "pipeline.eval_max_concurrent: must be >= 1"),
        ("pipeline.checkpoint_dir=s3:///x", "pipeline.checkpoint_dir: 's3:///x' names no bucket"),
        ("model.path=''", "model.path: must not be empty"),
        ("seed=-1", "seed: must be >= 0"),
    ],
)
def test_out_of_range_values_name_the_field(override, message):
    """Raised by the dataclasses while OmegaConf builds them, or by the check against the tables: a plain
    ConfigError, not an OmegaConf one."""
    with pytest.raises(ConfigError) as err:
        load_checked(None, [override])
    assert type(err.value) is ConfigError and str(err.value).startswith(message), str(err.value)
    assert err.value.__cause__ is None


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.group_size=1"], "rollout.group_size: grpo measures each episode against its group"),
        (["engine.backend=sglang", "engine.weight_format=fp16-packed"], "engine.weight_format: fp16-packed is the CPU"),
        (["engine.dtype=bfloat16", "engine.weight_format=fp16-packed"],
         "engine.weight_format: fp16-packed packs float32"),
        (["pipeline.eval_interval=2"], "pipeline.eval_interval: set data.val_path"),
        (["pipeline.schedule=async", "rollout.prompts_per_step=4", "pipeline.groups_in_flight=2"],
         "pipeline.groups_in_flight: must be 0 or at least rollout.prompts_per_step"),
        (["rollout.group_size=8", "pipeline.episode_budget=5"],
         "pipeline.episode_budget: 5 is less than one group (rollout.group_size 8"),
        (["rollout.agent=agentcore"], "agentcore.runtime_arn: rollout.agent=agentcore needs a runtime ARN"),
        (["placement.mode=split", "placement.num_gpus=4", "placement.trainer_gpus=1"],
         "placement.trainer_gpus: split gives the trainer 1 GPUs"),
    ],
)
def test_cross_section_rules_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        load_checked(None, overrides)


def test_sections_check_themselves_wherever_they_are_built():
    import dataclasses

    with pytest.raises(ConfigError, match="^trainer.lr: must be > 0"):
        TrainerConfig(lr=0.0)
    with pytest.raises(ConfigError, match="^trainer.tp_size: tp/pp/cp sizes above 1 need trainer.backend megatron"):
        check(RunConfig(trainer=TrainerConfig(tp_size=2, num_ranks=2)))  # the trainer backend's trait
    with pytest.raises(ConfigError, match="^exp_id: must be a plain name"):
        dataclasses.replace(RunConfig(), exp_id="..")


def test_the_local_megatron_layer_spec_has_no_packed_sequences():
    """Megatron's local attention refuses THD-packed sequences: the config says so before anything starts."""
    local = dict(backend="megatron", megatron_layer_spec="local")
    with pytest.raises(ConfigError, match="^trainer.megatron_layer_spec: local has no packed"):
        TrainerConfig(**local)
    with pytest.raises(ConfigError, match="^trainer.megatron_layer_spec"):
        TrainerConfig(**local, sequence_packing=False, cp_size=2, num_ranks=2)
    assert TrainerConfig(**local, sequence_packing=False).megatron_layer_spec == "local"


def test_layout_has_one_home_the_config_runs_at_load():
    """plan_placement checks the layout and lays it out; the check before Ray runs that same function."""
    import dataclasses

    from rayrl.config import PlacementConfig
    from rayrl.placement import plan_placement

    plan_placement("colocated", 2, trainer_ranks=2, num_engines=1, tp_size=2)
    with pytest.raises(ConfigError, match="^placement.num_gpus: colocated needs trainer.num_ranks"):
        plan_placement("colocated", 2, trainer_ranks=1, num_engines=1, tp_size=2)
    with pytest.raises(ConfigError, match="^placement.trainer_gpus: split needs 1..1, got 2"):
        plan_placement("split", 2, trainer_ranks=2, num_engines=0, tp_size=1, trainer_gpus=2)
    with pytest.raises(ConfigError, match="^placement.num_gpus: colocated needs trainer.num_ranks"):
        check(dataclasses.replace(RunConfig(), placement=PlacementConfig(mode="colocated", num_gpus=2)))


def test_literal_choices_are_the_tables_rows():
    """Where a Literal type lists a plug-in table's names (for OmegaConf's error and docs/config.md), it holds the
    table's rows exactly: a row added without its name, or a name without its row, fails here."""
    from rayrl.orchestration.schedules import SCHEDULES
    from rayrl.sandboxes.factory import PROVIDERS
    from rayrl.trainers.backend import TRAINER_BACKENDS

    assert set(LITERAL_FIELDS["pipeline.schedule"]) == set(SCHEDULES)
    assert set(LITERAL_FIELDS["trainer.backend"]) == set(TRAINER_BACKENDS)
    assert set(LITERAL_FIELDS["sandbox.backend"]) == set(PROVIDERS)


def test_the_config_imports_no_table():
    """rayrl/config is pure data: importing it imports no other rayrl module (the resolve step does)."""
    import subprocess
    import sys

    code = "import sys, rayrl.config; print(sorted(m for m in sys.modules if m.startswith('rayrl.') " \
           "and not m.startswith('rayrl.config')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
    # nor do the modules a rollout worker's agent and the inspector load reach the loss table (and torch)
    code = ("import sys, rayrl.config, rayrl.agents, rayrl.rl.failures, rayrl.inspect.reader; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
