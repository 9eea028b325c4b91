"""The index of a published delta (``index.json``): what it holds, and the strict parser a reader uses.

A version directory is complete iff its ``index.json`` exists: the writer writes it
last. Format version 1::

    {
      "format": "miles-weight-delta",
      "format_version": 1,
      "version": 7,                       # this update
      "base_version": 6,                  # the version a reader must hold to apply it
      "encoding": "xor",                  # or "overwrite" (see codec)
      "compression": "zstd",
      "digest": "xxh3_128",               # the hash behind every digest below
      "files": {"data-00000.bin": 123456},   # every data file and its exact size in bytes
      "tensors": {                        # EVERY tensor of the state, changed or not, in publish order
        "model.norm.weight": {"dtype": "bfloat16", "shape": [896], "digest": "<hex>"},
        "model.embed_tokens.weight": {
          "dtype": "bfloat16", "shape": [151936, 896],
          "digest": "<hex>",              # of the tensor's bytes AFTER the update
          "base_digest": "<hex>",         # of the bytes the payload was computed against
          "file": "data-00000.bin", "offset": 0, "length": 4242,   # the compressed payload
          "raw_length": 272269312         # its decompressed length
        }
      }
    }

A tensor with ``file`` is changed; one without is unchanged (and its ``digest`` is
that of the bytes the reader already holds). Parsing checks every field's type and
range, that data file names are plain names, and that each payload lies inside its
file and has the length its encoding implies, so the reader can trust the numbers
before it touches a data file.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_transports.weight_delta.codec import (
    COMPRESSION,
    DTYPES,
    ENCODINGS,
    DeltaError,
    digest_algorithm,
    dtype_name,
    mask_nbytes,
)

FORMAT = "miles-weight-delta"
FORMAT_VERSION = 1
INDEX_NAME = "index.json"

_TENSOR_KEYS = {"dtype", "shape", "digest"}
_PAYLOAD_KEYS = {"file", "offset", "length", "raw_length", "base_digest"}
_TOP_KEYS = {
    "format",
    "format_version",
    "version",
    "base_version",
    "encoding",
    "compression",
    "digest",
    "files",
    "tensors",
}
_HEX = re.compile(r"[0-9a-f]+")


@dataclass(frozen=True)
class Payload:
    """Where a changed tensor's compressed delta lies, and the base it was computed against."""

    file: str
    offset: int
    length: int  # compressed bytes in the file
    raw_length: int  # bytes after decompression
    base_digest: str


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    digest: str  # of the resulting (new) bytes
    payload: Payload | None = None  # None: unchanged

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class DeltaIndex:
    version: int
    base_version: int
    encoding: str
    digest: str
    files: dict[str, int] = field(default_factory=dict)  # data file name -> size in bytes
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    compression: str = COMPRESSION

    def to_json(self) -> str:
        tensors: dict[str, Any] = {}
        for name, e in self.tensors.items():
            item: dict[str, Any] = {"dtype": dtype_name(e.dtype), "shape": list(e.shape), "digest": e.digest}
            if e.payload is not None:
                p = e.payload
                item.update(
                    base_digest=p.base_digest,
                    file=p.file,
                    offset=p.offset,
                    length=p.length,
                    raw_length=p.raw_length,
                )
            tensors[name] = item
        head = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": self.version,
            "base_version": self.base_version,
            "encoding": self.encoding,
            "compression": self.compression,
            "digest": self.digest,
            "files": self.files,
        }
        # One line per header field and per tensor: readable, and diffable between versions.
        lines = [f"  {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()]
        body = ",\n".join(f"    {json.dumps(n)}: {json.dumps(item)}" for n, item in tensors.items())
        return "{\n" + "\n".join(lines) + '\n  "tensors": {\n' + body + "\n  }\n}\n"

    @classmethod
    def from_json(cls, text: str | bytes, where: object) -> DeltaIndex:
        """Parse and validate an index; every problem is a DeltaError naming ``where`` (the index path)."""
        return _Parser(where).parse(text)


def is_plain_file_name(name: object) -> bool:
    """A bare file name: no directory part, not ``.``/``..``, no NUL or backslash."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in "/\\\0")
        and name == name.strip()
    )


def expected_raw_length(entry: TensorEntry) -> tuple[int, int]:
    """(smallest, largest) decompressed payload length for ``entry``: its mask and 1..numel values."""
    nmask = mask_nbytes(entry.numel)
    return nmask + entry.dtype.itemsize, nmask + entry.nbytes


def _dup_checking_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the LAST of duplicate keys silently; in an index that could hide a tensor.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


class _Parser:
    def __init__(self, where: object) -> None:
        self.where = where

    def fail(self, what: str, tensor: str | None = None) -> DeltaError:
        return DeltaError(f"malformed index: {what}", path=self.where, tensor=tensor)

    def int_field(self, obj: dict[str, Any], key: str, tensor: str | None = None, minimum: int = 0) -> int:
        v = obj.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.fail(f"{key!r} must be an integer >= {minimum}, got {v!r}", tensor)
        return v

    def str_field(self, obj: dict[str, Any], key: str, allowed: tuple[str, ...] | None = None) -> str:
        v = obj.get(key)
        if not isinstance(v, str) or (allowed is not None and v not in allowed):
            choice = f" (one of {', '.join(allowed)})" if allowed else ""
            raise self.fail(f"{key!r} must be a string{choice}, got {v!r}")
        return v

    def keys(self, obj: dict[str, Any], required: set[str], tensor: str | None = None) -> None:
        missing, extra = required - obj.keys(), obj.keys() - required
        if missing:
            raise self.fail(f"missing {', '.join(sorted(missing))}", tensor)
        if extra:
            raise self.fail(f"unexpected {', '.join(sorted(extra))}", tensor)

    def parse(self, text: str | bytes) -> DeltaIndex:
        try:
            doc = json.loads(text, object_pairs_hook=_dup_checking_object)
        except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
            raise self.fail(f"not valid JSON ({e})") from None
        if not isinstance(doc, dict):
            raise self.fail(f"expected a JSON object, got {type(doc).__name__}")
        if doc.get("format") != FORMAT:
            raise self.fail(f"'format' must be {FORMAT!r}, got {doc.get('format')!r}")
        if type(doc.get("format_version")) is not int or doc["format_version"] != FORMAT_VERSION:
            raise self.fail(
                f"format_version {doc.get('format_version')!r} is not supported (this reader knows {FORMAT_VERSION})"
            )
        self.keys(doc, _TOP_KEYS)
        version = self.int_field(doc, "version")
        base_version = self.int_field(doc, "base_version")
        if base_version >= version:
            raise self.fail(f"base_version {base_version} must be lower than version {version}")
        encoding = self.str_field(doc, "encoding", ENCODINGS)
        self.str_field(doc, "compression", (COMPRESSION,))
        algo_name = self.str_field(doc, "digest")
        try:
            algo = digest_algorithm(algo_name)
        except DeltaError as e:
            raise self.fail(e.what) from None

        files = doc["files"]
        if not isinstance(files, dict):
            raise self.fail("'files' must be an object of file name -> size")
        for fname, size in files.items():
            if not is_plain_file_name(fname):
                raise self.fail(
                    f"data file name {fname!r} is not a plain file name inside the version directory"
                )
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise self.fail(f"size of {fname!r} must be an integer >= 0, got {size!r}")

        raw_tensors = doc["tensors"]
        if not isinstance(raw_tensors, dict):
            raise self.fail("'tensors' must be an object of tensor name -> entry")
        tensors: dict[str, TensorEntry] = {}
        for name, item in raw_tensors.items():
            tensors[name] = self.tensor(name, item, files, algo.hex_length)
        return DeltaIndex(
            version=version,
            base_version=base_version,
            encoding=encoding,
            digest=algo_name,
            files=dict(files),
            tensors=tensors,
        )

    def digest_field(self, obj: dict[str, Any], key: str, hex_length: int, tensor: str) -> str:
        v = obj.get(key)
        if not isinstance(v, str) or len(v) != hex_length or not _HEX.fullmatch(v):
            raise self.fail(f"{key!r} must be {hex_length} lowercase hex characters, got {v!r}", tensor)
        return v

    def tensor(self, name: str, item: Any, files: dict[str, int], hex_length: int) -> TensorEntry:
        if not isinstance(item, dict):
            raise self.fail("entry must be an object", name)
        changed = "file" in item
        self.keys(item, _TENSOR_KEYS | (_PAYLOAD_KEYS if changed else set()), name)
        dtype = DTYPES.get(item["dtype"]) if isinstance(item["dtype"], str) else None
        if dtype is None:
            raise self.fail(
                f"dtype {item['dtype']!r} is not supported (supported: {', '.join(DTYPES)})", name
            )
        shape = item["shape"]
        if not isinstance(shape, list) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape
        ):
            raise self.fail(f"shape must be a list of integers >= 0, got {shape!r}", name)
        digest = self.digest_field(item, "digest", hex_length, name)
        entry = TensorEntry(dtype=dtype, shape=tuple(shape), digest=digest)
        if not changed:
            return entry

        fname = item["file"]
        if not is_plain_file_name(fname):
            raise self.fail(
                f"payload file name {fname!r} is not a plain file name inside the version directory", name
            )
        if fname not in files:
            raise self.fail(f"payload file {fname!r} is not listed in 'files'", name)
        offset = self.int_field(item, "offset", name)
        length = self.int_field(item, "length", name, minimum=1)
        raw_length = self.int_field(item, "raw_length", name, minimum=1)
        if offset + length > files[fname]:
            raise self.fail(
                f"payload [{offset}, {offset + length}) lies past the end of {fname!r} ({files[fname]} bytes)",
                name,
            )
        lo, hi = expected_raw_length(entry)
        if not lo <= raw_length <= hi or (raw_length - lo) % dtype.itemsize:
            raise self.fail(
                f"raw_length {raw_length} does not fit a payload for {dtype_name(dtype)}{list(shape)} "
                f"(the mask and 1..{entry.numel} values of {dtype.itemsize} bytes: {lo}..{hi})",
                name,
            )
        base_digest = self.digest_field(item, "base_digest", hex_length, name)
        payload = Payload(fname, offset, length, raw_length, base_digest)
        return TensorEntry(dtype=dtype, shape=tuple(shape), digest=digest, payload=payload)
