"""Reads the records of an offline wandb run file (``run-*.wandb``), to check what a run logged.

The file is wandb's transaction log: a 7-byte header (``:W&B``, magic, version), then 32 KiB blocks of
LevelDB-log records (crc32 4 bytes, length 2, type 1: full/first/middle/last) whose payloads are
``wandb_internal_pb2.Record`` protobufs.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    assert data[:4] == b":W&B", "not a wandb run file"
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):
            break  # a record still being written
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
        else:
            break  # zero padding at the end of the file


def history_rows(path: Path) -> list[dict[str, Any]]:
    """Every ``wandb.log`` row in the file, decoded."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for payload in _payloads(path.read_bytes()):
        record = pb.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows
