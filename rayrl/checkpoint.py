"""Checkpoint storage: a local directory or an S3 prefix, with the same commit protocol for both.

A checkpoint is a directory ``step{N:06d}/`` holding the trainer ranks' files and ``pipeline.json``
(step, policy version, data cursor, pending work). ``pipeline.json`` is always written last, and only a
step whose ``pipeline.json`` exists counts: a run killed in the middle of a save (even with SIGKILL)
leaves an incomplete directory that ``latest()`` ignores, so ``--resume`` never loads half a checkpoint.

On S3 the trainer ranks still write to a local staging directory (torch.save needs a file); the files
are uploaded (:meth:`CheckpointStore.upload`, by one process per node when the ranks span nodes) before
``commit`` puts ``pipeline.json``, so the same marker rule holds for the bucket; restoring downloads a
step into a local directory the same way (:meth:`CheckpointStore.download`). A directory location must be
one every node sees (a shared filesystem) when the ranks span nodes. boto3 reads its usual
configuration (credentials, region, and ``AWS_ENDPOINT_URL_S3`` for S3-compatible stores or a local
``moto`` server).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

MARKER = "pipeline.json"
_STEP_DIR = re.compile(r"^step(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint location that cannot be used (bad URI, missing boto3, unreadable checkpoint)."""


def step_dir_name(step: int) -> str:
    return f"step{step:06d}"


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # no leading or trailing slash; may be empty

    @classmethod
    def parse(cls, uri: str) -> "S3Location":
        if not uri.startswith("s3://"):
            raise CheckpointError(f"not an s3:// URI: {uri!r}")
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not bucket:
            raise CheckpointError(f"s3 URI without a bucket: {uri!r}")
        return cls(bucket, prefix.strip("/"))

    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)


class CheckpointStore:
    """Saves, lists, fetches and prunes checkpoints at ``location`` (a path or ``s3://bucket/prefix``).

    ``keep_last`` > 0 deletes older complete checkpoints after each commit (0 keeps all).
    ``staging_root`` is the local scratch space for S3 (ignored for a local location).
    """

    def __init__(self, location: str | Path, staging_root: str | Path, keep_last: int = 0) -> None:
        self.location = str(location)
        self.keep_last = keep_last
        self.s3: Optional[S3Location] = S3Location.parse(self.location) if self.is_s3(self.location) else None
        self.staging_root = Path(staging_root)
        self._client: Any = None

    @staticmethod
    def is_s3(location: str | Path) -> bool:
        return str(location).startswith("s3://")

    def __repr__(self) -> str:
        return f"CheckpointStore({self.location!r})"

    # -- S3 plumbing -------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import boto3
            except ImportError as err:
                raise CheckpointError(
                    f"checkpoints at {self.location} need boto3: pip install 'rayrl[aws]'"
                ) from err
            self._client = boto3.client("s3")
        return self._client

    def _s3_keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.s3.bucket, Prefix=prefix):
            keys.extend(obj["Key"] for obj in page.get("Contents", []))
        return keys

    def verify(self) -> None:
        """Fail at start-up, not at the first save hours later, when the location is unusable."""
        if self.s3 is None:
            Path(self.location).mkdir(parents=True, exist_ok=True)
            return
        try:
            self.client.head_bucket(Bucket=self.s3.bucket)
        except CheckpointError:
            raise
        except Exception as err:  # botocore ClientError / EndpointConnectionError / NoCredentialsError
            raise CheckpointError(f"checkpoint location {self.location} is not usable: {err}") from err

    # -- the protocol ------------------------------------------------------------------------------

    def staging_dir(self, step: int) -> Path:
        """The local directory the trainer ranks write step ``step`` into (emptied first)."""
        root = self.staging_root if self.s3 else Path(self.location)
        directory = root / step_dir_name(step)
        if directory.exists():
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        return directory

    def upload(self, step: int, directory: str | Path) -> int:
        """Upload every file under ``directory`` into step ``step`` (S3 only; a directory location already
        holds them). Returns how many files went up."""
        if self.s3 is None:
            return 0
        staged = Path(directory)
        files = sorted(p for p in staged.rglob("*") if p.is_file()) if staged.is_dir() else []
        for path in files:
            key = self.s3.key(step_dir_name(step), str(path.relative_to(staged)))
            self.client.upload_file(str(path), self.s3.bucket, key)
        return len(files)

    def commit(self, step: int, state: dict[str, Any], upload_staged: bool = True) -> str:
        """Write ``pipeline.json`` last; returns where the checkpoint lives. On S3 the staged rank files go
        up first unless the ranks uploaded them already (``upload_staged=False``)."""
        payload = json.dumps(state, sort_keys=True)
        if self.s3 is None:
            directory = Path(self.location) / step_dir_name(step)
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / (MARKER + ".tmp")
            tmp.write_text(payload)
            tmp.replace(directory / MARKER)
        else:
            staged = self.staging_root / step_dir_name(step)
            if upload_staged:
                self.upload(step, staged)
            self.client.put_object(Bucket=self.s3.bucket, Key=self.s3.key(step_dir_name(step), MARKER),
                                   Body=payload.encode())
            shutil.rmtree(staged, ignore_errors=True)
        self._prune(step)
        return self.location_of(step)

    def location_of(self, step: int) -> str:
        """Where step ``step``'s checkpoint lives (a path or an s3:// URI), for messages and logs."""
        if self.s3 is None:
            return str(Path(self.location) / step_dir_name(step))
        return f"s3://{self.s3.bucket}/{self.s3.key(step_dir_name(step))}"

    def steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        found: list[int] = []
        if self.s3 is None:
            for marker in Path(self.location).glob(f"step*/{MARKER}"):
                m = _STEP_DIR.match(marker.parent.name)
                if m:
                    found.append(int(m.group(1)))
        else:
            base = self.s3.key() + "/" if self.s3.prefix else ""
            for key in self._s3_keys(base):
                parts = key[len(base):].split("/")
                if len(parts) == 2 and parts[1] == MARKER and (m := _STEP_DIR.match(parts[0])):
                    found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def restore_dir(self, step: int) -> Path:
        """Where step ``step``'s files are read from: the step directory itself, or (S3) the local directory
        :meth:`download` fills."""
        if self.s3 is None:
            return Path(self.location) / step_dir_name(step)
        return self.staging_root / f"restore-{step_dir_name(step)}"

    def download(self, step: int) -> Path:
        """Step ``step``'s files in :meth:`restore_dir` (downloaded from S3; a directory location as is)."""
        directory = self.restore_dir(step)
        if self.s3 is None:
            return directory
        if directory.exists():
            shutil.rmtree(directory)
        base = self.s3.key(step_dir_name(step)) + "/"
        for key in self._s3_keys(base):
            target = directory / key[len(base):]
            target.parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(self.s3.bucket, key, str(target))
        return directory

    def read_state(self, step: int) -> dict[str, Any]:
        """Step ``step``'s ``pipeline.json`` (only that file is read)."""
        try:
            if self.s3 is None:
                return json.loads((self.restore_dir(step) / MARKER).read_text())
            body = self.client.get_object(Bucket=self.s3.bucket, Key=self.s3.key(step_dir_name(step), MARKER))["Body"]
            return json.loads(body.read())
        except Exception as err:  # OSError, bad JSON, botocore's NoSuchKey / ClientError
            raise CheckpointError(f"checkpoint step {step} at {self.location}: cannot read {MARKER}: {err}") from None

    def _prune(self, newest: int) -> None:
        if self.keep_last <= 0:
            return
        for step in self.steps()[: -self.keep_last]:
            if step >= newest:
                continue
            if self.s3 is None:
                directory = Path(self.location) / step_dir_name(step)
                (directory / MARKER).unlink(missing_ok=True)  # not a checkpoint any more, even if rmtree stops
                shutil.rmtree(directory, ignore_errors=True)
            else:
                keys = self._s3_keys(self.s3.key(step_dir_name(step)) + "/")
                marker = [k for k in keys if k.endswith("/" + MARKER)]
                rest = [k for k in keys if k not in marker]
                for chunk in (marker, *[rest[i:i + 1000] for i in range(0, len(rest), 1000)]):
                    if chunk:
                        self.client.delete_objects(Bucket=self.s3.bucket,
                                                   Delete={"Objects": [{"Key": k} for k in chunk]})
            logger.info("checkpoint step %d removed (keep_last=%d)", step, self.keep_last)
