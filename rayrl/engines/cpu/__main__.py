"""``python -m rayrl.engines.cpu``: the CPU engine behind SGLang's HTTP API, as a process.

Flags mirror ``sglang.launch_server`` where they overlap (``--model-path``, ``--host``, ``--port``,
``--dtype``, ``--context-length``, ``--weight-version``), so the launcher builds both commands the same
way. Binds loopback unless told otherwise. Exits non-zero with a one-line reason when the model cannot
be loaded (the launcher shows that line in its error).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import signal
import sys
from typing import Optional, Sequence

from rayrl.models import resolve_model_path

DTYPE_NAMES = ("bfloat16", "float16", "float32")
logger = logging.getLogger("rayrl.engines.cpu")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m rayrl.engines.cpu", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--model-path", required=True, help="HF model directory or a built-in model name")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES),
                    help="auto: bfloat16 where the CPU computes it natively, else float32")
    ap.add_argument("--max-batch-size", type=int, default=32, help="sequences decoded together")
    ap.add_argument("--context-length", type=int, default=4096)
    ap.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: all cores)")
    ap.add_argument("--weight-version", default="0")
    ap.add_argument(
        "--prefill-budget-tokens", type=int, default=4096, help="padded prompt tokens per prefill"
    )
    ap.add_argument(
        "--prefix-cache-mb", type=int, default=1024, help="KV of known prefixes kept for reuse (0: off)"
    )
    ap.add_argument("--tp-size", type=int, default=1,
                    help="tensor-parallel ranks this engine stands for: a tensor update carries one entry per rank, "
                         "rank r reading GPU r of CUDA_VISIBLE_DEVICES when set (as SGLang's ranks do)")
    ap.add_argument("--weight-format", default="auto", choices=("auto", "float32", "fp16-packed"),
                    help="decode weights (rayrl/engines/cpu/weight_formats.py); auto: fp16-packed where the engine's "
                         "own decode path runs the model in float32 on x86, else float32")
    ap.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (SGLang's flag; merged here)")
    ap.add_argument("--max-lora-rank", type=int, default=0, help="the largest adapter rank it loads")
    ap.add_argument("--lora-target-modules", nargs="*", default=None,
                    help="the only modules an adapter may change (SGLang's flag; default: any linear layer)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu",
                    help="cpu, or cuda[:N] to run the model on a GPU (checks CUDA IPC weight updates)")
    ap.add_argument("--strict-sglang", action="store_true",
                    help="a stand-in for the pinned SGLang in tests: enforce its contract "
                         "(rayrl/engines/cpu/sglang_standin.py)")
    ap.add_argument("--record-requests", default=None, metavar="DIR",
                    help="with --strict-sglang: append every request, its status and any refusal to a JSONL file "
                         "in DIR (one per engine process)")
    ap.add_argument("--enable-weights-cpu-backup", action="store_true",
                    help="with --strict-sglang: released weights keep their contents (SGLang's flag; off, as "
                         "there, they come back unusable)")
    ap.add_argument("--slow-request-s", type=float, default=120.0, help="log requests slower than this")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    for name in ("max_batch_size", "context_length", "prefill_budget_tokens", "tp_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_threads < 0:
        ap.error("--num-threads must be >= 0")
    if args.enable_lora and args.max_lora_rank < 1:
        ap.error("--enable-lora needs --max-lora-rank >= 1 (the largest adapter rank to load)")
    if args.prefix_cache_mb < 0:
        ap.error("--prefix-cache-mb must be >= 0")
    if (args.record_requests or args.enable_weights_cpu_backup) and not args.strict_sglang:
        ap.error("--record-requests and --enable-weights-cpu-backup need --strict-sglang")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        ap.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    args.tp_gpus = tp_gpus(args.tp_size, os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    if args.tp_gpus is None:
        ap.error(f"--tp-size {args.tp_size} needs as many GPUs in CUDA_VISIBLE_DEVICES "
                 f"({os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return args


def tp_gpus(tp_size: int, visible: str) -> Optional[list[str]]:
    """The GPU each TP rank reads: rank r the r-th of ``CUDA_VISIBLE_DEVICES`` (as SGLang 0.5.9 places its
    ranks: base_gpu_id 0, gpu_id_step 1); [] when none are visible (not placed on GPUs), None when too few."""
    ids = [g.strip() for g in visible.split(",") if g.strip()]
    if not ids:
        return []
    return ids[:tp_size] if len(ids) >= tp_size else None


async def serve(args: argparse.Namespace) -> None:
    # Resolve the model before importing torch/transformers, so a wrong path fails in well under a second.
    path = resolve_model_path(args.model_path)
    from rayrl.engines.cpu.engine import CPUEngine
    from rayrl.engines.cpu.server import EngineServer

    server_cls = EngineServer
    strict: dict = {}
    if args.strict_sglang:  # imports the pinned SGLang's own control code (rayrl/engines/cpu/sglang_control.py)
        from rayrl.engines.cpu.sglang_standin import StrictSGLangServer as server_cls  # type: ignore[assignment]

        strict = {"record_path": args.record_requests, "weights_cpu_backup": args.enable_weights_cpu_backup}

    if args.dtype == "auto":
        from rayrl.machine import compute_dtype, cpu_has_native_bf16

        args.dtype = compute_dtype("auto", cuda=args.device != "cpu", native_bf16=cpu_has_native_bf16())
    engine = CPUEngine(
        path,
        dtype=args.dtype,
        max_batch_size=args.max_batch_size,
        context_length=args.context_length,
        num_threads=args.num_threads,
        weight_version=args.weight_version,
        prefill_budget_tokens=args.prefill_budget_tokens,
        seed=args.seed,
        prefix_cache_mb=args.prefix_cache_mb,
        device=args.device,
        weight_format=args.weight_format,
        max_lora_rank=args.max_lora_rank if args.enable_lora else 0,
        lora_target_modules=args.lora_target_modules,
    ).start()
    server = server_cls(
        engine,
        host=args.host,
        port=args.port,
        server_args={
            "model_path": args.model_path,
            "tokenizer_path": str(path),
            "max_batch_size": args.max_batch_size,
        },
        slow_request_s=args.slow_request_s,
        tp_size=args.tp_size,
        tp_gpus=args.tp_gpus,
        **strict,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    url = await server.start()
    print(f"rayrl cpu engine ready at {url} (model {path}, dtype {args.dtype}, device {args.device}, "
          f"decode weights {engine.weight_format}{', strict SGLang stand-in' if args.strict_sglang else ''})",
          flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()
        await loop.run_in_executor(None, engine.shutdown)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(serve(args))
    except FileNotFoundError as err:  # ModelNotFoundError included
        print(f"rayrl cpu engine: cannot load the model: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except OSError as err:
        print(f"rayrl cpu engine: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
