"""CPUEngine: a transformers causal LM behind a continuous-batching decode loop.

One background thread owns the model. Requests are submitted from any thread; at the top of every
iteration the loop runs queued commands (weight updates, pause), applies aborts, prefills newly
arrived requests (several at once, left-padded) and merges them into the running batch, then runs one
decode step for the whole batch. Finished requests leave the batch right after the step that finished
them. Cache data moves only at those join/leave events (see kv_cache.py); a decode step writes one
column in place. A prefix cache (prefix_cache.py) keeps the KV of prompts and finished conversations,
so a request that starts with a known prefix (the next turn of an episode, the other episodes of a
group) prefills only the new tokens. Admission and prefill live in prefill.py, the decode step and
finishing in decode.py (mixins of CPUEngine).

Every result carries the weight version that produced it. Weight updates are applied between decode
steps; a request that spans an update records which version produced each token.

Log-probs are the RAW model distribution's (``log_softmax`` of the logits, no temperature, no top-p),
as float32 — see sampling.py for why.

Prefill and decode run through lean_decode.py (the engine's own forward for Llama/Qwen models, weights
in ``weight_format``: float32 or FBGEMM-packed fp16, weight_formats.py) where the model allows, else
through the transformers forward. A weight update is copied into the model and the packed weights are
rebuilt from it inside the same loop command (engine_weights.py), so no step ever sees half-updated
packed weights; the seconds it took are counted (``weight_pack_seconds``).

One request's failure is its own: bad values are refused at :meth:`CPUEngine.submit` (ValueError, a 400
over HTTP), and what still fails inside the batch (a row that cannot be sampled, a prefill that raises,
a decode forward that raises) finishes that request alone with an engine error (``requests.engine_error``:
finish type ``abort`` with ``status_code``), see decode.py and prefill.py: a failed decode forward is run
again on halves of the batch until the rows that break it are alone. Only an error outside the forward
passes and the sampler ends every running request. ``context_length`` defaults to the model's own
maximum.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from rayrl.engines.cpu.decode import DecodeMixin
from rayrl.engines.cpu.engine_adapter import AdapterMixin
from rayrl.engines.cpu.engine_weights import DTYPES, WeightsMixin
from rayrl.engines.cpu.kv_cache import ATTENTION_NAME, BatchKV
from rayrl.engines.cpu.lean_decode import LeanDecoder
from rayrl.engines.cpu.memory_occupation import MemoryOccupationMixin
from rayrl.engines.cpu.prefill import PrefillMixin
from rayrl.engines.cpu.prefix_cache import PrefixCache
from rayrl.engines.cpu.requests import (
    GenerationResult,
    RequestHandle,
    SequenceState,
    checked_prompt,
    engine_error,
    eos_token_ids,
)
from rayrl.engines.cpu.sampling import BatchSampler, SamplingParams

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")

_RUNNING: "weakref.WeakSet[CPUEngine]" = weakref.WeakSet()


@atexit.register
def _shut_down_running_engines() -> None:
    """Stop every engine still running at exit (its owner never called shutdown): a daemon loop thread
    caught inside a torch op by finalization is unwound through C++ frames, and the process aborts."""
    for engine in list(_RUNNING):
        engine.shutdown(timeout=10.0)


class CPUEngine(PrefillMixin, DecodeMixin, WeightsMixin, AdapterMixin, MemoryOccupationMixin):
    """Continuous-batching generation over a transformers causal LM on CPU (thread-safe API)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "bfloat16",
        max_batch_size: int = 32,
        context_length: Optional[int] = None,
        num_threads: int = 0,
        weight_version: str = "0",
        prefill_budget_tokens: int = 4096,
        seed: int = 0,
        prefix_cache_mb: int = 1024,
        device: str = "cpu",
        weight_format: str = "float32",
        max_lora_rank: int = 0,
        lora_target_modules: Optional[Sequence[str]] = None,
    ) -> None:
        """``device``: where the model, the KV cache and sampling live. "cpu" is the engine's purpose;
        "cuda" runs the same loop on a GPU (tensors the loop makes default to it), which is how CUDA IPC
        weight updates are checked against our own engine (tests/gpu/test_gpu_engine_ipc.py).

        ``weight_format``: how the decode path holds its matmul weights (weight_formats.py); "auto" takes
        fp16-packed where the lean decode path runs this model in float32 with FBGEMM, else float32.
        ``max_lora_rank``: LoRA adapters up to this rank can be loaded (0: none; engine_adapter.py), on
        ``lora_target_modules`` only (module names such as q_proj; None: any)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.model_path = str(model_path)
        self.dtype = dtype
        self.max_batch_size = int(max_batch_size)
        self.prefill_budget_tokens = int(prefill_budget_tokens)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=DTYPES[dtype], attn_implementation=ATTENTION_NAME
        )
        self.device = torch.device(device)
        self.model.to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self._params = self.model.state_dict(keep_vars=True)
        self.max_lora_rank = int(max_lora_rank)
        self.lora_target_modules = frozenset(lora_target_modules) if lora_target_modules else None
        self._adapter = None
        self._adapter_base = {}
        # token ids both the embeddings and the logits cover (they differ when the vocabulary is padded)
        out_emb = self.model.get_output_embeddings()
        self.vocab_size = int(min(self.model.get_input_embeddings().num_embeddings,
                                  getattr(out_emb, "out_features", None) or 1 << 62))
        max_pos = getattr(self.model.config, "max_position_embeddings", None) or context_length or 4096
        self.context_length = int(min(context_length or max_pos, max_pos))
        self.eos_token_ids = frozenset(eos_token_ids(self.model, self.tokenizer))
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else next(iter(sorted(self.eos_token_ids)), 0))
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._logits_width = int(self.model.get_output_embeddings().weight.shape[0])

        self._weight_version = str(weight_version)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._active: dict[str, RequestHandle] = {}  # rid -> waiting or running request
        self._abort_rids: set[str] = set()
        self._commands: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self._paused = False
        self._stopping = False
        self._released: set[str] = set()
        self._thread: Optional[threading.Thread] = None
        self._loop_error: Optional[BaseException] = None
        self._loop_ident: Optional[int] = None

        # running batch (owned by the loop thread)
        self._seqs: list[SequenceState] = []
        self._kv: Optional[BatchKV] = None  # created at the first join, kept (buffers reused) after
        self._admitting: list[RequestHandle] = []  # popped from the queue, not yet in the batch
        self._positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self._next_ids = torch.zeros(0, 1, dtype=torch.long, device=self.device)
        self._sampler = BatchSampler([])
        self._counters = collections.Counter()
        self._prefix = PrefixCache(int(prefix_cache_mb) * 1024 * 1024)
        self._cache_epoch = 0  # bumped when the weights change: older KV is never reused
        self._lean: Optional[LeanDecoder] = self._lean_decoder(weight_format)
        self._stale_packed: set[str] = set()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "CPUEngine":
        """Start the decode loop thread (idempotent)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="cpu-engine-loop", daemon=True)
            self._thread.start()
            _RUNNING.add(self)
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still in flight finish with finish_reason abort."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        _RUNNING.discard(self)
        self._fail_all("the engine is shutting down")
        self._fail_commands()

    def __enter__(self) -> "CPUEngine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def alive(self) -> bool:
        """True while the decode loop thread runs."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        input_ids: Sequence[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        rid: Optional[str] = None,
        *,
        return_logprob: bool = True,
        logprob_start_len: int = -1,
        stream: bool = False,
        on_update: Optional[Callable[[RequestHandle], None]] = None,
    ) -> RequestHandle:
        """Queue a request; it joins the running batch at the next step. Raises ValueError on bad input.

        ``on_update(handle)`` runs on the engine thread after each step that added tokens (only when
        ``stream``) and once when the request finishes; keep it cheap (e.g. ``call_soon_threadsafe``).
        """
        if not isinstance(params, SamplingParams):
            params = SamplingParams.from_dict(params, self.vocab_size)
        ids = self.validate_prompt(input_ids, params)
        if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int):
            raise ValueError("logprob_start_len must be an integer")
        if not -1 <= logprob_start_len < len(ids):
            raise ValueError(
                f"logprob_start_len ({logprob_start_len}) must be -1 (none) or in [0, {len(ids)}) (the prompt length)"
            )
        handle = RequestHandle(
            rid or uuid.uuid4().hex, ids, params, bool(return_logprob), logprob_start_len, stream, on_update
        )
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            if handle.rid in self._active:
                raise ValueError(f"rid {handle.rid!r} is already in use by a running request")
            self._active[handle.rid] = handle
            self._waiting.append(handle)
            self._cv.notify_all()
        return handle

    def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        rid: Optional[str] = None,
        timeout: Optional[float] = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """Blocking convenience: submit and wait (needs :meth:`start`)."""
        return self.submit(input_ids, params, rid, **kwargs).result(timeout)

    def validate_prompt(self, input_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Token ids as a list of ints, checked against the vocabulary and the context length."""
        return checked_prompt(input_ids, params, self.vocab_size, self.context_length)

    def abort(self, rid: str) -> bool:
        """Finish ``rid`` with finish_reason abort (partial output kept); False if unknown or done."""
        with self._cv:
            if rid not in self._active:
                return False
            self._abort_rids.add(rid)
            self._cv.notify_all()
        if not self.alive():
            self._drain_aborts_without_loop()
        return True

    def abort_all(self) -> int:
        """Abort every waiting and running request; returns how many."""
        with self._cv:
            rids = list(self._active)
            self._abort_rids.update(rids)
            self._cv.notify_all()
        if not self.alive():
            self._drain_aborts_without_loop()
        return len(rids)

    # ------------------------------------------------------------------ control

    def pause(self, mode: str = "abort") -> None:
        """Stop decoding; new requests wait. ``abort`` aborts in-flight requests; ``in_place`` and
        ``retract`` keep them (the CPU engine keeps their KV cache either way) and resume later."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        with self._cv:
            self._paused = True
            self._cv.notify_all()
        if mode == "abort":
            self.abort_all()
        self._call_in_loop(lambda: None)  # returns once the loop is between steps and sees the pause

    def resume(self) -> None:
        """Continue decoding after :meth:`pause`."""
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def idle(self) -> bool:
        """No request is running or waiting (SGLang's ``_is_no_request``, which its release and flush need;
        a pause ``in_place`` or ``retract`` keeps requests, so the engine is not idle then)."""
        with self._lock:
            return not self._active

    def flush_cache(self) -> bool:
        """Empty the prefix cache (between decode steps); False, with nothing done, while a request is
        running or waiting, as SGLang 0.5.9's ``flush_cache`` (callers poll it until the engine is idle)."""
        if not self.idle():
            return False
        self._call_in_loop(self._flush_prefix_cache)
        return True

    def _flush_prefix_cache(self) -> None:
        self._prefix.clear()
        self._cache_epoch += 1

    def stats(self) -> dict[str, Any]:
        """Counters for /get_server_info and load balancing."""
        with self._lock:
            waiting = len(self._waiting)
            active = len(self._active)
        kv = self._kv
        return {
            "running": max(active - waiting, 0),
            "waiting": waiting,
            "max_batch_size": self.max_batch_size,
            "tokens_generated": self._counters["tokens"],
            "prompt_tokens": self._counters["prompt_tokens"],
            "requests_finished": self._counters["finished"],
            "decode_steps": self._counters["steps"],
            "prefill_seconds": round(self._counters["prefill_s"], 3),  # forward time: how busy the engine was
            "decode_seconds": round(self._counters["decode_s"], 3),
            "request_errors": self._counters["request_errors"],  # requests that failed alone (decode.py)
            "decode_retries": self._counters["decode_retries"],  # decode forwards run again in parts
            "decode_path": "lean" if self._lean is not None else "transformers",
            "decode_attention": self._lean.attention if self._lean is not None else "transformers",
            "weight_format": self.weight_format,
            "weight_pack_seconds": round(self._counters["weight_pack_s"], 4),  # rebuilding packed weights
            "weight_packs": self._counters["weight_packs"],
            "weight_pack_last_seconds": round(self._lean.pack_seconds, 4) if self._lean is not None else 0.0,
            "weight_load_pack_seconds": round(self._counters["weight_load_pack_s"], 4),
            "packed_weight_bytes": self._lean.packed_bytes() if self._lean is not None else 0,
            "paused": self._paused,
            "released_memory": sorted(self._released),
            "weight_version": self._weight_version,
            "kv_cache_reserved_bytes": kv.nbytes() if kv is not None else 0,
            **self._prefix.stats(),
            "last_error": repr(self._loop_error) if self._loop_error is not None else None,
        }

    # ------------------------------------------------------------------ loop internals

    def _call_in_loop(self, fn: Callable[[], Any], timeout: Optional[float] = None) -> Any:
        """Run ``fn`` on the loop thread between steps (directly when no loop runs) and return its result."""
        if threading.get_ident() == self._loop_ident or not self.alive():
            with torch.inference_mode():
                return fn()
        fut: Future = Future()
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is shutting down")
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut.result(timeout)

    def _set_version(self, version: str) -> None:
        if version == self._weight_version:
            return
        self._weight_version = version
        for seq in self._seqs:
            seq.handle.version_changes.append((len(seq.handle.output_ids), version))

    def _has_work(self) -> bool:
        return bool(
            self._stopping
            or self._commands
            or self._abort_rids
            or (not self._paused and (self._waiting or self._seqs))
        )

    def _loop(self) -> None:
        self._loop_ident = threading.get_ident()
        on_device = contextlib.nullcontext() if self.device.type == "cpu" else self.device  # default device
        with torch.inference_mode(), on_device:
            while True:
                with self._cv:
                    while not self._has_work():
                        self._cv.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                    aborts = set(self._abort_rids)
                    self._abort_rids.clear()
                    # aborted waiting requests leave the queue before admission can pick them up
                    dropped = [h for h in self._waiting if h.rid in aborts]
                    for h in dropped:
                        self._waiting.remove(h)
                    admitted = self._take_admissions() if not self._paused else []
                for h in dropped:
                    self._finish(h, {"type": "abort", "message": "Aborted before prefill"})
                for fn, fut in commands:
                    try:
                        fut.set_result(fn())
                    except BaseException as err:  # reported to the caller, the loop goes on
                        fut.set_exception(err)
                try:
                    if aborts:
                        self._apply_aborts(aborts)
                    if self._stale_packed and (admitted or self._seqs):
                        self._repack_stale()  # an adapter's unload left them for the next update
                    if admitted:
                        self._admitting = admitted
                        started = time.perf_counter()
                        self._admit(admitted)
                        self._counters["prefill_s"] += time.perf_counter() - started
                        self._admitting = []
                    if self._seqs and not self._paused:
                        started = time.perf_counter()
                        self._decode_step()
                        self._counters["decode_s"] += time.perf_counter() - started
                except Exception as err:
                    logger.exception("decode loop error; aborting the running batch")
                    self._loop_error = err
                    self._reset_batch(engine_error(f"engine error: {type(err).__name__}: {err}"))
        self._reset_batch(engine_error("the engine is shutting down", 503))
        self._fail_commands()

    def _fail_commands(self) -> None:
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
        for _, fut in commands:
            if not fut.done():
                fut.set_exception(RuntimeError("the engine is shutting down"))

    def _take_admissions(self) -> list[RequestHandle]:
        """Pop waiting requests that fit the batch and this iteration's prefill budget (lock held)."""
        free = self.max_batch_size - len(self._seqs)
        out: list[RequestHandle] = []
        budget = self.prefill_budget_tokens
        while self._waiting and len(out) < free:
            nxt = self._waiting[0]
            if out and budget - len(nxt.prompt_ids) < 0:
                break
            budget -= len(nxt.prompt_ids)
            out.append(self._waiting.popleft())
        return out

    def _apply_aborts(self, rids: set[str]) -> None:
        """Finish and remove running requests in ``rids`` (waiting ones were dropped from the queue)."""
        leave = []
        for i, seq in enumerate(self._seqs):
            if seq.handle.rid in rids:
                self._finish(seq.handle, {"type": "abort", "message": "Aborted"})
                leave.append(i)
        if leave:
            self._leave(set(leave))

    def _drain_aborts_without_loop(self) -> None:
        with self._lock:
            rids = set(self._abort_rids)
            self._abort_rids.clear()
            waiting = [h for h in self._waiting if h.rid in rids]
            for h in waiting:
                self._waiting.remove(h)
        for h in waiting:
            self._finish(h, {"type": "abort", "message": "Aborted"})

    def _reset_batch(self, reason: dict[str, Any]) -> None:
        for seq in self._seqs:
            self._finish(seq.handle, reason)
        for handle in self._admitting:
            self._finish(handle, reason)
        self._admitting = []
        self._seqs = []
        if self._kv is not None:
            self._kv.clear()
        self._positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self._next_ids = torch.zeros(0, 1, dtype=torch.long, device=self.device)
        self._sampler = BatchSampler([])

    def _fail_all(self, message: str) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for h in waiting:
            self._finish(h, engine_error(message, 503))
