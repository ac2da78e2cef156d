"""A local S3 for tests: the `moto` server as a real process on loopback, reached with boto3 as if it were S3.

It is a fake in the sense the project allows (AWS cannot run here): it speaks S3's real HTTP protocol, so
the code under test uses plain boto3 with ``AWS_ENDPOINT_URL_S3`` pointing at it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from rayrl.ports import free_port
from rayrl.processes import stop_process

S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextmanager
def moto_s3_server(log_path: Path) -> Iterator[str]:
    """Start ``moto_server`` on a free loopback port; yields its URL; stops exactly that process."""
    port = free_port()
    moto = Path(sys.executable).parent / "moto_server"
    with log_path.open("w") as log:
        proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, **S3_TEST_ENV})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
                break
            except OSError as err:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log_path.read_text()[-2000:]}") from err
                time.sleep(0.2)
        yield url
    finally:
        stop_process(proc)
