"""Real parts for the AgentCore tests: a moto S3 server process, the scripted agent app process, and the
FAKE AgentCore Runtime (emulator) on a background loop, each on loopback.

AWS itself cannot run here; moto speaks S3's real protocol and the emulator speaks AgentCore's, so the
launcher's boto3 code is the production code path.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Iterator

import pytest
from _agentcore_kit import BUCKET, CREDS, REGION, ROOT, aws_env, wait_http

from rayrl.ports import free_port
from rayrl.processes import stop_process

pytest.importorskip("boto3")
pytest.importorskip("moto")
pytest.importorskip("bedrock_agentcore")


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory) -> Iterator[str]:
    """A moto S3 server (a fake that speaks S3's wire protocol) with the result bucket."""
    import boto3

    from tests.s3_server import moto_s3_server

    with moto_s3_server(tmp_path_factory.mktemp("moto") / "moto.log") as url:
        s3 = boto3.client("s3", endpoint_url=url, region_name=REGION, **CREDS)
        s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
        yield url


@pytest.fixture(scope="session")
def agent_app(moto_s3, tmp_path_factory) -> Iterator[str]:
    """tests/agentcore/scripted_agent.py as a real process (the bedrock-agentcore SDK's app)."""
    port = free_port()
    log = open(tmp_path_factory.mktemp("agent") / "agent.log", "wb")
    env = {**aws_env(moto_s3), "PORT": str(port)}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "agentcore" / "scripted_agent.py")],
                            env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/ping", proc)
        yield url
    finally:
        stop_process(proc)
        log.close()


@pytest.fixture
def s3_client(moto_s3):
    import boto3

    return boto3.client("s3", endpoint_url=moto_s3, region_name=REGION, **CREDS)
