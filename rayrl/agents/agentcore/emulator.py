"""A FAKE AgentCore Runtime data plane for local runs and tests (the real one is an AWS service).

It speaks the wire protocol boto3's ``bedrock-agentcore`` client sends, so the launcher's code path is
unchanged: point the client at it with ``endpoint_url``.

- ``POST /runtimes/{agentRuntimeArn}/invocations`` (header ``X-Amzn-Bedrock-AgentCore-Runtime-Session-Id``,
  body = payload) is forwarded to the agent app's ``POST /invocations`` with the session header, and the
  agent's reply comes back as the streaming ``response`` blob.
- ``POST /runtimes/{agentRuntimeArn}/stopruntimesession`` is acknowledged and recorded.
- Errors use the rest-json shape botocore parses (``x-amzn-ErrorType`` header, ``{"message"}`` body):
  unknown runtime 404 ResourceNotFoundException, bad session id 400 ValidationException, the agent
  answering 4xx/5xx 424 RuntimeClientError.

It never starts microVMs: every session goes to the one agent app process. For tests it can play the
service's limits: ``tps_limit`` (a sliding one-second quota answered with 429 ThrottlingException) and
``throttle_first`` / ``error_first`` (the first N attempts of every session get 429 / 500). Every request
is recorded (arrival time, session id, status) and listed by ``GET /_fake/requests``.

    python -m rayrl.agents.agentcore.emulator --agent-url http://127.0.0.1:8080 --runtime-arn ARN --port 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web

SESSION_HEADER = "X-Amzn-Bedrock-AgentCore-Runtime-Session-Id"
_SESSION_ID = re.compile(r"^[A-Za-z0-9_\-.:]{33,256}$")
DEFAULT_LOCAL_ARN = "arn:aws:bedrock-agentcore:us-west-2:000000000000:runtime/rayrl_local_agent-fake00000"


@dataclass
class Faults:
    """Service behaviour to play: a request quota and scripted failures per session."""

    tps_limit: float = 0.0  # >0: more requests than this in any second get 429 ThrottlingException
    throttle_first: int = 0  # the first N attempts of every session get 429
    error_first: int = 0  # then the next N attempts of every session get 500


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"message": message}, status=status, headers={"x-amzn-ErrorType": code})


class FakeAgentCoreRuntime:
    """The emulator app; ``start()`` binds it, ``requests`` is what it saw."""

    def __init__(
        self, agent_url: str, runtime_arn: str = DEFAULT_LOCAL_ARN, faults: Faults | None = None
    ) -> None:
        self.agent_url = agent_url.rstrip("/")
        self.runtime_arn = runtime_arn
        self.faults = faults or Faults()
        self.requests: list[dict[str, Any]] = []
        self.stopped_sessions: list[str] = []
        self._attempts: Counter = Counter()
        self._window: deque[float] = deque()
        self._client: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_post(r"/runtimes/{arn:.+}/invocations", self._invoke)
        self.app.router.add_post(r"/runtimes/{arn:.+}/stopruntimesession", self._stop)
        self.app.router.add_get("/ping", self._ping)
        self.app.router.add_get("/_fake/requests", self._list)

    # -- checks shared by both operations ----------------------------------------------------------

    def _check(self, request: web.Request) -> tuple[str, web.Response | None]:
        arn = unquote(request.match_info["arn"])
        session_id = request.headers.get(SESSION_HEADER, "")
        if arn != self.runtime_arn:
            return session_id, _error(404, "ResourceNotFoundException", f"no agent runtime {arn}")
        if not _SESSION_ID.match(session_id):
            return session_id, _error(400, "ValidationException",
                                      f"{SESSION_HEADER} must be 33-256 characters, got {len(session_id)}")
        return session_id, None

    def _over_quota(self, now: float) -> bool:
        limit = self.faults.tps_limit
        if limit <= 0:
            return False
        while self._window and self._window[0] <= now - 1.0:
            self._window.popleft()
        if len(self._window) >= max(1, int(limit)):
            return True
        self._window.append(now)
        return False

    # -- routes -----------------------------------------------------------------------------------

    async def _invoke(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        session_id, problem = self._check(request)
        record = {"t": now, "wall": time.time(), "session_id": session_id, "op": "invoke"}
        self.requests.append(record)
        if problem is not None:
            record["status"] = problem.status
            return problem
        self._attempts[session_id] += 1
        attempt = self._attempts[session_id]
        if attempt <= self.faults.throttle_first or self._over_quota(now):
            record["status"] = 429
            return _error(429, "ThrottlingException", "Rate exceeded")
        if attempt <= self.faults.throttle_first + self.faults.error_first:
            record["status"] = 500
            return _error(500, "InternalServerException", "injected failure")
        body = await request.read()
        assert self._client is not None
        headers = {"Content-Type": "application/json", SESSION_HEADER: session_id}
        try:
            async with self._client.post(f"{self.agent_url}/invocations", data=body, headers=headers) as resp:
                reply = await resp.read()
                status = resp.status
                content_type = resp.headers.get("Content-Type", "application/json")
        except aiohttp.ClientError as err:
            record["status"] = 502
            return _error(502, "InternalServerException", f"agent app unreachable: {err}")
        if status >= 400:
            record["status"] = 424
            detail = reply[:500].decode(errors="replace")
            return _error(424, "RuntimeClientError", f"agent answered {status}: {detail}")
        record["status"] = 200
        return web.Response(body=reply, status=200,
                            headers={"Content-Type": content_type, SESSION_HEADER: session_id})

    async def _stop(self, request: web.Request) -> web.Response:
        session_id, problem = self._check(request)
        self.requests.append({"t": time.monotonic(), "wall": time.time(), "session_id": session_id,
                              "op": "stop", "status": problem.status if problem else 200})
        if problem is not None:
            return problem
        self.stopped_sessions.append(session_id)
        return web.json_response({}, headers={SESSION_HEADER: session_id})

    async def _ping(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "Healthy"})

    async def _list(self, request: web.Request) -> web.Response:
        return web.json_response({"requests": self.requests, "stopped_sessions": self.stopped_sessions})

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{bound[0]}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()


async def _serve(args: argparse.Namespace) -> None:
    fake = FakeAgentCoreRuntime(args.agent_url, args.runtime_arn,
                                Faults(args.tps_limit, args.throttle_first, args.error_first))
    url = await fake.start(args.host, args.port)
    print(json.dumps({"url": url}), flush=True)  # the parent reads the bound address from this line
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Local AgentCore Runtime emulator (a fake; see module doc)")
    parser.add_argument("--agent-url", required=True, help="the agent app, e.g. http://127.0.0.1:8080")
    parser.add_argument("--runtime-arn", default=DEFAULT_LOCAL_ARN)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tps-limit", type=float, default=0.0)
    parser.add_argument("--throttle-first", type=int, default=0)
    parser.add_argument("--error-first", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
