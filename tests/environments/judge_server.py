"""A judge endpoint for the tests: a real HTTP server on loopback speaking OpenAI Chat Completions, whose
replies, failures and delays the test decides; it records every request and how many were in flight at once.
(A frozen model would answer the same protocol; what is under test is rayrl's side of it.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Callable

from aiohttp import web

from rayrl.ports import free_port


class JudgeServer:
    def __init__(self, reply: Callable[[str], str] = lambda prompt: "yes") -> None:
        self.reply = reply
        self.fail_first = 0  # answer this many requests with fail_status first
        self.fail_status = 503
        self.delay_s = 0.0
        self.requests: list[dict[str, Any]] = []
        self.in_flight = self.max_in_flight = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/v1"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({**body, "authorization": request.headers.get("Authorization", "")})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if len(self.requests) <= self.fail_first:
                return web.json_response({"error": {"message": "judge overloaded", "type": "server_error"}},
                                         status=self.fail_status)
            prompt = "\n".join(str(m.get("content", "")) for m in body["messages"])
            text = self.reply(prompt)
            return web.json_response({
                "id": "j", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": len(text.split()),
                          "total_tokens": len(prompt.split()) + len(text.split())}})
        finally:
            self.in_flight -= 1

    @staticmethod
    def last_prompt(request: dict[str, Any]) -> str:
        return json.dumps(request["messages"])
