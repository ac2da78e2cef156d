"""A scripted engine: a real HTTP server speaking SGLang's /generate, whose answers a script decides.

Why: a random tiny model never writes a tool call and the real SmolLM2 writes one only sometimes, so
protocol tests that need exact tool calls (several in one stream, a CLI's whole tool loop) get their
completions from a script instead. Everything else is real: the gateway renders and tokenizes with
the real tokenizer, the engine answers over loopback HTTP (streaming too) with token ids and
log-probs, and aborts arrive at /abort_request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from aiohttp import web

from rayrl.engines.cpu.requests import engine_error

Script = Callable[[str], str]  # decoded prompt -> completion text
ENGINE_FAILURE = "\x00engine-failure"  # a script returning this makes the engine answer HTTP 500 (its failure)
# a script returning ENGINE_ABORT + text generates that text, then fails the request as the CPU engine
# fails one request alone: finish_reason abort with status_code 500 (rayrl.engines.cpu.requests.engine_error)
ENGINE_ABORT = "\x00engine-abort"


def last_role(prompt: str) -> str:
    """Role of the last message before the generation prompt of a ChatML prompt."""
    head = prompt[: prompt.rfind("<|im_start|>assistant")]
    start = head.rfind("<|im_start|>")
    return head[start + len("<|im_start|>"):].split("\n", 1)[0] if start >= 0 else ""


class ScriptedEngine:
    def __init__(self, tokenizer: Any, script: Script, token_delay_s: float = 0.0) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.token_delay_s = token_delay_s
        self.prompts: list[str] = []
        self.sampling: list[dict[str, Any]] = []  # each request's sampling_params, as the engine got them
        self.aborted: list[str] = []
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort_request", self._abort)
        app.router.add_get("/health", lambda r: web.Response())
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def _chunk(self, ids: list[int], rid: str, prompt_len: int, finish: dict | None) -> dict[str, Any]:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        matched = (finish or {}).get("matched")
        if isinstance(matched, str):  # SGLang trims a matched stop string from the text, not the ids
            text = text[: text.find(matched)]
        return {
            "text": text,
            "output_ids": ids,
            "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_len,
                          "completion_tokens": len(ids), "weight_version": "3",
                          "output_token_logprobs": [[-0.25, i, None] for i in ids]},
        }

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = self.tokenizer.decode(body["input_ids"])
        self.prompts.append(prompt)
        params = body.get("sampling_params") or {}
        self.sampling.append(params)
        completion = self.script(prompt)
        if completion == ENGINE_FAILURE:
            return web.json_response({"object": "error", "message": "scripted engine failure", "type": "Internal",
                                      "param": None, "code": 500}, status=500)
        aborted = completion.startswith(ENGINE_ABORT)
        completion = completion.removeprefix(ENGINE_ABORT)
        ids = self.tokenizer(completion, add_special_tokens=False)["input_ids"] + ([] if aborted else [self.eos])
        limit = int(params.get("max_new_tokens", 128))
        finish = engine_error("engine error: scripted failure") if aborted else {"type": "stop", "matched": self.eos}
        for k in range(1, len(ids) + 1):  # stop strings end generation at the token that completes them
            hit = next((x for x in params.get("stop") or [] if x in self.tokenizer.decode(ids[:k])), None)
            if hit is not None:
                ids, finish = ids[:k], {"type": "stop", "matched": hit}
                break
        if len(ids) > limit:
            ids, finish = ids[:limit], {"type": "length", "length": limit}
        rid = body.get("rid", "r")
        n = len(body["input_ids"])
        if not body.get("stream"):
            return web.json_response(self._chunk(ids, rid, n, finish))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k in range(1, len(ids) + 1):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            chunk = self._chunk(ids[:k], rid, n, finish if k == len(ids) else None)
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.aborted.append(body.get("rid", ""))
        return web.Response()
