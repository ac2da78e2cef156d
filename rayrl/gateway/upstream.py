"""Streaming ``/generate`` calls to the engines, for streaming clients.

Non-streaming turns use ``Router.generate`` (one JSON answer). A streaming client wants text as it is
generated, so the gateway asks the engine for SGLang's streaming ``/generate`` (``stream: true``):
server-sent events whose ``text`` is cumulative and whose ``output_ids``/log-probs are cumulative by
default, or incremental when the engine runs with ``--incremental-streaming-output``; both are
accepted. The engine is picked by the same router (session affinity, load counts), so streaming and
non-streaming turns of one session land on the same engine.

Cancellation: when the client goes away the handler is cancelled; the engine request is then aborted
explicitly with ``/abort_request`` (and its connection closed), so an abandoned generation never keeps
a batch slot busy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Awaitable, Callable, Mapping, Sequence

import aiohttp
import numpy as np

from rayrl.engines.client import EngineError, EngineUnavailable, GenerateOutput

logger = logging.getLogger("rayrl.gateway")

OnText = Callable[[str], Awaitable[None]]


class _Accumulator:
    """Folds streamed chunks (cumulative or incremental ids/log-probs) into one finished output."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.text = ""
        self.meta: dict[str, Any] = {}

    def add(self, chunk: Mapping[str, Any]) -> None:
        ids = list(chunk.get("output_ids") or [])
        meta = chunk.get("meta_info") or {}
        entries = meta.get("output_token_logprobs") or []
        lps = [float(e[0]) if e and e[0] is not None else float("nan") for e in entries]
        n = len(self.ids)
        cumulative = len(ids) >= n and ids[:n] == self.ids
        if cumulative:
            new_total = len(ids)
            self.ids = ids
        else:
            new_total = n + len(ids)
            self.ids = self.ids + ids
        if len(lps) == new_total:
            self.logprobs = lps
        elif len(self.logprobs) + len(lps) == new_total:
            self.logprobs = self.logprobs + lps
        self.text = chunk.get("text", self.text) or self.text
        self.meta = dict(meta)

    def output(self, base_url: str) -> GenerateOutput:
        if len(self.logprobs) != len(self.ids):
            raise EngineError(200, "the engine stream ended without log-probs for every token", base_url)
        per_token = self.meta.get("output_token_versions")
        versions = None
        if per_token:
            versions = np.asarray([int(v) if str(v).lstrip("-").isdigit() else -1 for v in per_token], np.int32)
        return GenerateOutput(
            output_ids=np.asarray(self.ids, dtype=np.int32),
            output_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            text=self.text,
            finish_reason=self.meta.get("finish_reason") or {},
            weight_version=str(self.meta.get("weight_version", "")),
            versions=versions,
            prompt_tokens=int(self.meta.get("prompt_tokens", 0)),
            completion_tokens=len(self.ids),
            rid=str(self.meta.get("id", "")),
            meta_info=self.meta,
        )


class StreamingUpstream:
    """Streaming generation over a Router's engines, with its own connection pool."""

    def __init__(self, router: Any, timeout_s: float = 600.0) -> None:
        self.router = router
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_read=self.timeout_s, sock_connect=30),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def generate(
        self,
        session_key: str,
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Mapping[str, Any],
        on_text: OnText,
    ) -> GenerateOutput:
        """Generate with streaming; ``on_text`` gets the cumulative text after every chunk."""
        tried: list[str] = []
        while True:
            url = self.router.pick(session_key, exclude=tried)
            try:
                return await self._generate_on(url, input_ids, sampling_params, on_text)
            except EngineUnavailable as err:
                tried.append(url)
                if not err.connect_failed or len(tried) >= 2 or len(tried) >= len(self.router.urls):
                    raise
                logger.warning("engine %s unavailable (%s); retrying on another engine", url, err.message)

    async def _generate_on(
        self, url: str, input_ids: Sequence[int] | np.ndarray, params: Mapping[str, Any], on_text: OnText
    ) -> GenerateOutput:
        rid = uuid.uuid4().hex
        payload = {
            "input_ids": np.asarray(input_ids).astype(np.int64).tolist(),
            "sampling_params": dict(params),
            "rid": rid,
            "return_logprob": True,
            "stream": True,
        }
        # The router's per-engine in-flight counts drive its load fallback; a streaming call counts
        # like a non-streaming one. (Router has no public hook for this yet.)
        in_flight = getattr(self.router, "_in_flight", None)
        if isinstance(in_flight, dict) and url in in_flight:
            in_flight[url] += 1
        acc = _Accumulator()
        finished = False
        try:
            async with self._http().post(url + "/generate", data=json.dumps(payload),
                                         headers={"Content-Type": "application/json"}) as resp:
                if resp.status >= 300:
                    raw = await resp.read()
                    raise EngineError(resp.status, raw.decode("utf-8", "replace")[:1000], url)
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if isinstance(chunk, dict) and "error" in chunk:
                        err = chunk["error"]
                        message = err.get("message") if isinstance(err, dict) else str(err)
                        raise EngineError(500, str(message), url)
                    acc.add(chunk)
                    if (acc.meta.get("finish_reason") or None) is not None:
                        finished = True
                    await on_text(acc.text)
            if not finished:
                raise EngineUnavailable("the engine stream ended before the request finished", url)
            return acc.output(url)
        except asyncio.TimeoutError:
            raise EngineUnavailable("no answer from /generate within the timeout", url) from None
        except aiohttp.ClientConnectorError as err:
            raise EngineUnavailable(f"{type(err).__name__}: {err}", url, connect_failed=True) from None
        except aiohttp.ClientError as err:
            raise EngineUnavailable(f"{type(err).__name__}: {err}", url) from None
        finally:
            if isinstance(in_flight, dict) and url in in_flight:
                in_flight[url] -= 1
            if not finished:
                await asyncio.shield(self._abort(url, rid))

    async def _abort(self, url: str, rid: str) -> None:
        client = self.router.clients.get(url)
        if client is None:
            return
        try:
            await client.abort(rid)
        except EngineError:
            pass  # the engine is gone: nothing left to abort
