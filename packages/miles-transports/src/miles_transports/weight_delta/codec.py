"""The byte-level codec of the disk-delta format: tensor bytes, the two encodings, digests, compression.

Nothing here knows about files. Every function works on a tensor's **bytes**: its
elements in C-contiguous (row-major) order, each in the machine's native byte order
(little-endian everywhere Miles runs), as a 1-D ``uint8`` numpy array. No value is
ever converted, so ``-0.0`` and ``0.0`` differ and a bfloat16 tensor is its 2-byte
patterns. These are the bytes :mod:`miles.engines.digest` hashes.

Payload of one changed tensor (before compression), the same layout for both encodings::

    mask    8 * ceil(n / 64) bytes    bit i (little-endian bit order) set iff element i changed;
                                      padding bits are zero; the length keeps what follows 8-byte aligned
    planes  k * itemsize bytes        the k changed elements' values, as byte planes (below)

``xor``
    The values are ``new XOR base`` of the changed elements. Decoding XORs them into
    the base. XOR is its own inverse, so applying a delta twice restores the base
    instead of failing: an xor payload must be applied exactly once, against its
    declared base.

``overwrite``
    The values are the changed elements' new bytes. Decoding writes them at the
    masked positions and leaves every other element as it is, so applying it twice
    gives the same result (idempotent). It costs more bytes than xor: new values
    are close to random in their low bits, XORs of a small step are mostly zero.

Why a bitmap of changed elements: an RL step changes elements scattered across a
tensor (whether a bfloat16 weight moves depends on its own magnitude), so runs of
changed elements are almost all one element long and a (start, length) run list
costs 8+ bytes per change; a list of element indices costs 4-8. The bitmap costs
1/8 byte per element whatever the density: smaller than 32-bit indices as soon as
more than 1 in 32 elements change (typical for a bfloat16 step), and when fewer
change its long zero runs compress to almost nothing. It decodes with a few
vectorised numpy calls and has no index-width limit. Storing only the changed
elements (rather than the XOR of the whole tensor, mostly zeros) roughly halves the
compressed size of a bfloat16 step.

Byte planes: the values are split into words of ``lane = min(itemsize, 8)`` bytes
(a complex128 element is two words) and plane ``j`` holds byte ``j`` of every word,
planes in order 0..lane-1. A small step changes the low mantissa bytes and almost
never the sign/exponent byte, so after the split the high planes are runs of zeros
that zstd skips over: smaller output, and faster compression, than interleaved bytes.

Digests are hex strings of a hash of the bytes (default ``xxh3_128``, 32 hex
characters). Compression is zstandard with the frame's content size recorded, so a
reader checks the declared size before it allocates anything.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
import zstandard

from miles.errors import MilesError

ENCODINGS = ("xor", "overwrite")
COMPRESSION = "zstd"


class DeltaError(MilesError):
    """A weight delta cannot be written, or was refused when read: what went wrong and where.

    ``path`` is the version directory or file concerned and ``tensor`` the tensor name,
    when known; both also appear in the message.
    """

    def __init__(self, what: str, *, path: object = None, tensor: str | None = None) -> None:
        self.what = what
        self.path = None if path is None else str(path)
        self.tensor = tensor
        where = [p for p in (self.path, None if tensor is None else f"tensor {tensor!r}") if p]
        super().__init__(": ".join([*where, what]))


# ------------------------------------------------------------------ dtypes


# Dtypes a delta may carry, by the name written in the index (``str(dtype)`` without
# ``torch.``). An explicit list: names read from an index are looked up here, never
# with getattr on the torch module. Optional float8 types exist only in newer torch.
_DTYPE_NAMES = (
    *("float64", "float32", "float16", "bfloat16"),
    *("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"),
    *("complex64", "complex128"),
    *("int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool"),
)
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; a dtype the format does not carry is a DeltaError."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise DeltaError(
            f"dtype {dtype} is not supported by the delta format (supported: {', '.join(DTYPES)})"
        )
    return name


# ------------------------------------------------------------------ bytes


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``t`` as a 1-D uint8 array.

    No copy for a contiguous CPU tensor (the array shares its memory); a tensor on
    another device or with a non-contiguous layout is copied once.
    """
    if t.layout != torch.strided:
        raise DeltaError(f"only dense tensors can be delta-encoded, got layout {t.layout}")
    flat = t.detach().to("cpu").reshape(-1)  # reshape copies only when not contiguous
    if flat.is_conj() or flat.is_neg():  # lazy flags the raw bytes do not reflect
        flat = flat.resolve_conj().resolve_neg()
    return flat.view(torch.uint8).numpy()


_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def lane_of(itemsize: int) -> int:
    """Word size (bytes) of the byte-plane split: the element size, 8 for 16-byte elements."""
    return min(itemsize, 8)


def element_view(b: np.ndarray, itemsize: int) -> np.ndarray:
    """Bytes as one unsigned word per element, or ``(n, itemsize // 8)`` words for 16-byte elements."""
    lane = lane_of(itemsize)
    words = b.view(_UINT_OF_SIZE[lane])
    return words if lane == itemsize else words.reshape(-1, itemsize // lane)


def mask_nbytes(numel: int) -> int:
    """Length of a payload's bitmap: ``8 * ceil(numel / 64)``."""
    return 8 * ((numel + 63) // 64)


def split_planes(words: np.ndarray, out: np.ndarray) -> None:
    """Byte ``j`` of every word of ``words`` (flat uintN) into plane ``j`` of ``out`` (uint8, same bytes)."""
    lane = words.itemsize
    planes = out.reshape(lane, -1)
    for j in range(lane):
        # An unsafe cast to uint8 keeps the low byte: (word >> 8j) mod 256.
        np.right_shift(words, 8 * j, out=planes[j], casting="unsafe")


def merge_planes(planes_bytes: np.ndarray, out: np.ndarray) -> None:
    """Inverse of :func:`split_planes`: rebuild the words ``out`` (flat uintN) from their byte planes."""
    lane = out.itemsize
    planes = planes_bytes.reshape(lane, -1)
    np.copyto(out, planes[lane - 1])
    for j in range(lane - 2, -1, -1):
        np.left_shift(out, 8, out=out)
        np.bitwise_or(out, planes[j], out=out)


@dataclass
class Encoded:
    """One changed tensor's payload (uncompressed) and what the writer needs to undo it."""

    payload: np.ndarray  # uint8: mask then planes; may be scratch memory, valid until the next encode
    changed: int  # elements that differ
    changed_bytes: int  # bytes that differ
    packed_mask: np.ndarray  # an owned copy of the mask bytes
    old_values: np.ndarray  # the changed elements' bytes before the update (owned)


class Encoder:
    """Builds payloads of one encoding, reusing scratch buffers sized for the largest tensor seen."""

    def __init__(self, encoding: str) -> None:
        if encoding not in ENCODINGS:
            raise DeltaError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
        self.encoding = encoding
        self._mask = np.empty(0, dtype=bool)
        self._payload = np.empty(0, dtype=np.uint8)
        self._values = np.empty(0, dtype=np.uint8)

    def _grow(self, attr: str, n: int) -> np.ndarray:
        buf = getattr(self, attr)
        if len(buf) < n:
            buf = np.empty(n, dtype=buf.dtype)
            setattr(self, attr, buf)
        return buf[:n]

    def encode(self, new: np.ndarray, old: np.ndarray, itemsize: int) -> Encoded | None:
        """The payload of ``new`` against ``old`` (byte arrays of equal length); None if nothing changed."""
        new_e, old_e = element_view(new, itemsize), element_view(old, itemsize)
        numel = len(new_e)
        if new_e.ndim == 1:
            mask = np.not_equal(new_e, old_e, out=self._grow("_mask", numel))
        else:  # 16-byte elements: an element changed if either of its words did
            mask = np.not_equal(new_e, old_e).any(axis=1)
        changed = int(np.count_nonzero(mask))
        if not changed:
            return None
        nmask = mask_nbytes(numel)
        payload = self._grow("_payload", nmask + changed * itemsize)
        packed = np.packbits(mask, bitorder="little")
        payload[: len(packed)] = packed
        payload[len(packed) : nmask] = 0

        # Gathering by index is several times faster in numpy than by boolean mask.
        where = np.flatnonzero(mask)
        old_values = np.take(old_e, where, axis=0)
        values = self._grow("_values", changed * itemsize).view(old_values.dtype).reshape(old_values.shape)
        np.take(new_e, where, axis=0, out=values)
        if self.encoding == "xor":
            np.bitwise_xor(values, old_values, out=values)
            changed_bytes = int(np.count_nonzero(values.view(np.uint8)))
        else:
            changed_bytes = int(np.count_nonzero(values.view(np.uint8) != old_values.view(np.uint8)))
        split_planes(values.reshape(-1), payload[nmask:])
        return Encoded(payload, changed, changed_bytes, payload[:nmask].copy(), old_values)


def decode(encoding: str, base: np.ndarray, payload: np.ndarray, itemsize: int, out: np.ndarray) -> None:
    """``out`` = ``base`` with the payload applied (all byte arrays; ``out`` does not alias ``base``).

    Raises ``ValueError`` (the caller adds where) when the payload does not fit the
    tensor: a length that disagrees with the number of set bits, or set padding bits.
    """
    base_e = element_view(base, itemsize)
    numel = len(base_e)
    nmask = mask_nbytes(numel)
    if len(payload) < nmask or (len(payload) - nmask) % itemsize:
        raise ValueError(f"payload of {len(payload)} bytes does not fit {numel} elements of {itemsize} bytes")
    bits = np.unpackbits(payload[:nmask], bitorder="little")
    if bits[numel:].any():
        raise ValueError("payload has mask bits set past the last element")
    mask = bits[:numel].view(bool)
    changed = int(np.count_nonzero(mask))
    if nmask + changed * itemsize != len(payload):
        raise ValueError(
            f"payload marks {changed} changed elements but carries {(len(payload) - nmask) // itemsize} values"
        )
    values = np.empty(changed * itemsize, dtype=np.uint8)
    words = values.view(_UINT_OF_SIZE[lane_of(itemsize)])
    merge_planes(payload[nmask:], words)
    values_e = element_view(values, itemsize)
    where = np.flatnonzero(mask)
    np.copyto(out, base)
    out_e = element_view(out, itemsize)
    if encoding == "xor":
        np.bitwise_xor(values_e, np.take(out_e, where, axis=0), out=values_e)
    elif encoding != "overwrite":
        raise ValueError(f"unknown encoding {encoding!r}")
    out_e[where] = values_e


def revert(snapshot: np.ndarray, itemsize: int, packed_mask: np.ndarray, old_values: np.ndarray) -> None:
    """Put ``old_values`` back at the masked elements of ``snapshot`` (the writer's undo)."""
    snap_e = element_view(snapshot, itemsize)
    mask = np.unpackbits(packed_mask, bitorder="little", count=len(snap_e))
    snap_e[np.flatnonzero(mask)] = old_values


# ------------------------------------------------------------------ digests


@dataclass(frozen=True)
class DigestAlgorithm:
    name: str
    hexdigest: Callable[[Any], str]  # bytes-like (a contiguous numpy array works, no copy) -> hex
    hex_length: int


def _hashlib(name: str) -> Callable[[Any], str]:
    return lambda buf: hashlib.new(name, buf).hexdigest()


DIGESTS: dict[str, DigestAlgorithm] = {
    a.name: a
    for a in (
        DigestAlgorithm("xxh3_128", xxhash.xxh3_128_hexdigest, 32),
        DigestAlgorithm("xxh3_64", xxhash.xxh3_64_hexdigest, 16),
        DigestAlgorithm("blake2b", _hashlib("blake2b"), 128),
        DigestAlgorithm("sha256", _hashlib("sha256"), 64),
    )
}


def digest_algorithm(name: str) -> DigestAlgorithm:
    try:
        return DIGESTS[name]
    except KeyError:
        raise DeltaError(f"unknown digest algorithm {name!r} (supported: {', '.join(DIGESTS)})") from None


# ------------------------------------------------------------------ compression


class Compressor:
    """zstd compression with one reused context (level 1 by default; ``threads`` > 0 uses zstd workers)."""

    # zstd's negative "fast" levels go down to -(1 << 17) (ZSTD_minCLevel).
    MIN_LEVEL = -(1 << 17)

    def __init__(self, level: int = 1, threads: int = 0) -> None:
        hi = zstandard.MAX_COMPRESSION_LEVEL
        if isinstance(level, bool) or not isinstance(level, int) or not self.MIN_LEVEL <= level <= hi:
            raise DeltaError(f"zstd level must be an integer in [{self.MIN_LEVEL}, {hi}], got {level!r}")
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise DeltaError(f"zstd threads must be an integer >= 0, got {threads!r}")
        self._ctx = zstandard.ZstdCompressor(level=level, threads=threads, write_content_size=True)

    def compress(self, data: np.ndarray) -> bytes:
        # The array's own buffer (no copy); numpy's stubs do not type an ndarray as a buffer on 3.11.
        return self._ctx.compress(data.data)


def decompress(data: bytes | memoryview, raw_length: int) -> bytes:
    """One zstd frame that must declare exactly ``raw_length`` bytes of content.

    The declared size is checked before decompressing, so a corrupt or hostile
    header cannot make the reader allocate more than the index promised. Raises
    ``ValueError`` (the caller adds where).
    """
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as e:
        raise ValueError(f"not a zstd frame ({e})") from None
    if declared != raw_length:
        got = "no size" if declared < 0 else f"{declared} bytes"
        raise ValueError(f"zstd frame declares {got}, the index says {raw_length} bytes")
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_length)
    except zstandard.ZstdError as e:
        raise ValueError(f"does not decompress ({e})") from None
    if len(raw) != raw_length:
        raise ValueError(f"decompresses to {len(raw)} bytes, the index says {raw_length}")
    return raw
