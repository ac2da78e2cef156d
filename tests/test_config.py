"""Config: YAML -> typed dataclasses; unknown keys, wrong types and bad values fail naming the field."""

from pathlib import Path

import pytest

from rayrl.config import ConfigError, RunConfig, TrainerConfig, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[1]
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
        load_config(EXAMPLE, override)
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
