"""The rollout executor as AgentCore sees it: /ping, /invocations, one result per session in S3."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid

from _agentcore_kit import BUCKET

from rayrl.agents.agentcore.emulator import SESSION_HEADER
from rayrl.agents.agentcore.executor import RolloutContext, _normalise
from rayrl.agents.agentcore.protocol import ROLLOUT_CONFIG_KEY, AgentRolloutConfig, result_key


def post(url: str, body: bytes, session_id: str = "") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", SESSION_HEADER: session_id})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ping(url: str) -> str:
    with urllib.request.urlopen(f"{url}/ping", timeout=10) as resp:
        return json.load(resp)["status"]


def payload(behaviour: str, **extra) -> tuple[dict, str, str]:
    sid = f"s0-{uuid.uuid4().hex}"
    key = result_key("exec", "exp", "t", sid)
    rollout = AgentRolloutConfig(base_url="http://127.0.0.1:9/v1", api_key="k", model="m", exp_id="exp",
                            session_id=sid, s3_bucket=BUCKET, result_key=key, timeout_s=20)
    return {"behaviour": behaviour, **extra, ROLLOUT_CONFIG_KEY: rollout.to_dict()}, sid, key


def wait_object(s3, key: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return json.loads(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        except s3.exceptions.NoSuchKey:
            time.sleep(0.1)
    raise TimeoutError(key)


def test_invocation_answers_at_once_and_ping_is_busy_until_the_result(agent_app, s3_client):
    body, sid, key = payload("sleep", seconds=1.5, group="ping")
    status, reply = post(f"{agent_app}/invocations", json.dumps(body).encode(), sid)
    assert status == 200 and reply == {"status": "processing", "session_id": sid, "s3_bucket": BUCKET,
                                       "result_key": key}
    assert ping(agent_app) == "HealthyBusy"  # AgentCore keeps a busy session alive
    result = wait_object(s3_client, key)
    assert result["status"] == "completed" and result["final_answer"] == "slept"
    assert set(result["timings"]) == {"agent_s", "started_at", "finished_at"}
    deadline = time.monotonic() + 10
    while ping(agent_app) != "Healthy" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ping(agent_app) == "Healthy"


def test_bad_input_gets_4xx_with_a_json_body(agent_app):
    status, reply = post(f"{agent_app}/invocations", b"{not json")
    assert status == 400 and "error" in reply
    status, reply = post(f"{agent_app}/invocations", json.dumps({"prompt": "no rollout_config"}).encode())
    assert status == 400 and "rollout_config" in reply["details"]
    status, reply = post(f"{agent_app}/invocations", json.dumps([1, 2]).encode())
    assert status == 400
    body, sid, _ = payload("echo")
    body[ROLLOUT_CONFIG_KEY]["max_turns"] = "many"
    status, reply = post(f"{agent_app}/invocations", json.dumps(body).encode(), sid)
    assert status == 400 and "max_turns" in reply["details"]


def test_one_rollout_per_session(agent_app, s3_client):
    body, sid, key = payload("echo", answer=1)
    assert post(f"{agent_app}/invocations", json.dumps(body).encode(), sid)[0] == 200
    status, reply = post(f"{agent_app}/invocations", json.dumps(body).encode(), sid)
    assert status == 409 and sid in reply["error"]
    assert wait_object(s3_client, key)["final_answer"] == "1"


def test_return_values_normalise_to_result_fields():
    assert _normalise("7") == {"status": "completed", "final_answer": "7"}
    assert _normalise(None) == {"status": "completed", "final_answer": None}
    assert _normalise(12) == {"status": "completed", "final_answer": "12"}
    out = _normalise({"final_answer": 5, "rewards": [0, 1], "turns": 2})
    assert out == {"status": "completed", "final_answer": "5", "rewards": [0, 1], "info": {"turns": 2}}
    assert _normalise({"status": "weird"})["status"] == "failed"
    failed = _normalise({"status": "failed", "error": "tool broke"})
    assert failed["status"] == "failed" and failed["error"] == "tool broke"


def test_rollout_context_client_targets_the_gateway():
    ctx = RolloutContext(base_url="http://127.0.0.1:1234/v1", api_key="tok", model="m", exp_id="e",
                         session_id="s", deadline=time.monotonic() + 30)
    client = ctx.openai_client()
    try:
        assert str(client.base_url).rstrip("/") == "http://127.0.0.1:1234/v1" and client.api_key == "tok"
        assert client.max_retries == 0  # a retried LLM call would be recorded as a second turn
    finally:
        client.close()
