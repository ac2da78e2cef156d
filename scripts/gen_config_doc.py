"""Regenerate docs/config.md from rayrl/config/'s section modules (field comments are the documentation).

    python scripts/gen_config_doc.py
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from rayrl import config as C

ROOT = Path(__file__).resolve().parents[1]
SECTION_MODULES = ("schema.py", "data_sources.py", "serving.py", "rollout.py", "training.py",
                   "algorithm.py", "guards.py")  # rayrl/config/


INTRO = """\
One YAML file maps onto `rayrl.config.RunConfig` (typed dataclasses, OmegaConf structured config).
Unknown keys, wrong types and invalid values fail at load with the dotted name of the field.
Fields with a fixed set of values (written `a / b / c` below) are `Literal` types, so any other value fails
at load too; ranges are checked by each section, rules across sections by `RunConfig`. The names the
plug-in tables hold (`engine.backend`, `algorithm.policy_loss`, `algorithm.advantage_estimator`,
`data.format`) and their traits against the other sections (a grouped estimator and `rollout.group_size`,
a whole-sequence loss and `trainer.cp_size`, ...) are checked a step above the config, by
`rayrl.resolve.check`, which driver.py runs before Ray starts (docs/contributing.md). A backend's own
options are a nested section (`engine.sglang`).
Override any field on the command line: `python driver.py --config FILE trainer.steps=3 rollout.group_size=8`.
This page is generated from the comments in rayrl/config/ (schema.py, serving.py, rollout.py, training.py,
algorithm.py, guards.py) by scripts/gen_config_doc.py. Keys removed or moved since an older rayrl (`trainer.loss`,
`trainer.kl_coef`, `engine.mem_fraction_static`, ...) fail at load with what to write instead.

**Resolve.** Values that mean "auto" (`0`, unset, `auto`) stay that way in the loaded config;
`rayrl.resolve(cfg, machine)` turns all of them into concrete values in one place, for the
machine's cores (its CPU affinity) and whether it has CUDA: `engine.backend`, `engine.num_threads`,
`trainer.num_threads`, `pipeline.groups_in_flight` (in `sync` always `rollout.prompts_per_step`),
`rollout.max_concurrent_episodes`, `model.tokenizer_path` and, in `algorithm`, `tis_cap`, the clip
ranges, `loss_agg`, `loss_agg_norm`, `dynamic_sampling_max_groups` and `reference_path`
(docs/algorithms.md). A run works on the resolved config and saves it as
`<logging.output_dir>/<exp_id>/config.yaml`, so the file says what ran; loading it and resolving again
changes nothing. Two exceptions: `pipeline.weight_transfer: auto` depends on where each engine is
placed and is decided when the engines start, and `engine.weight_format: auto` depends on the model's
family (whether the CPU engine's own decode path covers it) and is decided by each CPU engine when it
loads the model (its `/get_server_info` says which).
"""  # the page's opening paragraphs


def field_comments() -> dict[str, dict[str, str]]:
    comments: dict[str, dict[str, str]] = {}
    cls = field = None
    sources = [ROOT / "rayrl" / "config" / name for name in SECTION_MODULES]
    for line in "\n".join(p.read_text() for p in sources).splitlines():
        if m := re.match(r"class (\w+)", line):
            cls, field = m.group(1), None
            comments[cls] = {}
        elif cls and (m := re.match(r"    (\w+): [^=]+=.*?#\s*(.*)$", line)):
            field = m.group(1)
            comments[cls][field] = m.group(2).replace("|", "/")
        elif cls and field and (m := re.match(r"    #\s*(.*)$", line)):  # a comment wrapped onto the next lines
            comments[cls][field] += " " + m.group(1).replace("|", "/")
        else:
            field = None
    return comments


def table_choices() -> dict[str, str]:
    """Fields typed ``str`` whose values are a registry's names (checked at load against the registry,
    which is their one source): the names, as a Literal field's comment writes them."""
    from rayrl.engines.backends import BACKENDS

    return {"engine.backend": " / ".join(("auto", *BACKENDS))}


def rows(prefix: str, section: object, comments: dict[str, dict[str, str]]) -> list[str]:
    """The table rows of a section's fields; a nested section (``engine.sglang``) follows its parent's."""
    out, nested = [], []
    choices = table_choices()
    for g in dataclasses.fields(section):
        value, name = getattr(section, g.name), f"{prefix}.{g.name}"
        if dataclasses.is_dataclass(value):
            doc = " ".join((type(value).__doc__ or "").split())
            nested += [f"| `{name}` | section | {doc} |", *rows(name, value, comments)]
            continue
        meaning = comments[type(section).__name__].get(g.name, "")
        if name in choices:
            meaning = f"{choices[name]} ({meaning})"
        out.append(f"| `{name}` | `{value!r}` | {meaning} |")
        entry = _entry_class(section, g.name)
        if entry is not None:  # a list of records (data.reasoning_gym): each entry's fields as name[].field
            out += rows(f"{name}[]", entry(), comments)
    return out + nested


def _entry_class(section: object, name: str) -> type | None:
    """The dataclass a ``list[...]`` field's entries are, or None."""
    hint = typing.get_type_hints(type(section)).get(name)
    if typing.get_origin(hint) is list:
        (arg,) = typing.get_args(hint)
        return arg if dataclasses.is_dataclass(arg) else None
    return None


def main() -> None:
    comments = field_comments()
    root = C.RunConfig()
    out = [
        "# Configuration reference",
        "",
        *INTRO.splitlines(),
        "",
        "## Top level",
        "",
        "| field | default | meaning |",
        "|---|---|---|",
    ]
    for f in dataclasses.fields(root):
        value = getattr(root, f.name)
        if not dataclasses.is_dataclass(value):
            out.append(f"| `{f.name}` | `{value!r}` | {comments['RunConfig'].get(f.name, '')} |")
    for f in dataclasses.fields(root):
        sub = getattr(root, f.name)
        if not dataclasses.is_dataclass(sub):
            continue
        doc = " ".join((type(sub).__doc__ or "").split())  # the class docstring, on one line
        out += ["", f"## `{f.name}`: {doc}", "", "| field | default | meaning |", "|---|---|---|"]
        out += rows(f.name, sub, comments)
    (ROOT / "docs" / "config.md").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
