"""Our SGLang calls held against the pinned SGLang itself (0.5.9, installed without its GPU dependencies).

What imports on CPU is used directly: SGLang's own ``MultiprocessingSerializer`` (its ``SafeUnpickler``)
and ``FlattenedTensorBucket`` take every payload our senders build, and SGLang's own ``ServerArgs`` parser
takes our launch command. What needs a GPU to import (the HTTP server, ``io_struct``: sgl_kernel) is
read from the installed source instead: every route EngineClient calls must be served, and every JSON
field it sends must be a field of the request class that route parses; every field it reads must be one
SGLang writes.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from aiohttp import web

from rayrl.config import EngineConfig, SGLangConfig
from rayrl.engines import client as client_module
from rayrl.engines.backends.sglang import sglang_command
from rayrl.engines.client import EngineClient
from rayrl.weights import bucket as own_bucket
from rayrl.weights.handles import HandleSender
from rayrl.weights.transfer import EngineTarget
from rayrl.weights.wire import flatten_bucket, serialize_for_engine, shared_cpu_buffer

PINNED = "0.5.9"
ROOT = Path(__file__).resolve().parents[2]

sglang_utils = pytest.importorskip("sglang.srt.utils", reason="the pinned sglang wheel (make test installs it)")
tensor_bucket = pytest.importorskip("sglang.srt.weight_sync.tensor_bucket")
SRT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"


def test_the_installed_sglang_is_the_pinned_one_and_torch_stayed_cpu():
    assert importlib.metadata.version("sglang") == PINNED
    assert torch.__version__.endswith("+cpu") and not torch.cuda.is_available()
    for where in ("pyproject.toml", "cluster/Dockerfile", "Makefile", "scripts/fetch_gpu_wheels.sh"):
        pins = re.findall(r"sglang(?:\[all\])?==([0-9][\w.]*)", (ROOT / where).read_text())
        assert pins and set(pins) == {PINNED}, (where, pins)
    assert f"sglang {PINNED}" in (ROOT / "docs" / "gpu.md").read_text()


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 4, generator=g)),
            ("model.norm.weight", torch.randn(4, generator=g).to(torch.bfloat16)),
            ("model.embed_tokens.weight", torch.randn(16, 4, generator=g).to(torch.float16)),
            ("lm_head.weight", torch.randn(3, 5, generator=g)[:, 1:4])]  # non-contiguous


def _sglang_reconstruct(obj: dict) -> list[tuple[str, torch.Tensor]]:
    """What 0.5.9's model_runner._update_weights_from_flattened_bucket does with a payload."""
    meta = [tensor_bucket.FlattenedTensorMetadata(name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                                                  end_idx=m.end_idx, numel=m.numel) for m in obj["metadata"]]
    bucket = tensor_bucket.FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=meta)
    return bucket.reconstruct_tensors()


@pytest.mark.parametrize("shared_buffer", [False, True], ids=["new-bucket", "reused-shared-buffer"])
def test_flattened_buckets_pass_sglangs_unpickler_and_come_out_equal(shared_buffer):
    named = _named()
    out = shared_cpu_buffer(1 << 16) if shared_buffer else None
    payload = serialize_for_engine(flatten_bucket(named, out=out, require_sglang=True))
    obj = sglang_utils.MultiprocessingSerializer.deserialize(payload)  # SafeUnpickler, as tp_worker does
    assert all(type(m) is tensor_bucket.FlattenedTensorMetadata for m in obj["metadata"])
    got = _sglang_reconstruct(obj)
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, a), (_, b) in zip(got, named):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_plain_named_tensor_payloads_pass_sglangs_unpickler():
    named = [(n, t.contiguous().clone()) for n, t in _named()]
    obj = sglang_utils.MultiprocessingSerializer.deserialize(serialize_for_engine(named))
    assert [n for n, _ in obj] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(obj, named))


def test_a_bucket_of_any_other_class_is_refused_by_sglang():
    """Why the sender must use SGLang's classes: 0.5.9 refuses ours (and its scheduler dies on it)."""
    ours = own_bucket.FlattenedTensorBucket(named_tensors=_named())
    payload = serialize_for_engine({"flattened_tensor": ours.get_flattened_tensor(), "metadata": ours.get_metadata()})
    with pytest.raises(RuntimeError, match="Blocked unsafe class loading"):
        sglang_utils.MultiprocessingSerializer.deserialize(payload)
    # our fallback has SGLang's byte layout exactly
    theirs = tensor_bucket.FlattenedTensorBucket(named_tensors=_named())
    assert torch.equal(ours.get_flattened_tensor(), theirs.get_flattened_tensor())
    assert [vars(m) for m in ours.get_metadata()] == [vars(m) for m in theirs.get_metadata()]


def test_the_handle_sender_posts_payloads_sglang_deserializes(loop_thread):
    """HandleSender itself, against a loopback server that does what 0.5.9's tp_worker does."""
    received: list[list[tuple[str, torch.Tensor]]] = []

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        assert body["load_format"] == "flattened_bucket" and len(body["serialized_named_tensors"]) == 1
        wire = body["serialized_named_tensors"][0]
        named = _sglang_reconstruct(sglang_utils.MultiprocessingSerializer.deserialize(wire))
        received.append([(n, t.clone()) for n, t in named])  # load_weights copies; the buffer is reused
        return web.json_response({"success": True, "message": "ok"})

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"weight_version": "3"})

    async def run() -> None:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/update_weights_from_tensor", update)
        app.router.add_get("/model_info", model_info)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        sender = HandleSender([EngineTarget(EngineClient(f"http://127.0.0.1:{port}"))], bucket_bytes=256,
                              sglang_engines=True)
        try:
            await sender.send(iter(_named()), 3)
        finally:
            await sender.close()
            await runner.cleanup()

    loop_thread.run(run())
    got = [pair for bucket in received for pair in bucket]
    assert len(received) >= 2 and [n for n, _ in got] == [n for n, _ in _named()]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, _named()))


_REBUILD = r"""
import pytest, torch
from sglang.srt.utils import patch_torch
from rayrl.weights.wire import WeightUpdateError, _AllowListUnpickler, serialize_for_engine
from sglang.srt.utils import MultiprocessingSerializer
found = _AllowListUnpickler(b"", allow_cuda=True).find_class("sglang.srt.utils.patch_torch",
                                                             "_rebuild_cuda_tensor_modified")
assert found is patch_torch._rebuild_cuda_tensor_modified
with pytest.raises(WeightUpdateError, match="CUDA IPC handles"):  # an engine on CPU still says why not
    _AllowListUnpickler(b"", allow_cuda=False).find_class("sglang.srt.utils.patch_torch",
                                                          "_rebuild_cuda_tensor_modified")
# SGLang's patch is now process-wide (it only reduces CUDA tensors); CPU payloads still serialize
named = [("w", torch.arange(6.0))]
assert torch.equal(MultiprocessingSerializer.deserialize(serialize_for_engine(named))[0][1], named[0][1])
print("OK")
"""


def test_our_receiver_takes_sglangs_patched_cuda_rebuild():
    """SGLang's serializer (used on GPU) names its own CUDA rebuild (the GPU by UUID); main refused it, so
    every CUDA IPC update into our engine failed wherever sglang was installed. CPU: the name only. In a
    process of its own: the receiver applies SGLang's process-wide patch of torch's tensor reducer."""
    out = subprocess.run([sys.executable, "-c", _REBUILD], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]


# -- the launch command: SGLang's own argument parser ------------------------------------------------

_PARSE = r"""
import argparse, enum, importlib.machinery, json, sys, types
# torchvision: only sglang's multimodal configs import it at module level (InternVL's image transforms);
# PyPI's Linux wheels link CUDA torch, so on this CPU machine a stand-in module takes its place
tv, tr, fn = (types.ModuleType(n)
              for n in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"))
fn.InterpolationMode = enum.Enum("InterpolationMode", "NEAREST BILINEAR BICUBIC")
tv.transforms, tr.functional = tr, fn
for m in (tv, tr, fn):
    m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    sys.modules[m.__name__] = m
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
ns = parser.parse_args(json.loads(sys.argv[1]))
print(json.dumps({k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, type(None)))}))
"""


def test_our_launch_command_parses_with_sglangs_server_args():
    cfg = EngineConfig(backend="sglang", tp_size=2, sglang=SGLangConfig(mem_fraction_static=0.55),
                       context_length=8192, max_batch_size=48, extra_args=["--chunked-prefill-size", "4096"])
    cmd = sglang_command(cfg, "/models/qwen", 31234, weight_version="7")
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    out = subprocess.run([sys.executable, "-c", _PARSE, json.dumps(cmd[3:])], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed["model_path"] == "/models/qwen" and parsed["tensor_parallel_size"] == 2 and parsed["port"] == 31234
    assert parsed["mem_fraction_static"] == 0.55 and parsed["context_length"] == 8192
    assert parsed["max_running_requests"] == 48 and parsed["weight_version"] == "7"
    assert parsed["enable_memory_saver"] is True and parsed["chunked_prefill_size"] == 4096


def _sglang_function(path: Path, name: str):
    """A top-level function of the pinned source, compiled alone (for modules whose imports need a GPU stack)."""
    import typing

    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict = {k: getattr(typing, k) for k in ("Union", "Iterable", "Optional", "List", "Set", "Dict")}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def test_the_lora_launch_flags_parse_with_sglangs_server_args():
    from rayrl.config import load_config
    from rayrl.machine import Machine
    from rayrl.resolve import resolve

    cfg = resolve(load_config(None, ["engine.backend=sglang", "trainer.lora.rank=16"]),
                  Machine(cuda=True, cores=8, native_bf16=True))
    cmd = sglang_command(cfg.engine, "/models/qwen", 31234)
    out = subprocess.run([sys.executable, "-c", _PARSE, json.dumps(cmd[3:])], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    assert parsed["enable_lora"] is True and parsed["max_lora_rank"] == 16
    assert parsed["lora_target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]  # every linear layer; not "all", which adds the head


def test_the_adapter_we_send_is_what_sglangs_lora_loader_reads(tiny_model_dir):
    """The adapter transport's payload through 0.5.9's own deserializer, config class and module names."""
    import re as regex

    from sglang.srt.lora.lora_config import LoRAConfig  # type: ignore[import-not-found]

    from rayrl.config import LoraConfig, TrainerConfig
    from rayrl.resolve import LINEAR_PROJECTIONS
    from rayrl.trainers.torch_backend import TorchTrainer
    from rayrl.weights.adapter import AdapterSender
    from rayrl.weights.wire import serialize_adapter

    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(lora=LoraConfig(rank=8, alpha=16)), device="cpu")
    sent = dict(trainer.named_weights(torch.bfloat16))
    sender = AdapterSender([EngineTarget(EngineClient("http://127.0.0.1:9"))], trainer.adapter_config())
    got = sglang_utils.MultiprocessingSerializer.deserialize(serialize_adapter(sender._shared(list(sent.items()))))
    assert isinstance(got, dict) and set(got) == set(sent)  # LoRAAdapter iterates tensors.items()
    assert all(got[n].dtype == t.dtype and torch.equal(got[n], t) for n, t in sent.items())
    config = LoRAConfig.from_dict(trainer.adapter_config())
    assert config.r == 8 and config.lora_alpha == 16
    # what the memory pool checks (can_support): the adapter's modules within the server's, normalized by
    # 0.5.9's own function (its module imports torchvision at load: the function is taken from its source)
    normalized = _sglang_function(SRT / "lora" / "utils.py", "get_normalized_target_modules")
    assert normalized(config.target_modules) <= normalized(LINEAR_PROJECTIONS)
    assert normalized(config.target_modules) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    # every tensor lands in a layer (get_layer_id): none is dropped as an embedding or skipped
    assert all(regex.search(r"layers\.(\d+)\.", n) for n in sent)


# -- routes and JSON fields, read from the pinned source ----------------------------------------------


def _routes() -> dict[str, tuple[set[str], str, ast.AsyncFunctionDef]]:
    """path -> (methods, request class the handler parses, handler) in 0.5.9's http_server.py."""
    tree = ast.parse((SRT / "entrypoints" / "http_server.py").read_text())
    routes = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.AsyncFunctionDef, ast.FunctionDef)):
            continue
        arg = fn.args.args[0] if fn.args.args else None
        req_cls = arg.annotation.id if arg is not None and isinstance(arg.annotation, ast.Name) else ""
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.args
                    and isinstance(dec.args[0], ast.Constant)):
                continue
            kind = dec.func.attr
            if kind in ("get", "post", "put"):
                methods = {kind.upper()}
            elif kind == "api_route":
                kw = {k.arg: k.value for k in dec.keywords}
                methods = {e.value for e in kw["methods"].elts} if "methods" in kw else {"GET"}
            else:
                continue
            routes[dec.args[0].value] = (methods, req_cls, fn)
    return routes


def _dataclass_fields(cls_name: str) -> set[str]:
    tree = ast.parse((SRT / "managers" / "io_struct.py").read_text())
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    fields: set[str] = set()
    node = classes[cls_name]
    while node is not None:
        fields |= {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        bases = [b.id for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
        node = classes[bases[0]] if bases else None
    return fields


def _record_client_calls(loop_thread) -> list[tuple[str, str, object]]:
    """Every EngineClient method, called against a loopback server that records (method, path, body)."""
    calls: list[tuple[str, str, object]] = []

    async def record(request: web.Request) -> web.Response:
        raw = await request.read()
        calls.append((request.method, request.path, json.loads(raw) if raw else None))
        if request.path == "/generate":
            return web.json_response({"text": "", "output_ids": [1], "meta_info": {
                "id": "r", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": 1,
                "completion_tokens": 1, "weight_version": "0", "output_token_logprobs": [[-0.1, 1, None]]}})
        if request.path in ("/model_info", "/server_info"):
            return web.json_response({"weight_version": "0"})
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": [{"id": "m", "parent": None}]})
        return web.json_response({"success": True, "message": ""})

    async def run() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", record)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        c = EngineClient(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        await c.generate([1, 2], {"max_new_tokens": 1}, rid="r")
        await c.generate([1, 2], {"max_new_tokens": 1}, rid="r", lora_path="policy")
        await c.load_lora_adapter_from_tensors("policy", {"r": 8}, "AAAA")
        await c.unload_lora_adapter("policy")
        assert await c.lora_adapters() == []
        await c.abort("r")
        await c.abort_all()
        await c.health()
        await c.get_model_info()
        await c.get_server_info()
        await c.get_weight_version()
        await c.update_weights_from_disk("/x", "1", abort_all_requests=False)
        await c.update_weights_from_serialized(["AAAA"], load_format="flattened_bucket", flush_cache=False,
                                               weight_version="1")
        await c.init_weights_update_group("127.0.0.1", 1234, 1, 2, "g", "nccl")
        await c.update_weights_from_distributed(["a"], ["bfloat16"], [[2]], group_name="g", flush_cache=True,
                                                weight_version="1", load_format="flattened_bucket")
        await c.destroy_weights_update_group("g")
        await c.update_weight_version("2")
        for mode in ("abort", "in_place", "retract"):
            await c.pause_generation(mode)
        await c.continue_generation()
        await c.flush_cache()
        await c.release_memory_occupation(None)
        await c.resume_memory_occupation(["weights"])
        await c.resume_memory_occupation(["kv_cache", "cuda_graph"])
        await c.close()
        await runner.cleanup()

    loop_thread.run(run())
    return calls


CPU_ENGINE_ONLY = {("/update_weights_from_tensor", "load_format"): "safetensors"}  # rayrl's own byte form


def test_every_route_and_field_we_send_exists_in_the_pinned_source(loop_thread):
    routes = _routes()
    calls = _record_client_calls(loop_thread)
    called_paths = {p for _, p, _ in calls}
    # every path EngineClient's source names is among the calls made above
    source = Path(client_module.__file__).read_text()
    # rayrl's CPU engine only (never called on SGLang: EngineFleet.set_weight_format skips SGLang engines)
    cpu_engine_only = {"/set_weight_format"}
    assert set(re.findall(r'"(/[a-z0-9_/]+)"', source)) <= called_paths | {"/generate"} | cpu_engine_only
    assert not cpu_engine_only & set(routes), "a CPU-engine extension route is now SGLang's too: check its contract"
    for method, path, body in calls:
        assert path in routes, f"{path} is not served by SGLang {PINNED}"
        methods, req_cls, handler = routes[path]
        assert method in methods, (path, method, methods)
        text = ast.unparse(handler)
        assert "status_code=404" not in text, f"{path} answers 404 in SGLang {PINNED}: {text[:200]}"
        if isinstance(body, dict) and req_cls:
            unknown = set(body) - _dataclass_fields(req_cls)
            assert not unknown, f"{path} sends {unknown}, not fields of {req_cls} in SGLang {PINNED}"
    modes = re.search(r"mode: Literal\[([^\]]+)\]", (SRT / "managers" / "io_struct.py").read_text())
    sent_modes = {b["mode"] for _, p, b in calls if p == "/pause_generation"}
    assert modes and sent_modes <= set(re.findall(r'"(\w+)"', modes.group(1)))
    constants = (SRT / "constants.py").read_text()
    for tag in ("weights", "kv_cache", "cuda_graph"):
        assert f'"{tag}"' in constants


def test_every_field_we_read_is_one_sglang_writes():
    """meta_info keys parse_generate_response reads, and /model_info's weight_version."""
    tree = ast.parse(Path(client_module.__file__).read_text())
    parse = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "parse_generate_response")
    read = {c.args[0].value for c in ast.walk(parse) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
            and c.func.attr == "get" and c.args and isinstance(c.args[0], ast.Constant)}
    written = "".join((SRT / "managers" / f).read_text() for f in ("tokenizer_manager.py", "detokenizer_manager.py"))
    extension = {"output_token_versions"}  # rayrl's CPU engine only: SGLang 0.5.9 sends no per-token versions
    assert extension <= read
    for key in read - extension:
        assert f'"{key}"' in written, f"{key} is read but SGLang {PINNED} never writes it"
    assert '"output_token_versions"' not in written and '"weight_versions"' not in written
    model_info = ast.unparse(_routes()["/model_info"][2])
    assert "'weight_version'" in model_info
