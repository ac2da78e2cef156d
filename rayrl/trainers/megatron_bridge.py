"""mbridge's bridges with the layer spec ``trainer.megatron_layer_spec`` picks: Transformer Engine, or local.

mbridge 0.15.1 always builds its GPT models with Transformer Engine's layers
(``LLMBridge._get_transformer_layer_spec`` passes ``use_transformer_engine=True``), and its name tables know
only TE's parameter names, where each layer's norms are fused into the next linear
(``self_attention.linear_qkv.layer_norm_weight``, ``mlp.linear_fc1.layer_norm_weight``). Megatron's local
spec (plain megatron-core modules; runs where TE is not installed, as on the lent GPU machines) keeps the
norms as modules of their own: ``input_layernorm.weight`` and ``pre_mlp_layernorm.weight``. Everything
else (QKV merged per query group, gate and up merged in ``linear_fc1``, the embedding and output layer)
has the same names and layout in both specs, so :class:`LocalSpecBridge` only builds the local spec and
renames the two norms to TE's names before mbridge's own tables map them: loading HF weights and
``export_weights`` are mbridge's code in both specs.

What the local spec does not do: packed (THD) sequences. Megatron's local ``DotProductAttention``
asserts ``packed_seq_params is None`` (megatron/core/transformer/dot_product_attention.py), so a trainer
on the local spec runs one sample per micro-batch with a plain causal mask
(``trainer.sequence_packing`` false, no context parallelism; rayrl/config validates it).
"""

from __future__ import annotations

import re
from typing import Any, Optional

LAYER_SPECS = ("transformer_engine", "local")

# local spec name (inside decoder.layers.<n>.) -> the TE spec's name for the same weight
_LOCAL_TO_TE = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}
_LAYER_NAME = re.compile(r"^(.*decoder\.layers\.\d+\.)(.+)$")

# fused kernels the local spec would otherwise ask for (Apex or Megatron's own CUDA extensions: neither is
# on a machine without Transformer Engine); mbridge turns the softmax fusion on
LOCAL_SPEC_ARGS = {"masked_softmax_fusion": False, "apply_rope_fusion": False, "bias_activation_fusion": False,
                   "bias_dropout_fusion": False, "gradient_accumulation_fusion": False, "persist_layer_norm": False}


def te_name(name: str) -> str:
    """The Transformer Engine spec's name of a local-spec parameter (other names unchanged)."""
    match = _LAYER_NAME.match(name)
    if match and match.group(2) in _LOCAL_TO_TE:
        return match.group(1) + _LOCAL_TO_TE[match.group(2)]
    return name


class LocalSpecBridge:
    """Mixed in before an mbridge bridge class: Megatron's local layer spec, under mbridge's name tables."""

    config: Any

    def _get_transformer_layer_spec(self, vp_stage: Optional[int] = None) -> Any:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, vp_stage=vp_stage)

    def _weight_name_mapping_mcore_to_hf(self, mcore_weights_name: str) -> list[str]:
        return super()._weight_name_mapping_mcore_to_hf(te_name(mcore_weights_name))  # type: ignore[misc]


def make_bridge(model_path: str, layer_spec: str, **kwargs: Any) -> Any:
    """mbridge's bridge for the model at ``model_path`` (AutoBridge picks the family), building
    ``layer_spec``'s layers; ``kwargs`` go to the bridge (``dtype``, ...)."""
    from mbridge import AutoBridge

    if layer_spec not in LAYER_SPECS:
        raise ValueError(f"megatron layer spec {layer_spec!r}: one of {', '.join(LAYER_SPECS)}")
    bridge = AutoBridge.from_pretrained(model_path, **kwargs)
    if layer_spec == "local":
        local = type(f"Local{type(bridge).__name__}", (LocalSpecBridge, type(bridge)), {})
        bridge = local(bridge.hf_config, **kwargs)
        bridge.set_extra_args(**LOCAL_SPEC_ARGS)
    return bridge
