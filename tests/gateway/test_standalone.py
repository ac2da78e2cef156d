"""`python -m rayrl.gateway serve` as a subprocess: admin sessions, an openai SDK call, samples as JSON.

The standalone defaults fit real agents: with no ``--context-length`` the context is the model's own
maximum (here a copy of the tiny model that says 8192, as SmolLM2 does), so a prompt past the old
4096-token default is served, and one past the model's maximum gets the context-length error with the
numbers.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai


def _post(url: str, body: dict, token: str) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_standalone_proxy(tiny_model_dir, tmp_path):
    model = tmp_path / "model-8k"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rayrl.gateway", "serve", "--model", str(model), "--port", str(port),
         "--dtype", "float32"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        admin = None
        deadline = time.monotonic() + 120
        lines = []
        while time.monotonic() < deadline and admin is None:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if line.startswith("admin token: "):
                admin = line.split(": ", 1)[1].strip()
        assert admin, "".join(lines)
        assert "context length 8192" in "".join(lines), "".join(lines)  # the model's own maximum
        root = f"http://127.0.0.1:{port}"
        code, body = _post(f"{root}/rayrl/sessions", {"metadata": {"task": "t1"}}, "wrong")
        assert code == 401 and "error" in body
        code, session = _post(f"{root}/rayrl/sessions", {"metadata": {"task": "t1"}}, admin)
        assert code == 200 and session["base_url"] == f"{root}/v1"
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["token"], max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=8, temperature=0)
        assert 1 <= out.usage.completion_tokens <= 8 and out.choices[0].message.role == "assistant"
        code, done = _post(f"{root}/rayrl/sessions/{session['session_id']}/finish", {"reward": 0.5}, admin)
        assert code == 200 and done["stats"]["turns"] == 1
        sample = done["samples"][0]
        assert sample["reward"] == 0.5 and sample["metadata"]["task"] == "t1"
        response_length = len(sample["tokens"]) - sample["prompt_length"]
        assert len(sample["loss_mask"]) == response_length == out.usage.completion_tokens
        code, other = _post(f"{root}/rayrl/sessions", {}, admin)
        code, long = _post(f"{other['base_url']}/chat/completions", {"max_tokens": 4, "messages": [
            {"role": "user", "content": "word " * 5000}]}, other["token"])
        assert code == 200 and 5000 < long["usage"]["prompt_tokens"] < 8192, long  # past the old 4096 default
        code, over = _post(f"{other['base_url']}/chat/completions", {"messages": [
            {"role": "user", "content": "word " * 9000}]}, other["token"])
        assert code == 400 and over["error"]["code"] == "context_length_exceeded"
        assert "maximum context length is 8192 tokens" in over["error"]["message"]
        code, again = _post(f"{root}/rayrl/sessions/{session['session_id']}/finish", {"reward": 1}, admin)
        assert code == 404 and "error" in again
        code, bad = _post(f"{root}/rayrl/sessions/x/finish", {"reward": "high"}, admin)
        assert code == 400
    finally:
        proc.terminate()
        proc.wait(30)
