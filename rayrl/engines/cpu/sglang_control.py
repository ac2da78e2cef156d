"""SGLang 0.5.9's own control code, run on CPU for the strict stand-in (rayrl/engines/cpu/sglang_standin.py).

What of the pinned wheel imports without a GPU is used as is:

- its request classes (``managers/io_struct.py``), built from each JSON body with pydantic as its FastAPI
  routes build them, so a field, a type or a literal SGLang would refuse is refused here;
- its route table (``entrypoints/http_server.py``, read from the installed source: the server module needs
  a GPU to import), so a path or method SGLang does not serve is refused here;
- its scheduler's weight and memory control (``SchedulerUpdateWeightsMixin``: memory tags, the idle
  assertions, the cache flush after an update), driven by :class:`CPUScheduler`, a scheduler object of ours
  holding the CPU engine's state.

io_struct imports ``managers/schedule_batch`` for one name it uses only in annotations, and that module
pulls in the GPU stack; the import below lends it a placeholder module for the duration of that import
only. Weights released without a CPU backup (``--enable-weights-cpu-backup`` off, SGLang's default) come
back as NaN, as torch_memory_saver hands back a fresh mapping without the old contents.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import math
import sys
import types
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from rayrl.engines.http_input import RequestError


@dataclass(frozen=True)
class SGLangControl:
    """The pinned wheel's control pieces: ``io`` (io_struct), ``mixin`` (SchedulerUpdateWeightsMixin),
    ``constants`` (memory tags), ``routes`` (path -> (methods, request class name))."""

    io: types.ModuleType
    mixin: type
    constants: types.ModuleType
    routes: dict[str, tuple[frozenset[str], str]]


@functools.lru_cache(maxsize=1)
def load_sglang_control() -> SGLangControl:
    name = "sglang.srt.managers.schedule_batch"
    lent = name not in sys.modules
    if lent:  # io_struct names BaseFinishReason in annotations only; the real module needs CUDA kernels
        placeholder = types.ModuleType(name, "placeholder lent to io_struct's import (annotations only)")
        placeholder.BaseFinishReason = type("BaseFinishReason", (), {})  # type: ignore[attr-defined]
        sys.modules[name] = placeholder
    try:
        io = importlib.import_module("sglang.srt.managers.io_struct")
        mixin = importlib.import_module("sglang.srt.managers.scheduler_update_weights_mixin")
    finally:
        if lent:
            sys.modules.pop(name, None)
    constants = importlib.import_module("sglang.srt.constants")
    return SGLangControl(io=io, mixin=mixin.SchedulerUpdateWeightsMixin, constants=constants, routes=_routes())


def sglang_source_dir() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the pinned sglang wheel is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "srt"


def _routes() -> dict[str, tuple[frozenset[str], str]]:
    """path -> (HTTP methods, the request class its handler's first argument is) in http_server.py."""
    tree = ast.parse((sglang_source_dir() / "entrypoints" / "http_server.py").read_text())
    routes: dict[str, tuple[frozenset[str], str]] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.AsyncFunctionDef, ast.FunctionDef)):
            continue
        arg = fn.args.args[0] if fn.args.args else None
        cls = arg.annotation.id if arg is not None and isinstance(arg.annotation, ast.Name) else ""
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                    and isinstance(dec.args[0], ast.Constant)):
                continue
            kind = dec.func.attr
            if kind in ("get", "post", "put", "delete"):
                methods = frozenset({kind.upper()})
            elif kind == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = frozenset(e.value for e in kw["methods"].elts) if "methods" in kw else frozenset({"GET"})
            else:
                continue
            routes[dec.args[0].value] = (methods | {"HEAD"} if "GET" in methods else methods, cls)
    return routes


class SGLangRefusal(RequestError):
    """A request the pinned SGLang would refuse (or fail on): a 4xx here, counted as a contract violation."""


@functools.lru_cache(maxsize=None)
def _adapter(cls: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(cls)


def parse_sglang_request(control: SGLangControl, method: str, path: str, body: Any) -> Optional[Any]:
    """The request object SGLang's route for ``path`` would build from ``body`` (None for routes that
    take none), or SGLangRefusal saying why SGLang would not serve it. Stricter than FastAPI in one way:
    a field the class does not have is refused (FastAPI drops it silently, so the sender's intent is lost)."""
    if path not in control.routes:
        raise SGLangRefusal(f"{path} is not a route of SGLang 0.5.9 (a 404 there)", status=404)
    methods, cls_name = control.routes[path]
    if method not in methods:
        raise SGLangRefusal(f"{method} {path}: SGLang 0.5.9 serves it for {sorted(methods)} only (a 405 there)",
                            status=405)
    cls = getattr(control.io, cls_name, None) if cls_name else None
    if cls is None or not hasattr(cls, "__dataclass_fields__"):
        return None
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise SGLangRefusal(f"{path}: the body must be a JSON object of {cls_name} fields")
    unknown = set(body) - {f.name for f in fields(cls)}
    if unknown:
        raise SGLangRefusal(f"{path}: {sorted(unknown)} are not fields of SGLang 0.5.9's {cls_name} "
                            "(FastAPI drops them silently: what they ask for never happens)")
    try:
        obj = _adapter(cls).validate_python(body)
    except Exception as err:  # pydantic's ValidationError, or __post_init__'s ValueError: a 422/400 there
        raise SGLangRefusal(f"{path}: SGLang 0.5.9's {cls_name} refuses this body: {err}") from None
    _check_values(control, path, obj)
    return obj


def _check_values(control: SGLangControl, path: str, obj: Any) -> None:
    """What SGLang resolves later, in its scheduler: dtype names, memory tags, sampling parameters."""
    tags = getattr(obj, "tags", None)
    if path in ("/release_memory_occupation", "/resume_memory_occupation") and tags is not None:
        unknown = [t for t in tags if t not in control.constants.GPU_MEMORY_ALL_TYPES]
        if unknown:  # release: silently kept as offloaded, nothing freed; resume: a KeyError that kills it
            raise SGLangRefusal(f"{path}: memory tags {unknown} are not SGLang 0.5.9's "
                                f"({', '.join(control.constants.GPU_MEMORY_ALL_TYPES)})")
    if path == "/update_weights_from_distributed":
        resolve_dtypes(obj.dtypes)
        if not (len(obj.names) == len(obj.dtypes) == len(obj.shapes)):
            raise SGLangRefusal("names, dtypes and shapes differ in length (SGLang zips them: the rest is lost)")
        if any(not shape or any(d < 0 for d in shape) for shape in obj.shapes):
            raise SGLangRefusal(f"shapes must be lists of non-negative sizes: {obj.shapes}")
    if path == "/generate" and isinstance(obj.sampling_params, dict):
        from sglang.srt.sampling.sampling_params import SamplingParams  # type: ignore[import-not-found]

        try:
            SamplingParams(**obj.sampling_params)
        except TypeError as err:  # 0.5.9's tokenizer manager builds it so: an unknown key fails the request
            raise SGLangRefusal(f"sampling_params: {err}") from None


def resolve_dtypes(names: list[Any]) -> list[torch.dtype]:
    """As 0.5.9's model_runner: ``getattr(torch, dtype)`` ("bfloat16" yes, "torch.bfloat16" no)."""
    out = []
    for name in names:
        value = name if isinstance(name, torch.dtype) else getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(value, torch.dtype):
            raise SGLangRefusal(f"dtype {name!r}: SGLang 0.5.9 resolves dtypes with getattr(torch, dtype), which "
                                "fails on it (its broadcast is then never received: the trainer hangs)")
        out.append(value)
    return out


class SchedulerDied(RuntimeError):
    """SGLang's scheduler raised (an assertion, a KeyError): on 0.5.9 the scheduler process dies there."""


class _MemorySaver:
    """The scheduler's ``memory_saver_adapter``: pausing ``weights`` without a CPU backup loses them."""

    def __init__(self, scheduler: "CPUScheduler") -> None:
        self.scheduler = scheduler
        self.paused: set[str] = set()

    def pause(self, tag: str) -> None:
        if tag in self.paused:  # torch_memory_saver: the region is already unmapped
            raise SchedulerDied(f"memory region {tag!r} paused twice")
        self.paused.add(tag)
        self.scheduler.engine.release_memory_occupation([tag])

    def resume(self, tag: str) -> None:
        if tag not in self.paused:
            raise SchedulerDied(f"memory region {tag!r} resumed while not paused")
        self.paused.discard(tag)
        self.scheduler.engine.resume_memory_occupation([tag])
        if tag == "weights" and not self.scheduler.weights_cpu_backup:
            self.scheduler.lose_weights()


class _ModelRunner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


class _TPWorker:
    """The scheduler's ``tp_worker``: each update call returns ``(success, message)`` as 0.5.9's does."""

    def __init__(self, scheduler: "CPUScheduler") -> None:
        self.scheduler = scheduler
        self.model_runner = _ModelRunner(scheduler.engine.model)

    def _apply(self, load: Callable[[], tuple[int, list[str]]], what: str) -> tuple[bool, str]:
        try:
            count, names = load()
        except (ValueError, OSError) as err:  # WeightUpdateError is a ValueError
            return False, f"Failed to update weights: {err}"
        self.scheduler.weights_restored(names)
        return True, f"Succeeded to update model weights ({count} tensors {what})."

    def update_weights_from_tensor(self, recv_req: Any) -> tuple[bool, str]:
        named = recv_req.named_tensors  # deserialized by the HTTP side, per rank (sglang_standin.py)
        return self._apply(lambda: (self.scheduler.engine.update_weights(dict(named), recv_req.weight_version),
                                    [n for n, _ in named]), "from the request")

    def update_weights_from_disk(self, recv_req: Any) -> tuple[bool, str]:
        engine = self.scheduler.engine

        def load() -> tuple[int, list[str]]:
            count = engine.load_weights_from_disk(recv_req.model_path, recv_req.weight_version)
            return count, list(engine.model.state_dict())

        return self._apply(load, f"from {recv_req.model_path}")

    def update_weights_from_distributed(self, recv_req: Any) -> tuple[bool, str]:
        receive = recv_req.receive  # joins the broadcast (sglang_standin.py); names in request order
        return self._apply(lambda: (self.scheduler.engine.update_weights(dict(receive()), recv_req.weight_version),
                                    list(recv_req.names)), f"from group {recv_req.group_name}")


def make_scheduler(engine: Any, is_no_request: Callable[[], bool], weights_cpu_backup: bool = False) -> "CPUScheduler":
    """A :class:`CPUScheduler` for ``engine`` (torch.distributed's default group: one gloo rank, the TP group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cls = type("CPUScheduler", (CPUScheduler, load_sglang_control().mixin), {})
    return cls(engine, is_no_request, weights_cpu_backup)


class CPUScheduler:
    """The attributes SGLang's SchedulerUpdateWeightsMixin reads, over the CPU engine: made with
    :func:`make_scheduler`, which mixes in the pinned wheel's mixin class. Call it from one thread."""

    def __init__(self, engine: Any, is_no_request: Callable[[], bool], weights_cpu_backup: bool) -> None:
        self.engine = engine
        self._no_request = is_no_request
        self.weights_cpu_backup = weights_cpu_backup
        self.offload_tags: set[str] = set()
        self.memory_saver_adapter = _MemorySaver(self)
        self.tp_worker = _TPWorker(self)
        self.draft_worker = None
        self.tp_cpu_group = None  # torch.distributed's default group: one rank here
        self._params = {n: p for n, p in engine.model.state_dict(keep_vars=True).items() if p.is_floating_point()}
        self.lost: set[int] = set()  # id() of parameters whose contents were lost and not loaded since

    def _is_no_request(self) -> bool:
        return self._no_request()

    def flush_cache(self) -> bool:
        if not self._no_request():
            return False
        self.engine.flush_cache()
        return True

    def lose_weights(self) -> None:
        """As a resumed weights region without a CPU backup: its old contents are gone (NaN here)."""
        self.engine.update_weights({n: torch.full_like(p.detach(), math.nan) for n, p in self._params.items()})
        self.lost = {id(p) for p in self._params.values()}

    def weights_restored(self, names: list[str]) -> None:
        for name in names:
            if name in self._params:
                self.lost.discard(id(self._params[name]))

    def lost_weights(self) -> list[str]:
        """Names of parameters still holding lost contents (one name per tied tensor)."""
        seen: dict[int, str] = {}
        for name, p in self._params.items():
            seen.setdefault(id(p), name)
        return sorted(seen[i] for i in self.lost)


ALLOWED_4XX = {"/flush_cache"}  # 400 while requests run: the idle wait retries it (as slime does)


def check_recorded_requests(directory: str | Path) -> tuple[dict[str, int], list[str]]:
    """Every request the stand-ins recorded under ``directory`` (``--record-requests``), held again to the
    pinned wheel's route table and request classes, and to what the stand-in answered: returns the calls
    per ``METHOD path`` and the problems found (none when all of them would have served on SGLang 0.5.9)."""
    import json
    from collections import Counter

    control = load_sglang_control()
    calls: Counter = Counter()
    problems: list[str] = []
    files = sorted(Path(directory).glob("*.jsonl"))
    if not files:
        return {}, [f"no recorded requests under {directory}"]
    for file in files:
        for n, line in enumerate(file.read_text().splitlines(), 1):
            rec = json.loads(line)
            where = f"{file.name}:{n} {rec['method']} {rec['path']}"
            calls[f"{rec['method']} {rec['path']}"] += 1
            try:
                parse_sglang_request(control, rec["method"], rec["path"], rec["body"])
            except SGLangRefusal as err:
                problems.append(f"{where}: {err}")
                continue
            if rec.get("refused") or rec.get("scheduler_died"):
                problems.append(f"{where}: {rec.get('refused') or 'scheduler died: ' + rec['scheduler_died']}")
            elif rec["status"] >= 500 or (rec["status"] >= 400 and rec["path"] not in ALLOWED_4XX):
                problems.append(f"{where}: answered {rec['status']}")
    return dict(calls), problems
