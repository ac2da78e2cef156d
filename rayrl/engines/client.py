"""EngineClient: async client for SGLang's native HTTP API (SGLang on GPU, the CPU engine elsewhere).

One shared aiohttp session per client, created lazily on first use in the running event loop. Every
non-2xx answer raises :class:`EngineError` (status + the server's message); connection failures and
timeouts raise :class:`EngineUnavailable`. Cancelling a :meth:`EngineClient.generate` call aborts the
request on the engine, so an abandoned agent turn does not keep a batch slot busy.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import aiohttp
import numpy as np


class EngineError(RuntimeError):
    """The engine answered with a non-2xx status."""

    def __init__(self, status: Optional[int], message: str, url: str = "") -> None:
        super().__init__(f"{url}: HTTP {status}: {message}" if status is not None else f"{url}: {message}")
        self.status = status
        self.message = message
        self.url = url


class EngineUnavailable(EngineError):
    """The engine could not be reached (connection refused or reset, timeout).

    ``connect_failed`` is True when no connection was made at all, so the request surely did not run.
    ``connection_lost`` is True when the connection broke before the answer was complete (the server
    died or was killed mid-request): nothing of it reached the caller, except what a stream already
    delivered, which ``partial`` holds (tokens, log-probs, text; None for a plain request).
    """

    def __init__(self, message: str, url: str = "", connect_failed: bool = False, connection_lost: bool = False,
                 partial: Optional["GenerateOutput"] = None) -> None:
        super().__init__(None, message, url)
        self.connect_failed = connect_failed
        self.connection_lost = connection_lost
        self.partial = partial


def is_connection_lost(err: BaseException) -> bool:
    """A broken connection (reset, closed by a dying server, a truncated body), not a refused one."""
    if isinstance(err, aiohttp.ClientConnectorError):
        return False
    return isinstance(err, (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, aiohttp.ClientPayloadError))


@dataclass
class GenerateOutput:
    """One finished generation. ``versions`` holds per-token policy versions (int32) only when the
    weights changed during the request (else None: every token has ``weight_version``)."""

    output_ids: np.ndarray
    output_logprobs: np.ndarray
    text: str
    finish_reason: dict[str, Any]
    weight_version: str
    versions: Optional[np.ndarray]
    prompt_tokens: int
    completion_tokens: int
    rid: str
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def token_versions(self) -> Optional[np.ndarray]:
        return self.versions


def _version_int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1  # non-integer version strings cannot be ordered; policy versions are ints by convention


def parse_generate_response(body: Mapping[str, Any]) -> GenerateOutput:
    """A /generate JSON object (SGLang shape) as a GenerateOutput with numpy arrays."""
    meta = body.get("meta_info") or {}
    ids = np.asarray(body.get("output_ids") or [], dtype=np.int32)
    entries = meta.get("output_token_logprobs")
    if entries:
        lps = np.asarray([e[0] if e[0] is not None else np.nan for e in entries], dtype=np.float32)
    else:
        lps = np.zeros(0, dtype=np.float32)
    per_token = meta.get("output_token_versions")
    versions = np.asarray([_version_int(v) for v in per_token], dtype=np.int32) if per_token else None
    return GenerateOutput(
        output_ids=ids,
        output_logprobs=lps,
        text=body.get("text", ""),
        finish_reason=meta.get("finish_reason") or {},
        weight_version=str(meta.get("weight_version", "")),
        versions=versions,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        completion_tokens=int(meta.get("completion_tokens", len(ids))),
        rid=str(meta.get("id", "")),
        meta_info=dict(meta),
    )


class EngineClient:
    """Async client of one engine server at ``base_url``: the engine interface (rayrl/engines/api.py
    ``EngineAPI``), one method per route, the same for every backend."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._session: Optional[aiohttp.ClientSession] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            # A session belongs to one event loop; a client reused from another loop gets a fresh one.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                connector=aiohttp.TCPConnector(limit=0),
            )
            self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def _request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        timeout_s: Optional[float] = None,
        expect_json: bool = True,
    ) -> Any:
        url = self.base_url + path
        session = self._get_session()
        kwargs: dict[str, Any] = {}
        if payload is not None:
            kwargs["data"] = json.dumps(payload)
            kwargs["headers"] = {"Content-Type": "application/json"}
        if timeout_s is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with session.request(method, url, **kwargs) as resp:
                raw = await resp.read()
                if resp.status >= 300:
                    raise EngineError(resp.status, error_message(raw), self.base_url)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"no answer from {path} within the timeout", self.base_url) from None
        except aiohttp.ClientError as err:
            refused = isinstance(err, aiohttp.ClientConnectorError)
            raise EngineUnavailable(
                f"{type(err).__name__}: {err}", self.base_url, connect_failed=refused,
                connection_lost=is_connection_lost(err),
            ) from None
        if not expect_json:
            return raw.decode("utf-8", "replace")
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise EngineError(resp.status, f"{path} answered with non-JSON data", self.base_url) from None

    # ------------------------------------------------------------------ generation

    async def generate(
        self,
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Optional[Mapping[str, Any]] = None,
        rid: Optional[str] = None,
        return_logprob: bool = True,
        lora_path: Optional[str] = None,
    ) -> GenerateOutput:
        """Generate from token ids (``lora_path``: with the LoRA adapter loaded under that name). Cancelling
        this coroutine aborts the request on the engine."""
        rid = rid or uuid.uuid4().hex
        payload = {
            "input_ids": np.asarray(input_ids).astype(np.int64).tolist(),
            "sampling_params": dict(sampling_params or {}),
            "rid": rid,
            "return_logprob": bool(return_logprob),
        }
        if lora_path is not None:
            payload["lora_path"] = lora_path
        try:
            body = await self._request("POST", "/generate", payload)
        except asyncio.CancelledError:
            await asyncio.shield(self._abort_quietly(rid))
            raise
        if not isinstance(body, dict):
            raise EngineError(200, "/generate answered with an unexpected body", self.base_url)
        return parse_generate_response(body)

    async def prompt_logprobs(self, input_ids: Sequence[int] | np.ndarray, start: int) -> np.ndarray:
        """Log-probs of ``input_ids[start:]`` under the engine's model, each given the tokens before it
        (SGLang's ``/generate`` with ``max_new_tokens`` 0, ``return_logprob`` and ``logprob_start_len``;
        ``start`` >= 1). Used to score another model's samples (on-policy distillation's teacher)."""
        ids = np.asarray(input_ids).astype(np.int64)
        if not 1 <= start < len(ids):
            raise ValueError(f"prompt_logprobs: start {start} outside [1, {len(ids)})")
        payload = {"input_ids": ids.tolist(), "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                   "return_logprob": True, "logprob_start_len": int(start)}
        body = await self._request("POST", "/generate", payload)
        entries = ((body or {}).get("meta_info") or {}).get("input_token_logprobs") or []
        values = np.asarray([e[0] if e[0] is not None else np.nan for e in entries], dtype=np.float32)
        if len(values) != len(ids) - start or not np.all(np.isfinite(values)):
            raise EngineError(200, f"/generate gave {len(values)} prompt log-probs for {len(ids) - start} tokens",
                              self.base_url)
        return values

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self.abort(rid)
        except EngineError:
            pass  # the engine is gone: nothing left to abort

    async def abort(self, rid: str) -> None:
        await self._request("POST", "/abort_request", {"rid": rid}, timeout_s=30.0, expect_json=False)

    async def abort_all(self) -> None:
        await self._request("POST", "/abort_request", {"abort_all": True}, timeout_s=30.0, expect_json=False)

    # ------------------------------------------------------------------ status

    async def health(self, timeout_s: float = 10.0) -> bool:
        """True when /health answers 200 within ``timeout_s``."""
        try:
            await self._request("GET", "/health", timeout_s=timeout_s, expect_json=False)
            return True
        except EngineError:
            return False

    async def get_model_info(self) -> dict[str, Any]:
        """``/model_info`` (SGLang 0.5.9's own path; ``/get_model_info`` is its deprecated alias)."""
        return await self._request("GET", "/model_info", timeout_s=30.0)

    async def get_server_info(self) -> dict[str, Any]:
        """``/server_info`` (SGLang 0.5.9's own path; ``/get_server_info`` is its deprecated alias)."""
        return await self._request("GET", "/server_info", timeout_s=30.0)

    async def get_weight_version(self) -> str:
        """The engine's weight version, from ``/model_info``: SGLang 0.5.9 answers 404 on
        ``/get_weight_version`` (later versions have no such route)."""
        body = await self.get_model_info()
        if not isinstance(body, dict) or "weight_version" not in body:
            raise EngineError(200, "/model_info answered without weight_version", self.base_url)
        return str(body["weight_version"])

    # ------------------------------------------------------------------ weights and memory

    async def update_weights_from_disk(
        self, path: str, weight_version: Optional[str] = None, *, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {"model_path": str(path), "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._request("POST", "/update_weights_from_disk", payload)

    async def update_weights_from_serialized(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: Optional[str] = None,
        flush_cache: bool = True,
        weight_version: Optional[str] = None,
        abort_all_requests: bool = False,
        timeout_s: Optional[float] = None,
    ) -> dict[str, Any]:
        """``/update_weights_from_tensor``: one serialized payload per engine TP rank, already encoded by
        the weight side (rayrl/weights/wire.py: SGLang's form, CUDA IPC handles on GPU and shared memory on
        CPU, with ``load_format`` null; or ``"safetensors"``, bytes in the request: ``push_safetensors``)."""
        payload: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._request("POST", "/update_weights_from_tensor", payload, timeout_s=timeout_s)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
        timeout_s: Optional[float] = None,
    ) -> dict[str, Any]:
        """Ask the engine to join the trainer's broadcast group; returns once every rank has joined."""
        payload = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "group_name": group_name,
            "backend": backend,
        }
        return await self._request("POST", "/init_weights_update_group", payload, timeout_s=timeout_s)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: Optional[str] = None,
        load_format: Optional[str] = None,
        timeout_s: Optional[float] = None,
    ) -> dict[str, Any]:
        """Announce one bucket; the engine then receives the tensors by broadcast, in ``names`` order."""
        payload: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        if load_format is not None:
            payload["load_format"] = load_format
        return await self._request("POST", "/update_weights_from_distributed", payload, timeout_s=timeout_s)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        return await self._request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weight_version(self, new_version: str) -> dict[str, Any]:
        return await self._request("POST", "/update_weight_version", {"new_version": str(new_version)})

    async def load_lora_adapter_from_tensors(self, lora_name: str, config_dict: Mapping[str, Any],
                                             serialized_tensors: str,
                                             timeout_s: Optional[float] = None) -> dict[str, Any]:
        """SGLang's LoRA route: ``serialized_tensors`` is its MultiprocessingSerializer form (base64) of a dict
        PEFT name -> tensor (rayrl/weights/adapter.py makes it)."""
        return await self._request("POST", "/load_lora_adapter_from_tensors",
                                   {"lora_name": lora_name, "config_dict": dict(config_dict),
                                    "serialized_tensors": serialized_tensors}, timeout_s=timeout_s)

    async def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return await self._request("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    async def lora_adapters(self) -> list[str]:
        """The names of the LoRA adapters loaded (``/v1/models``: the cards with a parent model)."""
        body = await self._request("GET", "/v1/models")
        cards = body.get("data") if isinstance(body, dict) else None
        if not isinstance(cards, list):
            raise EngineError(200, "/v1/models answered without a data list", self.base_url)
        return [str(c["id"]) for c in cards if isinstance(c, dict) and c.get("parent") is not None]

    async def set_weight_format(self, weight_format: str) -> dict[str, Any]:
        """The CPU engine's decode weight format (its own route; SGLang has none: a 404 there)."""
        return await self._request("POST", "/set_weight_format", {"weight_format": weight_format})

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        return await self._request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> dict[str, Any]:
        return await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> str:
        return await self._request("POST", "/flush_cache", expect_json=False)

    async def wait_idle(self, timeout_s: float, poll_s: float = 0.2) -> float:
        """Return once the engine holds no request (``/flush_cache`` answers 200: SGLang 0.5.9 flushes only
        then, and asserts the same before releasing memory or after an update that flushes); the seconds
        waited. Aborted requests leave SGLang's batch only at its next scheduler step, so a release right
        after ``/pause_generation`` can find them (slime polls ``/flush_cache`` the same way). Raises
        EngineError after ``timeout_s`` (``engine.idle_timeout_s``)."""
        started = time.monotonic()
        while True:
            try:
                await self._request("POST", "/flush_cache", timeout_s=max(timeout_s, 5.0), expect_json=False)
                return time.monotonic() - started
            except EngineError as err:
                if err.status != 400:
                    raise
                if time.monotonic() - started >= timeout_s:
                    raise EngineError(400, f"requests still running or waiting {timeout_s:.0f} s after the pause "
                                      "(/flush_cache refused until then; engine.idle_timeout_s): releasing its "
                                      "memory or flushing its cache now would kill an SGLang scheduler",
                                      self.base_url) from None
            await asyncio.sleep(poll_s)

    async def release_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        await self._request(
            "POST", "/release_memory_occupation", {"tags": list(tags) if tags is not None else None}
        )

    async def resume_memory_occupation(self, tags: Optional[Sequence[str]] = None) -> None:
        await self._request(
            "POST", "/resume_memory_occupation", {"tags": list(tags) if tags is not None else None}
        )


def error_message(raw: bytes) -> str:
    """The message of an SGLang error body (either error shape), else the raw text."""
    text = raw.decode("utf-8", "replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text.strip()[:1000]
    if isinstance(body, dict):
        if isinstance(body.get("message"), str):
            return body["message"]
        if isinstance(body.get("error_message"), str):  # SGLang's LoRAUpdateOutput
            return body["error_message"]
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
    return text.strip()[:1000]
