"""Router: spreads generate calls over engine servers, keeping each session on one engine.

Affinity: rendezvous (highest-random-weight) hashing of the session key picks the preferred engine, so
consecutive turns of an agent land where their prefix was last seen (SGLang's radix cache reuses it on
GPU) and adding or removing an engine only moves the sessions that engine owned. Load: the router
counts requests in flight per engine; when the preferred engine has ``imbalance_abs`` more than the
least-loaded one and more than ``imbalance_rel`` times as many, the request goes to the least-loaded
engine instead (SGLang router's cache-aware policy uses the same two thresholds).

Routing runs in the caller's process: one EngineClient per URL, no extra hop. Engines come and go
(:meth:`Router.add` / :meth:`Router.remove`, called as the pipeline replaces engines that died); with no
engine at all, calls wait here for one to be added, up to ``wait_timeout_s``.

Every generation is streamed from its engine (SGLang's streaming ``/generate``), whether or not the agent
streams: the router always knows the tokens (and log-probs) received so far. An engine that dies
mid-request breaks the connection before the answer is complete; the generation is then continued once
on another engine from the prompt plus every token already received (as after a pause, below), so what
was generated is kept, sent to the agent or not, and each token keeps the policy version that made it.
The broken engine is avoided for ``reconnect_s``. A second loss in the same generation fails it: a
request that brings engines down must not take the whole fleet with it.

Pausing (the colocated schedule): while the engines give their devices to the trainer, :meth:`Router.pause`
makes new calls wait here, in the gateway, instead of at an engine that may have released its memory;
:meth:`Router.resume` lets them go on the new weights. A call waits at most ``wait_timeout_s``.
A generation the engines abort *because of* the pause (``pause_generation(mode="abort")``, partial rollout)
is not returned to the agent: once generation resumes it is re-issued as prompt + tokens so far, and the
parts are concatenated, each token keeping the policy version that generated it.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import time
from typing import Any, Awaitable, Callable, Mapping, Optional, Sequence

import numpy as np

from rayrl.engines import wire_json
from rayrl.engines.client import EngineClient, EngineError, EngineUnavailable, GenerateOutput, error_message
from rayrl.engines.outputs import join_parts
from rayrl.engines.stream_fold import StreamFold
from rayrl.engines.stream_http import StreamHTTPError, StreamingHTTP

# on_text(text so far, output ids so far, their log-probs): streaming callers can emit each chunk's
# log-probs with the chunk
OnText = Callable[[str, list[int], list[float]], Awaitable[None]]

logger = logging.getLogger(__name__)

MAX_LOST_CONTINUATIONS = 1  # continuations of one generation after its engine died under it
_MAX_RANKINGS = 65536  # sessions whose engine ranking is kept


def _after_parts(parts: Sequence[GenerateOutput], on_text: OnText) -> OnText:
    """``on_text`` for a continued generation: what the parts before this one generated comes first."""
    text = "".join(p.text for p in parts)
    ids = [int(t) for p in parts for t in p.output_ids]
    lps = [float(x) for p in parts for x in p.output_logprobs]

    async def forward(part_text: str, part_ids: list[int], part_lps: list[float]) -> None:
        await on_text(text + part_text, ids + part_ids, lps + part_lps)

    return forward


def _sse_data(block: bytes, rest: bytes) -> tuple[list[bytes], bytes]:
    """The ``data:`` payloads of the complete lines in ``rest + block``, and the incomplete line left over.
    A server-sent event stream is read as the bytes arrive, not line by line: its chunks often come several
    to a read. (A plain function, not an async generator: one left unfinished would cost a thread-safe wakeup
    of the event loop when it is collected.)"""
    lines = (rest + block).split(b"\n")
    rest = lines.pop()
    return [line[5:].strip() for line in lines if line.startswith(b"data:")], rest


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
        lora_path: Optional[str] = None,
    ) -> None:
        """``lora_path``: every generation names this LoRA adapter (trainer.lora: the policy is the adapter
        the engines loaded under that name, rayrl/weights/adapter.py)."""
        self.timeout_s = timeout_s
        self.lora_path = lora_path
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self.wait_timeout_s = wait_timeout_s
        self.reconnect_s = reconnect_s
        self._clients: dict[str, EngineClient] = {}
        self._in_flight: dict[str, int] = {}
        self._retired: list[EngineClient] = []
        self._stream_http: Optional[StreamingHTTP] = None  # the /generate streams (stream_http.py)
        self._paused = False
        self._resumed: Optional[asyncio.Event] = None
        self._engine_added: Optional[asyncio.Event] = None  # set by add(); calls wait on it with no engines
        self._avoid: dict[str, float] = {}  # url -> loop time until which it is skipped (it broke or refused)
        self._rankings: dict[str, list[str]] = {}  # session key -> ranking, while the set of engines holds
        self.waiting = 0  # calls queued here while paused (the gateway queue depth)
        self.routed = {"affinity": 0, "load_fallback": 0, "retried": 0, "reconnect_waits": 0, "lost_continued": 0,
                       "engine_waits": 0}
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
            self._rankings.clear()
            self._in_flight[url] = 0
        self._avoid.pop(url, None)
        if self._engine_added is not None:
            self._engine_added.set()
            self._engine_added = None
        return self._clients[url]

    def remove(self, url: str) -> None:
        """Stop routing new requests to ``url``; requests already there finish normally."""
        client = self._clients.pop(url.rstrip("/"), None)
        self._rankings.clear()
        self._in_flight.pop(url.rstrip("/"), None)
        self._avoid.pop(url.rstrip("/"), None)
        if client is not None:
            self._retired.append(client)

    def set_engines(self, urls: Sequence[str]) -> None:
        """Route to exactly ``urls`` from now on (add the new, remove the gone)."""
        wanted = {u.rstrip("/") for u in urls}
        for url in list(self._clients):
            if url not in wanted:
                self.remove(url)
        for url in urls:
            self.add(url)

    async def wait_for_engines(self) -> None:
        """Return once at least one engine is routed to; EngineUnavailable after ``wait_timeout_s``."""
        if self._clients:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_timeout_s
        self.routed["engine_waits"] += 1
        self.waiting += 1
        try:
            while not self._clients:
                if self._engine_added is None:
                    self._engine_added = asyncio.Event()
                await asyncio.wait_for(self._engine_added.wait(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"no engine to route to for {self.wait_timeout_s:.0f} s") from None
        finally:
            self.waiting -= 1

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
        """Engines in this session's rendezvous order (first = preferred); kept per session until an engine
        is added or removed (a session's calls hash the same URLs every time)."""
        order = self._rankings.get(session_key)
        if order is None:
            if len(self._rankings) >= _MAX_RANKINGS:
                self._rankings.clear()
            order = sorted(self._clients, key=lambda url: _score(url, session_key), reverse=True)
            self._rankings[session_key] = order
        return order

    def pick(self, session_key: Optional[str], exclude: Sequence[str] = ()) -> str:
        """The engine for the next request of ``session_key`` (None: least loaded)."""
        if len(self._clients) == 1 and not exclude:  # every call's path on a one-engine gateway
            url = next(iter(self._clients))
            if session_key is not None:
                self.routed["affinity"] += 1
            return url
        candidates = [u for u in self._clients if u not in exclude]
        if not candidates:
            raise EngineUnavailable("no engine servers to route to")
        if self._avoid:
            now = time.monotonic()
            healthy = [u for u in candidates if self._avoid.get(u, 0.0) <= now]
            candidates = healthy or candidates
        in_flight = self._in_flight
        least = min(candidates, key=in_flight.__getitem__)
        if session_key is None:
            return least
        preferred = least
        for url in self.ranking(session_key):
            if url in candidates:
                preferred = url
                break
        busy, idle = in_flight[preferred], in_flight[least]
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
        on_text: Optional[OnText] = None,
    ) -> GenerateOutput:
        """Generate on the engine chosen for ``session_key``, always over SGLang's streaming ``/generate``
        (whether or not the caller streams), so the tokens received so far are known at every moment: a
        generation whose engine dies is continued from all of them (see the module docstring).
        ``on_text``, when given, gets the cumulative text, ids and log-probs after every chunk. When the
        engine cannot even be connected to (so nothing ran there), retry once on another engine; other
        failures propagate. Waits while paused; a generation aborted by a pause is continued after it."""
        return await self._generate_parts(session_key, input_ids, sampling_params, rid, on_text)

    async def generate_stream(
        self,
        session_key: Optional[str],
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Optional[Mapping[str, Any]],
        on_text: OnText,
    ) -> GenerateOutput:
        """:meth:`generate` for a streaming caller: ``on_text`` gets the cumulative text after every chunk.
        A stream that ends without finishing (client gone, engine broken) is aborted on its engine so it
        never keeps a batch slot busy."""
        return await self._generate_parts(session_key, input_ids, sampling_params, None, on_text)

    async def _routed(
        self, session_key: Optional[str], call: Callable[[str], Awaitable[GenerateOutput]]
    ) -> GenerateOutput:
        """``call(url)`` on the engine picked for the session, counted in flight. With no engine routed to,
        wait for one. When the engine could not even be connected to (nothing ran there): once on another
        engine; with no other engine, again every 0.25 s for ``reconnect_s`` (an engine being replaced:
        the pipeline removes its URL, and the call then waits for an engine to be added). An engine that
        broke or refused is avoided for ``reconnect_s``."""
        tried: list[str] = []
        refused_since: Optional[float] = None
        loop = asyncio.get_running_loop()
        while True:
            if self._paused and await self.wait_until_resumed():
                refused_since = None  # the pause was the wait: a fresh window after it
            if not self._clients:
                await self.wait_for_engines()
            exclude = [u for u in tried if u in self._clients and len(self._clients) > 1] if tried else ()
            url = self.pick(session_key, exclude=exclude)
            self._in_flight[url] += 1
            try:
                return await call(url)
            except EngineUnavailable as err:
                if err.connect_failed or err.connection_lost:
                    self._avoid[url] = time.monotonic() + self.reconnect_s
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
        session_key: Optional[str],
        input_ids: Sequence[int] | np.ndarray,
        sampling_params: Optional[Mapping[str, Any]],
        rid: Optional[str],
        on_text: Optional[OnText],
    ) -> GenerateOutput:
        """Run a generation; while the engines abort it for a pause, or once if its engine died under it,
        continue it from the tokens so far (see the module docstring)."""
        prompt = np.asarray(input_ids, dtype=np.int32)
        params = dict(sampling_params or {})
        budget = params.get("max_new_tokens")
        parts: list[GenerateOutput] = []
        lost = 0
        while True:
            done = sum(len(p.output_ids) for p in parts)
            ids = np.concatenate([prompt, *[p.output_ids for p in parts]]).astype(np.int32) if parts else prompt
            rest = dict(params)
            if budget is not None and parts:
                rest["max_new_tokens"] = int(budget) - done
            if rid is None:
                part_rid = os.urandom(16).hex()  # a uuid4 hex, without building a UUID
            else:
                part_rid = rid if not parts and not lost else f"{rid}-c{len(parts) + lost}"
            forward = _after_parts(parts, on_text) if on_text is not None and parts else on_text
            pauses = self.pause_stats["pauses"]
            try:
                out = await self._routed(session_key, functools.partial(self._stream_on, input_ids=ids, params=rest,
                                                                        rid=part_rid, on_text=forward))
            except EngineUnavailable as err:
                if not err.connection_lost or lost >= MAX_LOST_CONTINUATIONS:
                    raise
                lost += 1
                self.routed["lost_continued"] += 1
                partial = err.partial
                if partial is not None and len(partial.output_ids):
                    parts.append(partial)
                logger.warning("engine %s died during a generation (%s); continuing it on another engine after "
                               "%d tokens", err.url, err.message, sum(len(p.output_ids) for p in parts))
                continue
            parts.append(out)
            if not self._aborted_by_pause(out, pauses):
                break
            if budget is not None and sum(len(p.output_ids) for p in parts) >= int(budget):
                break
            self.pause_stats["continued"] += 1
        return join_parts(parts) if len(parts) > 1 else parts[0]

    def _http(self) -> StreamingHTTP:
        if self._stream_http is None:
            self._stream_http = StreamingHTTP(read_timeout_s=self.timeout_s)
        return self._stream_http

    async def _stream_on(
        self, url: str, input_ids: np.ndarray, params: Mapping[str, Any], rid: str, on_text: Optional[OnText]
    ) -> GenerateOutput:
        """One part of a generation, streamed from the engine at ``url``. A broken stream raises
        EngineUnavailable with the tokens received so far (``partial``); an unfinished one is aborted."""
        payload = {
            "input_ids": np.ascontiguousarray(input_ids),  # encoded straight from the array (wire_json)
            "sampling_params": params,  # the part's own copy (_generate_parts)
            "rid": rid,
            "return_logprob": True,
            "stream": True,
        }
        if self.lora_path is not None:
            payload["lora_path"] = self.lora_path
        stream = StreamFold(url)
        try:
            try:
                hold = 1 if on_text is not None else stream.hold_bytes  # not streamed: woken once per bound
                async with self._http().post(url, "/generate", wire_json.dumps(payload), hold) as resp:
                    if resp.status >= 300:
                        raise EngineError(resp.status, error_message(await resp.read()), url)
                    rest, done = b"", False
                    while (block := await resp.next_block(hold)) is not None:
                        if done:
                            continue  # read to the body's end, so the connection can be reused
                        events, rest = _sse_data(block, rest)
                        if on_text is None:
                            done = stream.feed(events)  # parses only what the answer needs (stream_fold)
                            continue
                        for data in events:
                            if data == b"[DONE]":
                                done = True
                                break
                            stream.fold(data)
                            acc = stream.acc
                            await on_text(acc.text, acc.ids, acc.logprobs)
            except StreamHTTPError:
                stream.settle()  # the chunks received before the stream broke: the tokens so far
                raise
            stream.settle()
            if not stream.finished:
                raise EngineUnavailable("the engine stream ended before the request finished", url,
                                        connection_lost=True, partial=stream.acc.partial(url))
            return stream.acc.output(url)
        except StreamHTTPError as err:
            if err.connect_failed:
                raise EngineUnavailable(str(err), url, connect_failed=True) from None
            if stream.finished:  # the last chunk had arrived: only the end of the stream was lost
                return stream.acc.output(url)
            if err.timed_out:
                raise EngineUnavailable(f"no answer from /generate: {err}", url) from None
            raise EngineUnavailable(str(err), url, connection_lost=True, partial=stream.acc.partial(url)) from None
        finally:
            if not stream.finished:
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
