"""Disk-delta weight updates: publish only the bytes that changed; verify everything before applying.

The trainer keeps a byte snapshot of the weights the engines hold and, per update,
publishes ``ROOT/v{version:06d}/`` with each changed tensor's delta (``xor`` by
default, or the idempotent ``overwrite``), zstd-compressed, and an ``index.json``
written last. Every engine host reads it with :func:`read_delta`, which checks the
base version, the base bytes, every payload and the digest of every resulting
tensor before it returns the new tensors; a delta that fails any check is refused
with a :class:`DeltaError` naming the version directory, file and tensor.

Trainer::

    writer = DeltaWriter("/shared/deltas")          # encoding="xor", level=1, digest="xxh3_128", keep=3
    writer.seed(model_state(), version=0)           # what every engine loaded
    stats = writer.publish(model_state(), version=1)

Engine host::

    new = read_delta("/shared/deltas", 1, current=params, current_version=0)
    swap_in(new)                                    # only the changed tensors; params untouched until now

The format (the index, the encodings, the guarantees) is described in
``docs/disk-delta.md`` and in :mod:`miles_transports.weight_delta.index` and
:mod:`miles_transports.weight_delta.codec`. Needs numpy, torch, zstandard and xxhash.
"""

from miles_transports.weight_delta.codec import DIGESTS, ENCODINGS, DeltaError
from miles_transports.weight_delta.index import INDEX_NAME, DeltaIndex, Payload, TensorEntry
from miles_transports.weight_delta.store import (
    DeltaWriter,
    PublishStats,
    published_versions,
    read_delta,
    read_index,
    version_dir,
)

__all__ = [
    "DIGESTS",
    "ENCODINGS",
    "INDEX_NAME",
    "DeltaError",
    "DeltaIndex",
    "DeltaWriter",
    "Payload",
    "PublishStats",
    "TensorEntry",
    "published_versions",
    "read_delta",
    "read_index",
    "version_dir",
]
