"""The shared prefix's keys and values as a read-only cache, and activation checkpointing that keeps it.

``trainer.share_prefix`` runs the tokens every sample of a micro-batch starts with once and gives their keys
and values to the rest of the forward pass as a transformers cache. transformers' own caches grow inside
each attention layer (``DynamicLayer.update`` appends the micro-batch's keys to the stored ones and keeps the
result), which has two costs here:

- every layer's joined keys and values (the prefix repeated for each sample, then the sample's own) stay in
  the cache until the forward pass ends, on top of what autograd keeps: at the bench's batch (16 samples,
  253 keys, SmolLM2's 3 key-value heads, 30 layers) 186 MB alive at the memory peak, the end of the forward;
- a layer run twice would append twice, so transformers' activation checkpointing, which recomputes each
  layer in the backward pass, drops any cache it is given, and the trainer turned prefix sharing off under
  ``trainer.gradient_checkpointing``: every sample then ran the whole shared prompt again.

:func:`read_only_prefix` makes a cache whose layers return the prefix (broadcast over the batch, never copied
per sample into the cache) joined to the new keys and values, and store nothing: the join is freed once
attention has used it, and a recomputed layer sees exactly what the first run saw. :func:`checkpoint_layers`
then checkpoints each decoder layer itself (``torch.utils.checkpoint``, non-reentrant), with the cache
passed through, so checkpointing and prefix sharing work together (the prefix's own forward, one sample's
prefix with a cache that grows, is not checkpointed). Gradients are the same (the recomputed
layer repeats the first run's ops); what changes is memory (each layer keeps only its input) and time
(each layer's forward runs twice).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


def _layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class PrefixLayer(DynamicLayer):
        """One layer's prefix keys and values, shape ``(1, heads, prefix, dim)``; ``update`` stores nothing."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            super().__init__()
            self.dtype, self.device = keys.dtype, keys.device
            self.keys, self.values = keys, values
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                   cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            n = key_states.shape[0]
            return (torch.cat([self.keys.expand(n, -1, -1, -1), key_states], dim=-2),
                    torch.cat([self.values.expand(n, -1, -1, -1), value_states], dim=-2))

    return PrefixLayer


_PREFIX_LAYER: type | None = None


def read_only_prefix(cache: Any) -> Any | None:
    """The prefix's ``DynamicCache`` (from a forward over one sample's prefix) as a read-only cache for a
    batch of any size, or None when a layer is not a plain full-attention layer (a sliding window crops what
    it keeps; such models keep transformers' own cache)."""
    from transformers.cache_utils import Cache, DynamicLayer

    global _PREFIX_LAYER
    if not cache.layers or any(type(layer) is not DynamicLayer or layer.keys is None or layer.keys.shape[0] != 1
                               for layer in cache.layers):
        return None
    if _PREFIX_LAYER is None:
        _PREFIX_LAYER = _layer_class()
    shared = Cache(layers=[_PREFIX_LAYER(layer.keys, layer.values) for layer in cache.layers])
    shared.read_only = True  # what _checkpointed looks for
    return shared


def prefix_read_only_fits(config: Any) -> bool:
    """Whether every layer of the cache transformers makes for ``config`` is a plain full-attention layer,
    which :func:`read_only_prefix` can stand in for."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = DynamicCache(config=config).layers
    return all(type(layer) is DynamicLayer for layer in layers)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules transformers would checkpoint (``GradientCheckpointingLayer``)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    cache = kwargs.get("past_key_values")
    # no-grad passes (reference, proximal) keep nothing anyway; a cache that grows in the layer (the prefix's
    # own forward, one sample) would grow twice if the layer ran twice: that pass keeps its activations
    if not torch.is_grad_enabled() or (cache is not None and not getattr(cache, "read_only", False)):
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Checkpoint every decoder layer of ``model`` (its forward wrapped on the instance; the module tree, names
    and state dict unchanged), caches passed through. Returns how many layers were wrapped; ValueError when the
    model has none transformers knows."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError("trainer.gradient_checkpointing: this model has no decoder layers transformers can "
                         "checkpoint (GradientCheckpointingLayer)")
    for layer in layers:
        if "forward" not in vars(layer):
            layer.forward = functools.partial(_checkpointed, layer.forward)
    return len(layers)
