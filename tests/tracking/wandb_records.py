"""Read the records of an offline W&B run file (``run-<id>.wandb``), to check what a tracker logged.

The file is a LevelDB-style log (the format W&B documents for its transaction log): a 7-byte
header (``:W&B``, a 2-byte magic, a version byte), then 32 KiB blocks of chunks, each chunk a
7-byte header (crc32, little-endian length, type: 1 whole, 2 first, 3 middle, 4 last) and a
piece of one protobuf ``Record``.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator
from typing import Any

BLOCK = 32768
FULL, FIRST, LAST = 1, 2, 4


def records(path: str) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        buf = chunk if kind in (FULL, FIRST) else buf + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def history(path: str) -> list[dict[str, str]]:
    """Each ``run.log`` row of the file: key -> JSON text of the value."""
    return [
        {item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
        for r in records(path)
        if r.WhichOneof("record_type") == "history"
    ]


def run_ids(path: str) -> list[str]:
    return [r.run.run_id for r in records(path) if r.WhichOneof("record_type") == "run"]


def wait_for_exit(path: str, timeout: float = 20.0) -> None:
    """W&B's service process may still be writing the file when ``finish`` returns: wait for its
    closing ``exit`` record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.WhichOneof("record_type") == "exit" for r in records(path)):
            return
        time.sleep(0.1)
    raise AssertionError(f"{path} has no exit record after {timeout} s")
