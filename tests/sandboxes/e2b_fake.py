"""FakeE2B: a local FAKE of e2b.dev for tests: the control-plane REST API and envd, on the real wire.

There is no e2b API key here, so E2BSandbox is tested against this fake through the real ``e2b`` SDK,
pointed at it with the SDK's own settings (``E2B_API_URL``, ``E2B_SANDBOX_URL``, ``E2B_HTTP_VERSION=1.1``).
What it speaks, as the SDK expects:

- REST (JSON): ``POST /v2/sandboxes`` (201, ``sandboxID``/``envdVersion``/``envdAccessToken``),
  ``POST /v2/sandboxes/{id}/connect``, ``DELETE /sandboxes/{id}`` (204, 404 when unknown); the API key
  in ``X-API-Key`` is required (401 otherwise).
- envd process API: Connect RPC ``/process.Process/Start`` (server streaming, protobuf), served by the
  ``ProcessASGIApplication`` generated in the SDK from envd's own proto, so framing, codecs, errors and
  deadlines (``connect-timeout-ms``) are the real protocol. Like envd: a missing cwd is
  INVALID_ARGUMENT; when the deadline passes or the client goes away the process is SIGKILLed.
- envd file API: ``GET /files?path=`` (raw bytes, 404 JSON when missing) and ``POST /files?path=``
  (multipart upload, JSON list of written entries); ``X-Access-Token`` is required on envd calls.

Each fake sandbox is a host directory shown to its commands at ``/home/user`` (bubblewrap: the host's
root is visible, /home is replaced), so commands and paths look as they do in an e2b sandbox. This is
test scaffolding, not isolation.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.process import process_connect, process_pb
from protobuf import Oneof
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ENVD_VERSION = "0.6.4"
HOME = "/home/user"
ENVD_PORT = "49983"


@dataclass
class FakeSandbox:
    sandbox_id: str
    template: str
    root: str  # host directory shown at /home/user
    token: str
    procs: set = field(default_factory=set)

    def host_path(self, path: str) -> str | None:
        """The host path of a sandbox path under /home/user, or None (the fake serves nothing else)."""
        norm = os.path.normpath(path)
        if norm != HOME and not norm.startswith(HOME + "/"):
            return None
        return os.path.join(self.root, os.path.relpath(norm, HOME))


class FakeE2B:
    """Run with ``with FakeE2B() as fake:``; ``fake.env`` holds the SDK settings that point at it."""

    def __init__(self, api_key: str = "e2b_fake_" + secrets.token_hex(8)) -> None:
        self.api_key = api_key
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.killed: list[str] = []
        self.create_requests: list[dict] = []
        self._base = tempfile.mkdtemp(prefix="rayrl-fake-e2b-")
        self._bwrap = shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    # ----------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> "FakeE2B":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self._asgi, log_level="warning", lifespan="off", interface="asgi3")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake e2b server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        for sb in list(self.sandboxes.values()):
            self._kill(sb)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        shutil.rmtree(self._base, ignore_errors=True)

    @property
    def env(self) -> dict[str, str]:
        return {"E2B_API_KEY": self.api_key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url,
                "E2B_HTTP_VERSION": "1.1", "E2B_DOMAIN": "fake.e2b.invalid"}

    # --------------------------------------------------------------------------------- HTTP routing
    def _build(self) -> None:
        rest = Starlette(routes=[
            Route("/v2/sandboxes", self._create, methods=["POST"]),
            Route("/v2/sandboxes/{sandbox_id}/connect", self._connect, methods=["POST"]),
            Route("/sandboxes/{sandbox_id}", self._delete, methods=["DELETE"]),
            Route("/files", self._files, methods=["GET", "POST"]),
            Route("/health", lambda request: Response(status_code=204), methods=["GET"]),
        ])
        self._rest = rest
        self._rpc = process_connect.ProcessASGIApplication(_ProcessService(self))

    async def _asgi(self, scope, receive, send) -> None:
        if not hasattr(self, "_rest"):
            self._build()
        if scope["type"] == "http" and scope["path"].startswith("/process.Process/"):
            await self._rpc(scope, receive, send)
        else:
            await self._rest(scope, receive, send)

    # --------------------------------------------------------------------------------------- REST
    def _authorised(self, request: Request) -> bool:
        return request.headers.get("x-api-key") == self.api_key

    @staticmethod
    def _error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"code": status, "message": message}, status_code=status)

    def _describe(self, sb: FakeSandbox) -> dict:
        return {"templateID": sb.template, "sandboxID": sb.sandbox_id, "clientID": "fake-client",
                "envdVersion": ENVD_VERSION, "envdAccessToken": sb.token}

    async def _create(self, request: Request) -> Response:
        if not self._authorised(request):
            return self._error(401, "Invalid API key")
        body = json.loads(await request.body() or b"{}")
        self.create_requests.append(body)
        sandbox_id = "i" + secrets.token_hex(9)
        root = os.path.join(self._base, sandbox_id)
        os.makedirs(root)
        sb = FakeSandbox(sandbox_id, body.get("templateID", "base"), root, secrets.token_hex(16))
        self.sandboxes[sandbox_id] = sb
        return JSONResponse(self._describe(sb), status_code=201)

    async def _connect(self, request: Request) -> Response:
        if not self._authorised(request):
            return self._error(401, "Invalid API key")
        sb = self.sandboxes.get(request.path_params["sandbox_id"])
        if sb is None:
            return self._error(404, f"sandbox {request.path_params['sandbox_id']} not found")
        return JSONResponse(self._describe(sb), status_code=200)

    async def _delete(self, request: Request) -> Response:
        if not self._authorised(request):
            return self._error(401, "Invalid API key")
        sb = self.sandboxes.get(request.path_params["sandbox_id"])
        if sb is None:
            return self._error(404, f"sandbox {request.path_params['sandbox_id']} not found")
        self._kill(sb)
        return Response(status_code=204)

    def _kill(self, sb: FakeSandbox) -> None:
        for proc in list(sb.procs):
            _killpg(proc)
        self.sandboxes.pop(sb.sandbox_id, None)
        self.killed.append(sb.sandbox_id)
        shutil.rmtree(sb.root, ignore_errors=True)

    # ---------------------------------------------------------------------------------- envd files
    def sandbox_for(self, headers) -> FakeSandbox | None:
        sb = self.sandboxes.get(headers.get("e2b-sandbox-id", ""))
        if sb is None or headers.get("x-access-token") != sb.token:
            return None
        return sb

    async def _files(self, request: Request) -> Response:
        sb = self.sandbox_for(request.headers)
        if sb is None:
            return self._error(401, "unknown sandbox or bad access token")
        path = request.query_params.get("path", "")
        host = sb.host_path(path)
        if host is None:
            return self._error(400, f"the fake serves only paths under {HOME}, got {path!r}")
        if request.method == "GET":
            if not os.path.isfile(host):
                return self._error(404, f"path '{path}' does not exist")
            with open(host, "rb") as f:
                return Response(f.read(), media_type="application/octet-stream")
        data = _multipart_file(request.headers.get("content-type", ""), await request.body())
        if data is None:
            return self._error(400, "expected a multipart/form-data body with a 'file' field")
        os.makedirs(os.path.dirname(host), exist_ok=True)
        with open(host, "wb") as f:
            f.write(data)
        return JSONResponse([{"name": os.path.basename(path), "type": "file", "path": path}])

    # ------------------------------------------------------------------------------ envd processes
    def command_argv(self, sb: FakeSandbox, cwd: str, argv: list[str]) -> list[str]:
        if self._bwrap is None:
            raise ConnectError(Code.INTERNAL, "the fake needs bubblewrap to show /home/user")
        return [self._bwrap, "--dev-bind", "/", "/", "--tmpfs", "/home", "--bind", sb.root, HOME,
                "--unshare-pid", "--die-with-parent", "--chdir", cwd, "--", *argv]


class _ProcessService(process_connect.Process):
    """The envd ``process.Process`` service: Start (what E2BSandbox uses); the rest answer UNIMPLEMENTED."""

    def __init__(self, fake: FakeE2B) -> None:
        self.fake = fake

    async def start(self, request: process_pb.StartRequest, ctx):
        sb = self.fake.sandbox_for(ctx.request_headers)
        if sb is None:
            raise ConnectError(Code.UNAUTHENTICATED, "unknown sandbox or bad access token")
        config = request.process
        cwd = config.cwd or HOME
        host_cwd = sb.host_path(cwd)
        if host_cwd is None or not os.path.isdir(host_cwd):
            raise ConnectError(Code.INVALID_ARGUMENT, f"cwd '{cwd}' does not exist")
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": HOME,
               "USER": "user", "LOGNAME": "user", **dict(config.envs)}
        timeout_ms = ctx.timeout_ms
        deadline = None if not timeout_ms else time.monotonic() + timeout_ms / 1000
        proc = await asyncio.create_subprocess_exec(
            *self.fake.command_argv(sb, cwd, [config.cmd, *config.args]), env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)
        sb.procs.add(proc)
        Event = process_pb.ProcessEvent
        try:
            yield process_pb.StartResponse(event=Event(event=Oneof("start", Event.StartEvent(pid=proc.pid))))
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(stream, name: str) -> None:
                while chunk := await stream.read(32 << 10):
                    await queue.put((name, chunk))
                await queue.put((name, None))

            pumps = [asyncio.create_task(pump(proc.stdout, "stdout")),
                     asyncio.create_task(pump(proc.stderr, "stderr"))]
            open_streams = 2
            while open_streams:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "deadline exceeded")
                try:
                    name, chunk = await asyncio.wait_for(queue.get(), remaining)
                except asyncio.TimeoutError:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "deadline exceeded") from None
                if chunk is None:
                    open_streams -= 1
                    continue
                data = Event.DataEvent(output=Oneof(name, chunk))
                yield process_pb.StartResponse(event=Event(event=Oneof("data", data)))
            await asyncio.gather(*pumps)
            code = await proc.wait()
            end = Event.EndEvent(exit_code=code if code >= 0 else -1, exited=code >= 0,
                                 status=f"exit status {code}" if code >= 0 else f"signal: {-code}")
            yield process_pb.StartResponse(event=Event(event=Oneof("end", end)))
        finally:
            if proc.returncode is None:  # deadline, client gone or sandbox killed: like envd, kill it
                _killpg(proc)
                await proc.wait()
            sb.procs.discard(proc)


def _multipart_file(content_type: str, body: bytes) -> bytes | None:
    """The bytes of the ``file`` field of a multipart/form-data body (stdlib email parser)."""
    if not content_type.startswith("multipart/form-data"):
        return None
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    for part in message.iter_parts():
        if part.get_param("name", header="content-disposition") == "file":
            return part.get_payload(decode=True)
    return None


def _killpg(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
