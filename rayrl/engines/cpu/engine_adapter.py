"""The CPU engine's LoRA adapter: loaded from tensors, merged into its weights, served by name.

A mixin of :class:`rayrl.engines.cpu.engine.CPUEngine`. An RL run updates the adapter after every step and
then generates thousands of tokens with it, so the engine merges it into the weights it decodes with
(W = W0 + alpha/r * B A, then the lean decode path repacks just those matrices) instead of adding two
small matmuls to every linear layer at every decode step (bench/lora.py compares both; docs/lora.md).
The base weights of the adapted layers are kept once, on the first load, so every update merges onto the
same W0 and nothing accumulates rounding.

It serves one adapter at a time (merged, it is the engine's weights): requests must name it
(``lora_path``), as SGLang's would to be served by it, and a second name is refused until the first is
unloaded. The request shapes are SGLang 0.5.9's (``/load_lora_adapter_from_tensors``,
``/unload_lora_adapter``; rayrl/engines/cpu/weight_routes.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

PEFT_PREFIX = "base_model.model."  # PEFT's saved names: base_model.model.<module>.lora_A.weight


class AdapterError(ValueError):
    """An adapter this engine cannot load or a request naming one it does not serve (a 400)."""


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    rank: int
    scaling: float
    modules: tuple[str, ...]  # the weight names it changes


def adapter_scaling(config: Mapping[str, Any]) -> tuple[int, float]:
    """(rank, scaling) from an ``adapter_config.json`` dict; AdapterError for what the merge cannot honour."""
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"config_dict.r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise AdapterError(f"config_dict.lora_alpha must be a positive number, got {alpha!r}")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise AdapterError(f"config_dict.{key}: not supported by the CPU engine")
    if config.get("bias", "none") != "none":
        raise AdapterError("config_dict.bias: the CPU engine merges LoRA weights only (bias none)")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError("config_dict.rank_pattern/alpha_pattern: one rank and alpha for every layer only")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def pair_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Weight name (HF, ``model.layers.0.self_attn.q_proj.weight``) -> (A, B), from PEFT's saved names."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        module, sep, part = name.rpartition(".lora_")
        if not sep or part not in ("A.weight", "B.weight") or not module.startswith(PEFT_PREFIX):
            raise AdapterError(f"tensor {name!r} is not a LoRA weight under PEFT's names "
                               f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        pairs.setdefault(module[len(PEFT_PREFIX):] + ".weight", {})[part[0]] = tensor
    if not pairs:
        raise AdapterError("the adapter holds no tensors")
    out = {}
    for weight, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weight}: lora_A and lora_B come in pairs, got only lora_{''.join(ab)}")
        out[weight] = (ab["A"], ab["B"])
    return out


class AdapterMixin:
    """LoRA adapters, merged (mixed into CPUEngine, which sets ``max_lora_rank`` and ``_adapter``)."""

    _params: dict[str, torch.Tensor]
    max_lora_rank: int  # 0: LoRA off (SGLang's --enable-lora not given)
    lora_target_modules: Optional[frozenset[str]]  # the modules an adapter may change (None: any)
    _adapter: Optional[LoadedAdapter]
    _adapter_base: dict[str, torch.Tensor]  # W0 of every weight an adapter changed, kept from the first load
    _replace_weights: Any  # engine_weights.WeightsMixin: copy into the model and repack, between decode steps

    @property
    def adapter(self) -> Optional[LoadedAdapter]:
        return self._adapter

    def check_adapter_request(self, lora_path: Any) -> None:
        """A /generate's ``lora_path`` must name the adapter this engine serves, and must be given while one
        is loaded (its weights are merged: there is no base model to serve meanwhile)."""
        names = lora_path if isinstance(lora_path, list) else [lora_path]
        if not all(n is None or isinstance(n, str) for n in names):
            raise AdapterError("lora_path must be a string, null or a list of them")
        loaded = self._adapter.name if self._adapter is not None else None
        if self.max_lora_rank < 1 and any(names):
            raise AdapterError(f"LoRA adapter {next(n for n in names if n)!r} was requested, but LoRA is not "
                               "enabled. Please launch the server with --enable-lora")
        for name in names:
            if name is not None and name != loaded:
                raise AdapterError(f"lora_path {name!r}: no such adapter is loaded "
                                   f"(loaded: {[loaded] if loaded else []})")
            if name is None and loaded is not None:
                raise AdapterError(f"this engine serves adapter {loaded!r} merged into its weights; requests must "
                                   "name it in lora_path")

    def load_adapter(self, name: str, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> int:
        """Merge adapter ``name`` into the weights between decode steps; returns the weights changed.
        Everything is checked before any weight changes."""
        if self.max_lora_rank < 1:
            raise AdapterError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        if self._adapter is not None and self._adapter.name == name:  # SGLang's own words
            raise AdapterError(f"Failed to load LoRA adapter {name} because it is already loaded")
        if self._adapter is not None:
            raise AdapterError(f"Failed to load LoRA adapter {name} because adapter {self._adapter.name!r} is "
                               "loaded: the CPU engine serves one adapter, merged; unload it first")
        rank, scaling = adapter_scaling(config)
        if rank > self.max_lora_rank:
            raise AdapterError(f"LoRA adapter {name} has rank {rank}, above --max-lora-rank {self.max_lora_rank}")
        pairs = pair_tensors(tensors)
        for weight, (a, b) in pairs.items():
            module = weight.rsplit(".", 2)[-2]
            if self.lora_target_modules is not None and module not in self.lora_target_modules:
                raise AdapterError(f"LoRA adapter {name} changes {module}, which is not in --lora-target-modules "
                                   f"{sorted(self.lora_target_modules)}")
            target = self._params.get(weight)
            if target is None:
                raise AdapterError(f"{weight}: this model has no such weight to adapt")
            out_f, in_f = target.shape
            if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
                raise AdapterError(f"{weight}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                                   f"rank {rank} on a {out_f}x{in_f} weight")

        merged = {}
        for weight, (a, b) in pairs.items():
            if weight not in self._adapter_base:  # W0, before the first adapter changes it
                self._adapter_base[weight] = self._params[weight].detach().clone()
            base = self._adapter_base[weight]
            delta = (b.to(base.device).float() @ a.to(base.device).float()).mul_(scaling)
            merged[weight] = delta.add_(base).to(base.dtype)  # never in place on base: .float() may be it
        count = self._replace_weights(merged, None)
        self._adapter = LoadedAdapter(name, rank, scaling, tuple(sorted(pairs)))
        return count

    def unload_adapter(self, name: str) -> int:
        """Put the base weights back (between decode steps); returns the weights restored."""
        if self._adapter is None or self._adapter.name != name:
            loaded = [self._adapter.name] if self._adapter is not None else []
            raise AdapterError(f"LoRA adapter {name} is not loaded (loaded: {loaded})")
        # the packed copies are rebuilt by the next load (an RL update: unload, then load) or before the
        # next step that decodes with the base
        count = self._replace_weights({w: self._adapter_base[w] for w in self._adapter.modules}, None,
                                      repack_now=False)
        self._adapter = None
        return count

