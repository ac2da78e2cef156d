"""Router: spreads generate calls over engine servers, keeping each session on one engine.

Affinity: rendezvous (highest-random-weight) hashing of the session key picks the preferred engine, so
consecutive turns of an agent land where their prefix was last seen (SGLang's radix cache reuses it on
GPU) and adding or removing an engine only moves the sessions that engine owned. Load: the router
counts requests in flight per engine; when the preferred engine has ``imbalance_abs`` more than the
least-loaded one and more than ``imbalance_rel`` times as many, the request goes to the least-loaded
engine instead (SGLang router's cache-aware policy uses the same two thresholds).

Routing runs in the caller's process: one EngineClient per URL, no extra hop.

Pausing (the colocated schedule): while the engines give their devices to the trainer, :meth:`Router.pause`
makes new calls wait here, in the gateway, instead of at an engine that may have released its memory;
:meth:`Router.resume` lets them go on the new weights. A call waits at most ``wait_timeout_s``.
A generation the engines abort *because of* the pause (``pause_generation(mode="abort")``, partial rollout)
is not returned to the agent: once generation resumes it is re-issued as prompt + tokens so far, and the
parts are concatenated, each token keeping the policy version that generated it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

import aiohttp
import numpy as np

from rayrl.engines.client import EngineClient, EngineError, EngineUnavailable, GenerateOutput

# on_text(text so far, output ids so far, their log-probs): streaming callers can emit each chunk's
# log-probs with the chunk
OnText = Callable[[str, list[int], list[float]], Awaitable[None]]

logger = logging.getLogger(__name__)


def _score(url: str, key: str) -> int:
    digest = hashlib.blake2b(f"{url}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Router:
    """Session-affine, load-aware routing of ``generate`` calls over engine URLs."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 600.0,
        imbalance_abs: int = 8,
        imbalance_rel: float = 1.5,
        wait_timeout_s: float = 600.0,
        reconnect_s: float = 5.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self.wait_timeout_s = wait_timeout_s
        self.reconnect_s = reconnect_s
        self._clients: dict[str, EngineClient] = {}
        self._in_flight: dict[str, int] = {}
        self._retired: list[EngineClient] = []
        self._stream_http: Optional[aiohttp.ClientSession] = None
        self._paused = False
        self._resumed: Optional[asyncio.Event] = None
        self.waiting = 0  # calls queued here while paused (the gateway queue depth)
        self.routed = {"affinity": 0, "load_fallback": 0, "retried": 0, "reconnect_waits": 0}
        self.pause_stats = {"queued": 0, "wait_timeouts": 0, "continued": 0, "pauses": 0}
        for url in urls:
            self.add(url)

    @property
    def clients(self) -> dict[str, EngineClient]:
        """URL -> EngineClient (a copy; use add/remove to change the set)."""
        return dict(self._clients)

    @property
    def urls(self) -> list[str]:
        return list(self._clients)

    @property
    def in_flight(self) -> dict[str, int]:
        return dict(self._in_flight)

    def add(self, url: str) -> EngineClient:
        """Start routing to ``url`` (idempotent)."""
        url = url.rstrip("/")
        if url not in self._clients:
            self._clients[url] = EngineClient(url, timeout_s=self.timeout_s)
            self._in_flight[url] = 0
        return self._clients[url]

    def remove(self, url: str) -> None:
        """Stop routing new requests to ``url``; requests already there finish normally."""
        client = self._clients.pop(url.rstrip("/"), None)
        self._in_flight.pop(url.rstrip("/"), None)
        if client is not None:
            self._retired.append(client)

    # -- pausing -----------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def in_flight_total(self) -> int:
        return sum(self._in_flight.values())

    def pause(self) -> None:
        """New calls wait here until :meth:`resume`; calls already at an engine go on."""
        if not self._paused:
            self._paused = True
            self._resumed = None  # created by the first waiter, in its event loop
            self.pause_stats["pauses"] += 1

    def resume(self) -> None:
        """Release every waiting call."""
        self._paused = False
        if self._resumed is not None:
            self._resumed.set()
        self._resumed = None

    async def wait_until_resumed(self) -> bool:
        """Return at once (False) when not paused; else wait for :meth:`resume` and return True
        (EngineUnavailable after ``wait_timeout_s``: the agent gets a 503 instead of hanging forever)."""
        if not self._paused:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout_s
        self.waiting += 1
        self.pause_stats["queued"] += 1
        try:
            while self._paused:  # paused again before this call got going: keep waiting
                if self._resumed is None:
                    self._resumed = asyncio.Event()
                await asyncio.wait_for(self._resumed.wait(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            self.pause_stats["wait_timeouts"] += 1
            raise EngineUnavailable(
                f"generation stayed paused for more than {self.wait_timeout_s:.0f} s (waiting at the gateway)"
            ) from None
        finally:
            self.waiting -= 1
        return True

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no call is at an engine (new ones are held while paused); False on timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight_total > 0:
            if loop.time() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True

    def stats(self) -> dict[str, int]:
        """Counters for the step metrics: routing decisions, queue depth and pause effects."""
        return {**self.routed, **self.pause_stats, "queue_depth": self.waiting, "in_flight": self.in_flight_total}

    def _aborted_by_pause(self, out: GenerateOutput, pauses_before: int) -> bool:
        """An abort while paused, or by a pause that began after the part was sent."""
        aborted = (out.finish_reason or {}).get("type") == "abort"
        return aborted and (self._paused or self.pause_stats["pauses"] != pauses_before)

    # -- routing -----------------------------------------------------------------------------------

    def ranking(self, session_key: str) -> list[str]:
        """Engines in this session's rendezvous order (first = preferred)."""
        return sorted(self._clients, key=lambda url: _score(url, session_key), reverse=True)

    def pick(self, session_key: Optional[str], exclude: Sequence[str] = ()) -> str:
        """The engine for the next request of ``session_key`` (None: least loaded)."""
        candidates = [u for u in self._clients if u not in exclude]
        if not candidates:
            raise EngineUnavailable("no engine servers to route to")
        least = min(candidates, key=lambda u: self._in_flight[u])
        if session_key is None:
            return least
        preferred = next(u for u in self.ranking(session_key) if u in candidates)
        busy, idle = self._in_flight[preferred], self._in_flight[least]
        if busy - idle >= self.imbalance_abs and busy > self.imbalance_rel * idle:
            self.routed["load_fallback"] += 1
            return least
        self.routed["affinity"] += 1
        return preferred

    async def generate(
        self,
        session_key: Optional[str],
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Optional[Mapping[str, Any]] = None,
        rid: Optional[str] = None,
        return_logprob: bool = True,
    ) -> GenerateOutput:
        """Generate on the engine chosen for ``session_key``. When the engine cannot even be connected
        to (so nothing ran there), retry once on another engine; other failures propagate. Waits while
        paused; a generation aborted by a pause is continued after it (see the module docstring)."""

        async def one_part(ids: np.ndarray, params: dict[str, Any], part_rid: Optional[str]) -> GenerateOutput:
            async def call(url: str) -> GenerateOutput:
                return await self._clients[url].generate(ids, params, rid=part_rid, return_logprob=return_logprob)

            return await self._routed(session_key, call)

        return await self._generate_parts(input_ids, sampling_params, rid, one_part)

    async def generate_stream(
        self,
        session_key: Optional[str],
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Optional[Mapping[str, Any]],
        on_text: OnText,
    ) -> GenerateOutput:
        """Like :meth:`generate`, over SGLang's streaming ``/generate``: ``on_text`` gets the cumulative
        text after every chunk. A stream that ends without finishing (client gone, engine broken) is
        aborted on its engine so it never keeps a batch slot busy."""
        prefix = ""  # text of the parts before a pause, when the generation was continued
        prefix_ids: list[int] = []
        prefix_lps: list[float] = []

        async def one_part(ids: np.ndarray, params: dict[str, Any], _: Optional[str]) -> GenerateOutput:
            nonlocal prefix, prefix_ids, prefix_lps

            async def on_part_text(text: str, out_ids: list[int], out_lps: list[float]) -> None:
                await on_text(prefix + text, prefix_ids + out_ids, prefix_lps + out_lps)

            out = await self._routed(session_key, lambda url: self._stream_on(url, ids, params, on_part_text))
            prefix += out.text
            prefix_ids = prefix_ids + [int(t) for t in out.output_ids]
            prefix_lps = prefix_lps + [float(x) for x in out.output_logprobs]
            return out

        return await self._generate_parts(input_ids, sampling_params, None, one_part)

    async def _routed(self, session_key: Optional[str], call: Callable[[str], Awaitable[GenerateOutput]]) -> GenerateOutput:
        """``call(url)`` on the engine picked for the session, counted in flight. When the engine could
        not even be connected to (nothing ran there): once on another engine; with no other engine, again
        every 0.25 s for ``reconnect_s`` (an engine being restarted; the pipeline then pauses the router,
        so the call waits for the restart instead of failing)."""
        tried: list[str] = []
        refused_since: Optional[float] = None
        loop = asyncio.get_running_loop()
        while True:
            if await self.wait_until_resumed():
                refused_since = None  # the pause was the wait: a fresh window after it
            url = self.pick(session_key, exclude=tried)
            self._in_flight[url] += 1
            try:
                return await call(url)
            except EngineUnavailable as err:
                if not err.connect_failed:
                    raise
                if not tried and len(self._clients) > 1:
                    tried.append(url)
                    self.routed["retried"] += 1
                    logger.warning("engine %s unavailable (%s); retrying on another engine", url, err.message)
                    continue
                refused_since = loop.time() if refused_since is None else refused_since
                if loop.time() - refused_since >= self.reconnect_s:
                    raise
                tried.clear()
                self.routed["reconnect_waits"] += 1
            finally:
                if url in self._in_flight:
                    self._in_flight[url] -= 1
            await asyncio.sleep(0.25)

    async def _generate_parts(
        self,
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Optional[Mapping[str, Any]],
        rid: Optional[str],
        one_part: Callable[[np.ndarray, dict[str, Any], Optional[str]], Awaitable[GenerateOutput]],
    ) -> GenerateOutput:
        """Run a generation; while the engines abort it for a pause, continue it from the tokens so far."""
        prompt = np.asarray(input_ids, dtype=np.int32)
        params = dict(sampling_params or {})
        pauses = self.pause_stats["pauses"]
        parts = [await one_part(prompt, params, rid)]
        while self._aborted_by_pause(parts[-1], pauses):
            done = sum(len(p.output_ids) for p in parts)
            budget = params.get("max_new_tokens")
            if budget is not None and done >= int(budget):
                break
            self.pause_stats["continued"] += 1
            ids = np.concatenate([prompt, *[p.output_ids for p in parts]]).astype(np.int32)
            rest = dict(params)
            if budget is not None:
                rest["max_new_tokens"] = int(budget) - done
            pauses = self.pause_stats["pauses"]
            parts.append(await one_part(ids, rest, None if rid is None else f"{rid}-c{len(parts)}"))
        return join_parts(parts) if len(parts) > 1 else parts[0]

    def _http(self) -> aiohttp.ClientSession:
        if self._stream_http is None or self._stream_http.closed:
            self._stream_http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_read=self.timeout_s, sock_connect=30),
                connector=aiohttp.TCPConnector(limit=0),
            )
        return self._stream_http

    async def _stream_on(
        self, url: str, input_ids: np.ndarray, params: Mapping[str, Any], on_text: OnText
    ) -> GenerateOutput:
        rid = uuid.uuid4().hex
        payload = {
            "input_ids": np.asarray(input_ids).astype(np.int64).tolist(),
            "sampling_params": dict(params),
            "rid": rid,
            "return_logprob": True,
            "stream": True,
        }
        acc = StreamAccumulator()
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
                    await on_text(acc.text, acc.ids, acc.logprobs)
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
            if not finished:
                await asyncio.shield(self._abort_quietly(url, rid))

    async def _abort_quietly(self, url: str, rid: str) -> None:
        client = self._clients.get(url)
        if client is None:
            return
        try:
            await client.abort(rid)
        except EngineError:
            pass  # the engine is gone: nothing left to abort

    async def close(self) -> None:
        for client in list(self._clients.values()) + self._retired:
            await client.close()
        self._retired.clear()
        if self._stream_http is not None:
            await self._stream_http.close()
            self._stream_http = None


def _part_versions(out: GenerateOutput) -> np.ndarray:
    if out.versions is not None:
        return np.asarray(out.versions, dtype=np.int32)
    try:
        version = int(out.weight_version)
    except (TypeError, ValueError):
        version = -1
    return np.full(len(out.output_ids), version, dtype=np.int32)


def join_parts(parts: Sequence[GenerateOutput]) -> GenerateOutput:
    """One generation from its parts (aborted by a pause, then continued): tokens, log-probs and text
    concatenated; per-token versions say which weights produced each token; the last part decides how
    it finished."""
    last = parts[-1]
    ids = np.concatenate([p.output_ids for p in parts]).astype(np.int32)
    return GenerateOutput(
        output_ids=ids,
        output_logprobs=np.concatenate([p.output_logprobs for p in parts]).astype(np.float32),
        text="".join(p.text for p in parts),
        finish_reason=last.finish_reason,
        weight_version=last.weight_version,
        versions=np.concatenate([_part_versions(p) for p in parts]),
        prompt_tokens=parts[0].prompt_tokens,
        completion_tokens=len(ids),
        rid=parts[0].rid,
        # the caller's prompt is the first part's: its cache hits are the ones to report
        meta_info={**last.meta_info, "continued_parts": len(parts),
                   "cached_tokens": parts[0].meta_info.get("cached_tokens", 0)},
    )


class StreamAccumulator:
    """Folds SGLang stream chunks (cumulative or incremental ids/log-probs) into one finished output."""

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
