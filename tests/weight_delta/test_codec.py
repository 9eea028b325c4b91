"""The byte-level codec: tensor bytes, the payload layout, both encodings, planes, compression."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zstandard

from miles_transports.weight_delta import codec
from miles_transports.weight_delta.codec import DeltaError, Encoder, decode, tensor_bytes

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex128,
    torch.float8_e4m3fn,
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(np.prod(shape, dtype=np.int64)) * dtype.itemsize,), generator=g)
    t = raw.to(torch.uint8).view(dtype).reshape(shape)
    return t if dtype != torch.bool else t.view(torch.uint8).bitwise_and(1).view(torch.bool)


def changed_copy(t: torch.Tensor, fraction: float, g: torch.Generator) -> torch.Tensor:
    """``t`` with about ``fraction`` of its elements given other random bytes."""
    new = t.clone()
    b = new.reshape(-1).view(torch.uint8).view(-1, t.dtype.itemsize)
    pick = torch.rand(b.shape[0], generator=g) < fraction
    b[pick] ^= torch.randint(1, 2, b[pick].shape, generator=g).to(
        torch.uint8
    )  # flip the low bit of each byte
    return new


def roundtrip(encoding: str, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor | None:
    enc = Encoder(encoding).encode(tensor_bytes(new), tensor_bytes(old), old.dtype.itemsize)
    if enc is None:
        return None
    out = torch.empty_like(old)
    decode(encoding, tensor_bytes(old), enc.payload.copy(), old.dtype.itemsize, tensor_bytes(out))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return np.array_equal(tensor_bytes(a), tensor_bytes(b))


@pytest.mark.parametrize("encoding", codec.ENCODINGS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fraction", [0.01, 0.4, 1.0])
def test_roundtrip_every_dtype(encoding: str, dtype: torch.dtype, fraction: float) -> None:
    g = torch.Generator().manual_seed(1)
    old = random_tensor(dtype, (37, 5), g)
    new = changed_copy(old, fraction, g)
    if same_bytes(old, new):  # at 1% of 185 elements nothing may have been picked
        new.view(-1)[0:1].view(torch.uint8)[0] ^= 1
    out = roundtrip(encoding, old, new)
    assert out is not None and same_bytes(out, new)


@pytest.mark.parametrize("encoding", codec.ENCODINGS)
def test_unchanged_and_empty_tensors_encode_to_nothing(encoding: str) -> None:
    g = torch.Generator().manual_seed(2)
    t = random_tensor(torch.bfloat16, (9, 9), g)
    assert roundtrip(encoding, t, t.clone()) is None
    assert roundtrip(encoding, torch.zeros(0, 3), torch.zeros(0, 3)) is None


@pytest.mark.parametrize("encoding", codec.ENCODINGS)
def test_scalar(encoding: str) -> None:
    out = roundtrip(encoding, torch.tensor(1.5), torch.tensor(-2.25))
    assert out is not None and out.shape == () and out.item() == -2.25


def test_payload_layout_is_mask_then_byte_planes() -> None:
    """The documented layout, byte for byte: bf16 [1, 2, 3] -> [1, 2.015625, 3] (0x4000 -> 0x4001)."""
    old = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    new = torch.tensor([1.0, 2.015625, 3.0], dtype=torch.bfloat16)
    mask = [0b010, 0, 0, 0, 0, 0, 0, 0]  # element 1 changed; 8 bytes for up to 64 elements
    xor = Encoder("xor").encode(tensor_bytes(new), tensor_bytes(old), 2)
    over = Encoder("overwrite").encode(tensor_bytes(new), tensor_bytes(old), 2)
    assert xor is not None and over is not None
    assert list(xor.payload) == [*mask, 0x01, 0x00]  # 0x4001 ^ 0x4000 = 0x0001: low plane, then high plane
    assert list(over.payload) == [*mask, 0x01, 0x40]  # the new value 0x4001
    assert xor.changed == 1 and xor.changed_bytes == 1


def test_xor_is_an_involution_and_overwrite_is_idempotent() -> None:
    g = torch.Generator().manual_seed(3)
    old = random_tensor(torch.bfloat16, (50,), g)
    new = changed_copy(old, 0.5, g)
    for encoding, twice_gives in (("xor", old), ("overwrite", new)):
        enc = Encoder(encoding).encode(tensor_bytes(new), tensor_bytes(old), 2)
        assert enc is not None
        once, twice = torch.empty_like(old), torch.empty_like(old)
        decode(encoding, tensor_bytes(old), enc.payload, 2, tensor_bytes(once))
        decode(encoding, tensor_bytes(once), enc.payload, 2, tensor_bytes(twice))
        assert same_bytes(once, new)
        assert same_bytes(twice, twice_gives), encoding


def test_revert_restores_the_old_bytes() -> None:
    g = torch.Generator().manual_seed(4)
    old = random_tensor(torch.float32, (20, 3), g)
    new = changed_copy(old, 0.3, g)
    enc = Encoder("overwrite").encode(tensor_bytes(new), tensor_bytes(old), 4)
    assert enc is not None
    snapshot = tensor_bytes(new).copy()
    codec.revert(snapshot, 4, enc.packed_mask, enc.old_values)
    assert np.array_equal(snapshot, tensor_bytes(old))


def test_changed_bytes_counts_bytes_not_elements() -> None:
    old = torch.zeros(4, dtype=torch.int32)
    new = torch.tensor([0, 1, 0x0101, 0], dtype=torch.int32)  # 2 elements, 3 bytes
    for encoding in codec.ENCODINGS:
        enc = Encoder(encoding).encode(tensor_bytes(new), tensor_bytes(old), 4)
        assert enc is not None and (enc.changed, enc.changed_bytes) == (2, 3)


@pytest.mark.parametrize("lane_dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_planes_roundtrip(lane_dtype: type) -> None:
    words = np.random.default_rng(0).integers(
        0, np.iinfo(lane_dtype).max, 101, dtype=lane_dtype, endpoint=True
    )
    planes = np.empty(words.nbytes, dtype=np.uint8)
    codec.split_planes(words, planes)
    lane = words.itemsize
    assert np.array_equal(planes.reshape(lane, -1)[0], (words & 0xFF).astype(np.uint8))
    back = np.empty_like(words)
    codec.merge_planes(planes, back)
    assert np.array_equal(back, words)


def test_decode_rejects_payloads_that_do_not_fit() -> None:
    base = tensor_bytes(torch.zeros(10, dtype=torch.float16))
    out = np.empty_like(base)
    mask = np.zeros(8, dtype=np.uint8)
    mask[0] = 0b11  # two elements changed
    with pytest.raises(ValueError, match="marks 2 changed elements but carries 1"):
        decode("xor", base, np.concatenate([mask, np.zeros(2, np.uint8)]), 2, out)
    mask[1] = 0b100  # bit 10: past the last of 10 elements
    with pytest.raises(ValueError, match="past the last element"):
        decode("xor", base, np.concatenate([mask, np.zeros(6, np.uint8)]), 2, out)
    with pytest.raises(ValueError, match="does not fit"):
        decode("overwrite", base, np.zeros(5, np.uint8), 2, out)


def test_tensor_bytes_shares_memory_and_handles_layouts() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = tensor_bytes(t)
    assert b.dtype == np.uint8 and b.shape == (24,)
    assert b.ctypes.data == t.data_ptr()  # no copy for a contiguous CPU tensor
    assert np.array_equal(tensor_bytes(t.t()), tensor_bytes(t.t().contiguous()))  # row-major order
    assert len(tensor_bytes(torch.tensor(1.0))) == 4
    assert len(tensor_bytes(torch.zeros(0, 5))) == 0
    assert not np.array_equal(tensor_bytes(torch.tensor(0.0)), tensor_bytes(torch.tensor(-0.0)))
    assert np.array_equal(tensor_bytes(torch.tensor([1.0]).bfloat16()), [0x80, 0x3F])  # little-endian 0x3f80
    with pytest.raises(DeltaError, match="dense"):
        tensor_bytes(torch.eye(3).to_sparse())


def test_unsupported_dtype_is_named() -> None:
    with pytest.raises(DeltaError, match=r"torch\.quint8 is not supported.*bfloat16"):
        codec.dtype_name(torch.quint8)
    assert codec.dtype_name(torch.bfloat16) == "bfloat16"


def test_digests() -> None:
    data = np.arange(100, dtype=np.uint8)
    for name, algo in codec.DIGESTS.items():
        h = algo.hexdigest(data)
        assert h == algo.hexdigest(data.tobytes()) and len(h) == algo.hex_length, name
    with pytest.raises(DeltaError, match="unknown digest algorithm 'md5'"):
        codec.digest_algorithm("md5")


def test_decompress_checks_the_declared_size_first() -> None:
    raw = np.arange(1000, dtype=np.uint16).view(np.uint8)
    frame = codec.Compressor().compress(raw)
    assert codec.decompress(frame, raw.nbytes) == raw.tobytes()
    with pytest.raises(ValueError, match="declares 2000 bytes, the index says 1999"):
        codec.decompress(frame, 1999)
    with pytest.raises(ValueError, match="not a zstd frame"):
        codec.decompress(b"definitely not zstd", 10)
    no_size = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    unsized = no_size.compress(raw.tobytes()) + no_size.flush()
    with pytest.raises(ValueError, match="declares no size"):
        codec.decompress(unsized, raw.nbytes)


def test_compressor_settings_are_checked() -> None:
    with pytest.raises(DeltaError, match="zstd level"):
        codec.Compressor(level=99)
    with pytest.raises(DeltaError, match="zstd threads"):
        codec.Compressor(threads=-1)
    with pytest.raises(DeltaError, match="encoding must be one of xor, overwrite"):
        codec.Encoder("diff")
