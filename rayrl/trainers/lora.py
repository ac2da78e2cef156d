"""LoRA adapters on a transformers model with PEFT: the trainer's side of ``trainer.lora``.

The policy is the base model with PEFT's LoRA layers injected (``get_peft_model``): only the adapter's A
and B matrices take gradients and optimizer state, the base weights stay frozen. Three consequences the
torch backend relies on:

- the reference policy of a KL term is the same model with the adapter switched off
  (:func:`adapter_off`), so no second copy of the weights is held;
- what the engines need after a step is the adapter only (:func:`adapter_tensors`, PEFT's own names, as
  ``adapter_model.safetensors`` holds them and SGLang's ``/load_lora_adapter_from_tensors`` reads them),
  with its :func:`adapter_config` (rank, alpha, target modules);
- a checkpoint holds the adapter and its optimizer state (:func:`trainable_state`), megabytes instead of
  the full model; the base comes back from the model path at resume.

:func:`merged_weights` gives the full HF-named weights with every adapter folded in (W + alpha/r * B A),
computed beside the live weights so training is not disturbed (PEFT's merge/unmerge would round the base
weights at each call). :func:`export_adapter` writes PEFT's directory format, which
``PeftModel.from_pretrained`` loads; :func:`export_merged` a plain HF model.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Iterator

import torch

from rayrl.config import LoraConfig
from rayrl.config.training import LORA_ALL_LINEAR

ADAPTER = "default"  # PEFT's adapter name: the one adapter the trainer holds


def wrap_with_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` with LoRA layers on ``cfg.target_modules`` (PEFT), base weights frozen.

    ``all-linear`` is PEFT's own shorthand: every ``nn.Linear`` but the output head. A target list that
    matches no module raises ValueError naming ``trainer.lora.target_modules``.
    """
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    targets: str | list[str] = LORA_ALL_LINEAR if list(cfg.target_modules) == [LORA_ALL_LINEAR] else \
        list(cfg.target_modules)
    peft_cfg = PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                              bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as err:
        raise ValueError(f"trainer.lora.target_modules: {list(cfg.target_modules)} on this model: {err}") from None


def leave_input_dtype_to_autocast(model: torch.nn.Module) -> int:
    """Under mixed precision (the trainer's autocast), stop PEFT casting each LoRA layer's input to the
    adapter's float32 weight dtype. PEFT keeps the adapter in float32 and casts ``x`` to it before
    ``lora_A``, and autocast then casts it back to bfloat16 for the matmul: two copies of every adapted
    layer's input in the forward and two of its gradient in the backward, for the same numbers (a bfloat16
    tensor goes to float32 and back exactly). Autocast alone picks the matmul dtype. Returns how many LoRA
    layers were switched (every one the model has)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.cast_input_dtype_enabled = False
    return len(layers)


def is_lora(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers ``*ForCausalLM`` inside ``model`` (itself when it is not a PEFT model); its modules
    are the live ones, LoRA layers included."""
    return model.get_base_model() if is_lora(model) else model


@contextlib.contextmanager
def adapter_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model, for the reference policy: every LoRA layer computes its base layer only."""
    with model.disable_adapter():
        yield


def adapter_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapter's weights under PEFT's saved names (``base_model.model.<module>.lora_A.weight``), on CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    return {name: (t.detach().to(dtype) if dtype is not None and t.is_floating_point() else t.detach()).contiguous()
            .cpu() for name, t in state.items()}


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` as a dict (what SGLang's LoRA routes take as ``config_dict``).

    PEFT resolves ``all-linear`` to every module's full path; the targets here are their last names
    (q_proj, ...), which PEFT matches as suffixes: the same modules, and what SGLang's target-module
    checks and ``--lora-target-modules`` compare."""
    config = model.peft_config[ADAPTER].to_dict()
    targets = config.get("target_modules")
    if isinstance(targets, (list, set, frozenset, tuple)):
        config["target_modules"] = sorted({str(t).rsplit(".", 1)[-1] for t in targets})
    return json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (the adapter), by their module names: what a checkpoint holds."""
    return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Put :func:`trainable_state`'s tensors back; every trainable parameter must be there, nothing else."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    missing, extra = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or extra:
        raise ValueError(f"the checkpoint's adapter does not fit trainer.lora: missing {missing[:3]}, "
                         f"unexpected {extra[:3]} ({len(missing)} missing, {len(extra)} unexpected)")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != state[name].shape:
                raise ValueError(f"the checkpoint's adapter does not fit trainer.lora: {name} has shape "
                                 f"{tuple(state[name].shape)}, the model {tuple(p.shape)} (another rank?)")
            p.copy_(state[name])


@torch.no_grad()
def merged_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full HF-named weights with the adapter folded in (W + scaling * B A), tied weights once."""
    from peft.tuners.lora import LoraLayer

    base = causal_lm(model)
    deltas = {f"{name}.base_layer.weight": module.get_delta_weight(ADAPTER)
              for name, module in base.named_modules() if isinstance(module, LoraLayer) and ADAPTER in module.lora_A}
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        t = tensor.detach()
        if name in deltas:
            t = (t.float() + deltas[name].float()).to(t.dtype)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name.replace(".base_layer.", ".")] = t.contiguous().cpu()
    return out


def export_adapter(model: torch.nn.Module, directory: str | Path) -> Path:
    """PEFT's own format: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def export_merged(model: torch.nn.Module, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """A plain HF model (config and safetensors) with the adapter merged into the weights."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    base = causal_lm(model)
    base.save_pretrained(str(directory), state_dict=merged_weights(model, dtype), safe_serialization=True)
    return directory
