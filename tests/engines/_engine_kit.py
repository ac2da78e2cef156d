"""Helpers shared by the engine tests (imported by path; pytest puts this directory on sys.path)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Awaitable

import torch

from rayrl.engines.cpu.engine import CPUEngine
from rayrl.engines.cpu.server import EngineServer


class ServerThread:
    """A real EngineServer on loopback, on its own event loop in a daemon thread."""

    def __init__(self, engine: CPUEngine) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = EngineServer(engine, host="127.0.0.1", port=0)
        self.url = self.run(self.server.start())

    def run(self, coro: Awaitable[Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def random_weights(model: torch.nn.Module, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """New random tensors for every parameter, large enough that greedy outputs vary token to token
    (the tiny model's default init makes greedy decoding repeat one token)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embeddings: saved once, as HF does
            continue
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
        else:
            out[name] = scale * torch.randn(t.shape, generator=gen)
    return out


def model_with_weights(source: Path, target: Path, seed: int) -> Path:
    """A copy of the HF directory ``source`` whose weights are ``random_weights(seed)``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.load_state_dict(random_weights(model, seed), strict=False)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name == "vocab.json":
            shutil.copy(f, target / f.name)
    return target


def forward_logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-probs of ``output`` after ``prompt`` from one plain forward pass (the trainer's view)."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output).view(-1, 1)).view(-1)


def post_json(url: str, path: str, body: Any) -> tuple[int, Any]:
    """POST ``body`` (JSON-encoded; bytes go as they are) to a server on loopback, bypassing any proxy: the
    status and the answer's JSON ({} for a success whose body is empty or not JSON, ``{"message": text}``
    for an error whose body is not JSON). HTTP errors are answers here, not exceptions."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=60) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, ({"message": raw.decode(errors="replace")} if status >= 400 else {})
