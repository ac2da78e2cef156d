"""Both trainer backends implement the one protocol a trainer rank calls (rayrl/trainers/backend.py), and
the rank calls nothing outside it: read from the code, so a call one backend lacks fails here, on CPU."""

from __future__ import annotations

import ast
import inspect
import textwrap
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rayrl.trainers import process_groups
from rayrl.trainers.backend import TrainerBackend
from rayrl.trainers.megatron_backend import MegatronTrainer
from rayrl.trainers.torch_backend import TorchTrainer

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = [TorchTrainer, MegatronTrainer]


def _protocol_methods() -> list[str]:
    return sorted(name for name, member in vars(TrainerBackend).items()
                  if inspect.isfunction(member) and not name.startswith("_"))


def _shape(func) -> list[tuple]:
    """Every parameter's name, kind, default and resolved type hint (Optional[int] equals int | None)."""
    hints = typing.get_type_hints(func, localns={"torch": torch})  # the protocol names torch in hints only
    params = [(p.name, p.kind, p.default, hints.get(p.name)) for p in inspect.signature(func).parameters.values()]
    return params + [("return", None, None, hints.get("return"))]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", _protocol_methods())
def test_backend_signatures_are_the_protocols(backend, method):
    assert callable(getattr(backend, method, None)), f"{backend.__name__} lacks {method}"
    assert _shape(getattr(backend, method)) == _shape(getattr(TrainerBackend, method))


def _assigned_in_init(cls) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda c: c.__name__)
def test_backends_hold_the_protocols_data_members(backend):
    members = set(typing.get_type_hints(TrainerBackend))
    assert members and members <= _assigned_in_init(backend)


def _attributes_on(tree: ast.AST, holder) -> set[str]:
    """Attributes read on the backend object: ``holder(node)`` says whether an expression is it."""
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and holder(node.value)}


def _is_self_trainer(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "trainer" and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def _backend_uses(source: str) -> set[str]:
    """What a rank's code touches on its backend: directly on ``self.trainer``, and inside every function
    it hands ``self.trainer`` to (rayrl/trainers/process_groups.py's offload and onload order)."""
    tree = ast.parse(source)
    used = _attributes_on(tree, _is_self_trainer)
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or not any(_is_self_trainer(a) for a in call.args):
            continue
        name = call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", "?")
        func = getattr(process_groups, name, None)
        assert func is not None, f"the rank hands its backend to {name}, which this test cannot read"
        position = next(i for i, a in enumerate(call.args) if _is_self_trainer(a))
        param = list(inspect.signature(func).parameters)[position]
        assert typing.get_type_hints(func)[param] is TrainerBackend, f"{name}({param}) is not a TrainerBackend"
        inner = ast.parse(textwrap.dedent(inspect.getsource(func)))
        used |= _attributes_on(inner, lambda n, p=param: isinstance(n, ast.Name) and n.id == p)
    return used


def test_the_rank_calls_nothing_outside_the_protocol():
    source = (ROOT / "actors" / "trainer.py").read_text()
    used = _backend_uses(source)
    allowed = set(_protocol_methods()) | set(typing.get_type_hints(TrainerBackend))
    assert {"train_step", "save_checkpoint", "offload", "onload"} <= used  # the reading finds the calls
    assert used <= allowed, f"the rank calls {sorted(used - allowed)} on its backend, outside TrainerBackend"
    # and a planted call outside it is seen
    planted = source.replace("self.trainer.load_checkpoint(directory)",
                             "self.trainer.load_checkpoint(directory)\n        self.trainer.token_logprobs([])")
    assert planted != source and "token_logprobs" in _backend_uses(planted) - allowed


def test_megatron_refuses_to_write_another_ranks_files():
    """Megatron's state is sharded over the ranks and its distributed checkpoint is one collective write:
    a rank cannot write another's part (TrainerGroup never asks: full_state_on_every_rank is False)."""
    with pytest.raises(ValueError, match="as_rank"):
        MegatronTrainer.save_checkpoint(SimpleNamespace(rank=1), "/nonexistent", as_rank=0)
