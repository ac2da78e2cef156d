"""The Megatron backend held against the pinned megatron-core (0.15.3) and mbridge (0.15.1), on CPU.

What runs here: a real megatron-core GPTModel (the local layer spec: Transformer Engine needs CUDA) inside
Megatron's real wrappers (Float16Module, and DDP's base class: DDP itself allocates its buffers on CUDA),
so the checkpoint keys the backend takes are Megatron's own; what the checkpoint module hands
dist_checkpointing and the optimizer on save and on load (is_loading); mbridge's own name mapping for every
model family rayrl supports, against the real transformers models' parameter names (what the engines load
by); and mbridge's own HF load and export on the local spec, each Megatron module checked against the
transformers module loaded from the export. What cannot run on a CUDA-less torch (the source lines are in
rayrl/trainers/megatron_checkpoint.py and docs/gpu.md): Megatron's attention core, its optimizers, DDP,
dist_checkpointing's save, mbridge's get_model. tests/gpu/test_gpu_megatron_local.py runs those on a GPU
(the local spec: the device has no Transformer Engine); tests/gpu/test_gpu_megatron_bridge.py the TE spec.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

megatron = pytest.importorskip("megatron.core", reason="the pinned megatron-core wheel (make test installs it)")
warnings.filterwarnings("ignore")

from megatron.core import parallel_state as mpu  # noqa: E402

from rayrl.trainers.megatron_checkpoint import bare_model  # noqa: E402


@pytest.fixture(scope="module")
def megatron_world(tmp_path_factory):
    import torch.distributed as dist

    from rayrl.ports import free_port

    made = not dist.is_initialized()
    if made:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    mpu.initialize_model_parallel(1, 1)
    yield
    mpu.destroy_model_parallel()
    if made:
        dist.destroy_process_group()


def _gpt(bf16: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32)
    return cfg, GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=128,
                         max_sequence_length=64)


def _as_state_dict(sharded: dict) -> dict:
    """What dist_checkpointing.load hands back for a sharded state dict: its tensors under its keys (the
    save/load itself synchronizes CUDA, so it cannot run here)."""
    return {k: v.data.clone() for k, v in sharded.items() if isinstance(getattr(v, "data", None), torch.Tensor)}


def test_checkpoint_keys_are_the_bare_models_and_load_back_through_the_wrappers(megatron_world):
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.transformer.module import Float16Module

    cfg, bare = _gpt(bf16=True)
    wrapped = _BaseDataParallel(cfg, Float16Module(cfg, bare))  # what get_model(wrap_with_ddp=True) returns
    from_wrapper = _as_state_dict(wrapped.sharded_state_dict())  # where main took the keys from
    assert all(k.startswith("module.") for k in from_wrapper)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        wrapped.load_state_dict(from_wrapper)
    inner = bare_model(wrapped)
    assert inner is bare
    saved = _as_state_dict(inner.sharded_state_dict())
    assert saved and not any(k.startswith("module.") for k in saved)
    with torch.no_grad():
        for p in bare.parameters():
            p.zero_()
    wrapped.load_state_dict(saved)  # the wrappers forward it to the bare model: keys without module.
    got = bare.state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved.items())
    assert any(v.abs().sum() > 0 for v in saved.values())


class _RecordingOptimizer:
    """A recording stand-in for a Megatron optimizer: none can be built on a CUDA-less torch (each makes
    'cuda' tensors in its constructor, megatron/core/optimizer/optimizer.py). It takes the arguments
    ``DistributedOptimizer.sharded_state_dict`` and ``FP32Optimizer.sharded_state_dict`` take (checked
    below) and records what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[set, bool]] = []

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
        self.calls.append((set(model_sharded_state_dict), is_loading))
        return {"recorded": len(self.calls)}


def test_the_optimizer_load_is_told_it_is_loading(megatron_world, tmp_path, monkeypatch):
    """Megatron's optimizers build a load's layout only when told (is_loading): the checkpoint module tells
    them on load and not on save, over the whole model's sharded state. What dist_checkpointing is handed
    is recorded at its entry (its save and load cannot run on a CUDA-less torch: rayrl/trainers/
    megatron_checkpoint.py says why); the round trip itself is tests/gpu/test_gpu_megatron_local.py."""
    from megatron.core import dist_checkpointing
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer

    from rayrl.trainers import megatron_checkpoint

    for cls in (DistributedOptimizer, FP32Optimizer):  # the stand-in's signature is theirs
        params = inspect.signature(cls.sharded_state_dict).parameters
        assert list(params)[1:3] == ["model_sharded_state_dict", "is_loading"], cls
        assert params["is_loading"].default is False
    _, model = _gpt()
    keys = set(model.sharded_state_dict())
    handed = {}

    def record(name):
        def entry(sharded_state_dict, checkpoint_dir, *args, **kwargs):
            handed[name] = sharded_state_dict
            raise RuntimeError(f"recorded {name}")  # stop here: the rest needs CUDA
        return entry

    monkeypatch.setattr(dist_checkpointing, "save", record("save"))
    monkeypatch.setattr(dist_checkpointing, "load", record("load"))
    optimizer = _RecordingOptimizer()
    for call in (lambda: megatron_checkpoint.save(tmp_path, [model], optimizer, 0, {}),
                 lambda: megatron_checkpoint.load(tmp_path, [model], optimizer, 0)):
        with pytest.raises(RuntimeError, match="recorded"):
            call()
    assert optimizer.calls == [(keys, False), (keys, True)]  # save: the save's layout; load: the load's
    for name in ("save", "load"):
        assert set(handed[name]) == {"model0", "optimizer"} and set(handed[name]["model0"]) == keys


def _te_names(layers: int, qkv_bias: bool, qk_norm: bool) -> list[str]:
    """Megatron parameter names of a Transformer Engine GPT (mbridge's layer spec): fused layernorms."""
    names = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"]
    for i in range(layers):
        p = f"decoder.layers.{i}."
        names += [p + "self_attention.linear_qkv.weight", p + "self_attention.linear_qkv.layer_norm_weight",
                  p + "self_attention.linear_proj.weight", p + "mlp.linear_fc1.weight",
                  p + "mlp.linear_fc1.layer_norm_weight", p + "mlp.linear_fc2.weight"]
        names += [p + "self_attention.linear_qkv.bias"] if qkv_bias else []
        names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"] if qk_norm else []
    return names


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_mbridge_maps_every_megatron_weight_to_the_hf_names_the_engines_load(megatron_world, family):
    import transformers
    from mbridge import AutoBridge

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[family]
    config = config_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    hf_names = {n for n in hf.state_dict() if not n.endswith("rotary_emb.inv_freq")}
    bridge = AutoBridge.from_config(config)
    mapped = [n for name in _te_names(2, family == "qwen2", family == "qwen3")
              for n in bridge._weight_name_mapping_mcore_to_hf(name)]
    assert len(mapped) == len(set(mapped)) and set(mapped) == hf_names, set(mapped) ^ hf_names


def _local_spec_model(family: str, tmp_path):
    """A tiny HF model (GQA: 2 query heads per key/value head) saved here, and the same weights in a
    Megatron GPTModel on the local layer spec, built and loaded by mbridge's own code (its model provider
    and ``load_weights``, which merges q, k, v per query group). Only mbridge's ``get_model`` is left out:
    it moves the model to CUDA (mbridge/core/util.py get_model, ``model_module.cuda``)."""
    import transformers

    from rayrl.trainers.megatron_bridge import make_bridge

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    config = config_cls(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                        max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    bridge = make_bridge(str(tmp_path), "local", dtype=torch.float32)
    bridge.set_extra_args(use_cpu_initialization=True)
    model = bridge._model_provider([])(pre_process=True, post_process=True)
    bridge.load_weights([model], str(tmp_path))
    return config, hf, bridge, model


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_local_spec_export_through_mbridge_loads_into_transformers_and_computes_the_same(megatron_world, family,
                                                                                        tmp_path):
    """mbridge's export of a local-spec model (QKV split per query group, gate/up split, the norms renamed)
    loads strictly into the transformers model, and each of Megatron's own modules computes on CPU what the
    transformers module computes from the exported weights: q, k and v head by head through Megatron's own
    ``get_query_key_value_tensors``, the attention output projection, the norms, the gated MLP, the
    embedding and the output layer. Megatron's attention core cannot run on a CUDA-less torch (its
    ``DotProductAttention`` takes its score buffer from ``get_global_memory_buffer``, allocated with
    ``device=torch.cuda.current_device()``), so whole-model logits are compared on the GPU
    (tests/gpu/test_gpu_megatron_local.py)."""
    import transformers

    config, hf, bridge, model = _local_spec_model(family, tmp_path)
    with torch.no_grad():  # weights unlike the loaded ones, so the export is checked, not the load's input
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    exported = {name: t.detach().clone() for name, t in bridge.export_weights([model])}
    assert set(exported) == set(hf.state_dict())
    out = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    missing, unexpected = out.load_state_dict(exported, strict=True)
    assert not missing and not unexpected

    torch.manual_seed(1)
    x = torch.randn(7, 1, config.hidden_size)  # Megatron's [sequence, batch, hidden]
    heads, groups, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    with torch.no_grad():
        for i, (ours, theirs) in enumerate(zip(model.decoder.layers, out.model.layers)):
            att, hf_att = ours.self_attention, theirs.self_attn
            q, k, v = att.get_query_key_value_tensors(x, None)  # [s, b, heads, hd], Megatron's own split
            torch.testing.assert_close(q, hf_att.q_proj(x).view(7, 1, heads, hd), msg=f"layer {i} q")
            torch.testing.assert_close(k, hf_att.k_proj(x).view(7, 1, groups, hd), msg=f"layer {i} k")
            torch.testing.assert_close(v, hf_att.v_proj(x).view(7, 1, groups, hd), msg=f"layer {i} v")
            torch.testing.assert_close(att.linear_proj(x)[0], hf_att.o_proj(x), msg=f"layer {i} o")
            torch.testing.assert_close(ours.input_layernorm(x), theirs.input_layernorm(x))
            torch.testing.assert_close(ours.pre_mlp_layernorm(x), theirs.post_attention_layernorm(x))
            torch.testing.assert_close(ours.mlp(x)[0], theirs.mlp(x), msg=f"layer {i} mlp")
        torch.testing.assert_close(model.decoder.final_layernorm(x), out.model.norm(x))
        torch.testing.assert_close(model.output_layer(x)[0], out.lm_head(x))
        ids = torch.randint(0, config.vocab_size, (1, 7))
        torch.testing.assert_close(model.embedding.word_embeddings(ids), out.model.embed_tokens(ids))
