"""Offload of the paused actor by storage (CPU): to host memory, and to disk through one staging buffer.

The mechanics are device-agnostic, so they run here on CPU tensors (on CPU nothing is pinned).
The trainer's own offload is run on CPU through the real backend (``megatron.device: cpu``);
the GPU run is in ``test_megatron_train_gpu.py``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from pydantic import ValidationError
from torch.profiler import ProfilerActivity, profile

from miles.errors import ConfigError
from miles_megatron.config import MegatronOptions
from miles_megatron.offload import SPILL_PREFIX, DiskSpill, StorageOffloader

STAGING = 1000  # bytes; odd on purpose, so chunks end mid-element


def _state() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Storages as a trainer has them: a flat buffer with views into it, a bf16 moment, an odd-sized one."""
    g = torch.Generator().manual_seed(0)
    buffer = torch.randn(1100, generator=g)  # 4400 bytes: more than four staging buffers
    views = [buffer[:16].view(4, 4), buffer[16:]]
    moment = torch.randn(8, 8, generator=g).to(torch.bfloat16)  # 128 bytes: less than one buffer
    odd = torch.randint(0, 255, (1001,), dtype=torch.uint8, generator=g)  # one byte over a buffer
    return [buffer, moment, odd], views


def _allocations(fn) -> list[int]:
    """The sizes of the host allocations ``fn`` makes (the CPU allocator, through torch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0]


def test_disk_offload_streams_through_one_staging_buffer_and_values_come_back(tmp_path):
    tensors, views = _state()
    want = [t.clone() for t in tensors]
    keep = tmp_path / "not-ours.txt"
    keep.write_text("a file the offloader did not write")
    spill = DiskSpill(str(tmp_path), STAGING)
    off = StorageOffloader([*tensors, *views, tensors[0]], "cpu", disk=spill)
    sizes = [t.untyped_storage().nbytes() for t in tensors]
    assert len(off.storages) == 3 and sizes == [4400, 128, 1001]

    out = {}
    allocated = _allocations(lambda: out.update(off.offload()))
    # The only host allocation of the offload is the staging buffer itself.
    assert allocated == [STAGING], allocated
    assert out["bytes"] == sum(sizes) and out["staging_bytes"] == STAGING
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    made = [p for p in tmp_path.iterdir() if p.name.startswith(SPILL_PREFIX)]
    assert len(made) == 1 and made[0] == tmp_path / os.path.basename(spill.directory or "")
    assert sorted(f.stat().st_size for f in made[0].iterdir()) == sorted(sizes)
    buffer_at = spill.staging.data_ptr() if spill.staging is not None else None

    back = {}
    allocated = _allocations(lambda: back.update(off.onload()))
    # On CPU the storages themselves grow back on the host; nothing else is allocated.
    assert sorted(allocated) == sorted(sizes), allocated
    assert back["bytes"] == out["bytes"]
    for t, w in zip(tensors, want, strict=True):
        assert t.dtype == w.dtype and torch.equal(t, w)
    assert torch.equal(views[0], want[0][:16].view(4, 4))
    views[1].add_(1.0)  # still a view of the buffer
    assert torch.equal(tensors[0][16:], want[0][16:] + 1.0)
    # The directory it made is gone; the file it did not write is not.
    assert not made[0].exists() and keep.read_text().startswith("a file")
    assert [p.name for p in tmp_path.iterdir()] == [keep.name]

    # A second cycle reuses the same buffer: no allocation at offload at all.
    again = StorageOffloader(tensors, "cpu", disk=spill)
    assert _allocations(again.offload) == []
    assert spill.staging is not None and spill.staging.data_ptr() == buffer_at
    assert spill.staging.numel() == STAGING
    # chunk count: every storage in ceil(size / staging) pieces, through the one buffer
    assert sum(math.ceil(s / STAGING) for s in sizes) == 5 + 1 + 2
    again.onload()
    assert torch.equal(tensors[0][16:], want[0][16:] + 1.0) and torch.equal(tensors[2], want[2])


def test_host_offload_copies_each_storage_whole():
    tensors, _ = _state()
    off = StorageOffloader(tensors, "cpu")
    want = [t.clone() for t in tensors]
    allocated = _allocations(off.offload)
    assert sorted(allocated) == [128, 1001, 4400]  # one host copy per storage, whole
    off.onload()
    assert all(torch.equal(t, w) for t, w in zip(tensors, want, strict=True))


def test_refusals(tmp_path):
    tensors, _ = _state()
    off = StorageOffloader(tensors, "cpu", disk=DiskSpill(str(tmp_path), STAGING))
    with pytest.raises(RuntimeError, match="not offloaded"):
        off.onload()
    off.offload()
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload()
    off.onload()
    with pytest.raises(RuntimeError, match="not offloaded"):
        off.onload()

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(
        ValueError, match=r"megatron.offload_dir .* does not exist; allowed: an existing, writable"
    ):
        DiskSpill(str(tmp_path / "missing"), STAGING)
    with pytest.raises(ValueError, match=r"megatron.offload_dir .* is not a directory"):
        DiskSpill(str(a_file), STAGING)
    with pytest.raises(ValueError, match="at least 1 byte"):
        DiskSpill(str(tmp_path), 0)


def test_options_are_checked_before_any_model_work(tmp_path):
    from megatron_helpers import make_checkpoint

    from miles.config.schema import TrainSection
    from miles.interfaces import BackendSpec
    from miles_megatron.backend import MegatronBackend, refusals

    assert MegatronOptions().offload_to == "host" and MegatronOptions().offload_staging_mb == 64
    with pytest.raises(ValidationError, match=r"offload_dir is set but megatron\.offload_to is 'host'"):
        MegatronOptions(offload_dir=str(tmp_path))
    with pytest.raises(ValidationError, match="offload_staging_mb"):
        MegatronOptions(offload_to="disk", offload_staging_mb=0)
    with pytest.raises(ValidationError, match="offload_to"):
        MegatronOptions(offload_to="nvme")  # type: ignore[arg-type]
    assert MegatronOptions(offload_to="disk", offload_dir=str(tmp_path)).storage_problems() == []
    missing = str(tmp_path / "missing")
    line = f"megatron.offload_dir {missing!r} does not exist; allowed: an existing, writable directory on node-local disk"
    bad = MegatronOptions(offload_to="disk", offload_dir=missing)
    assert bad.storage_problems() == [line]
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        problems = MegatronOptions(offload_to="disk", offload_dir=str(locked)).storage_problems()
        assert len(problems) == 1 and "is not writable" in problems[0]
    spec = BackendSpec(
        model_path=str(make_checkpoint("qwen3", tmp_path / "hf")),
        loss="sft",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={"megatron": {"device": "cpu", "offload_to": "disk", "offload_dir": missing}},
    )
    assert refusals(spec, TrainSection(), bad, "local") == [line]
    with pytest.raises(ConfigError, match="does not exist"):  # in setup, before the model is built
        MegatronBackend().setup(spec)


def _cpu_spec(path, **megatron):
    from miles.interfaces import BackendSpec

    return BackendSpec(
        model_path=str(path),
        loss="sft",
        correction=None,
        transport="colocated",
        engine_urls=[],
        temperature=1.0,
        options={
            "train": {"lr": 1e-2, "micro_batch_size": 2, "grad_clip": 1.0},
            "megatron": dict(device="cpu", params_dtype="float32", **megatron),
        },
    )


@pytest.mark.slow
def test_the_cpu_trainer_offloads_to_disk_and_trains_on_identically(tmp_path):
    """The real backend on one gloo rank: weights, gradients and AdamW state to disk and back."""
    from megatron_helpers import make_batch, make_checkpoint

    from miles_megatron.backend import MegatronBackend

    path = make_checkpoint("qwen3", tmp_path / "hf", tie_word_embeddings=False)
    batches = [make_batch(4, seed=30 + i) for i in range(3)]
    plain = MegatronBackend()
    plain.setup(_cpu_spec(path))
    try:
        want = [plain.train_step(b)["train/loss"] for b in batches]
    finally:
        plain.shutdown()
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    backend = MegatronBackend()
    backend.setup(_cpu_spec(path, offload_to="disk", offload_dir=str(spill_dir), offload_staging_mb=1))
    try:
        got = [backend.train_step(batches[0])["train/loss"]]
        params = list(backend.trainer.gpt.parameters())
        off = backend.offload()
        # parameters, their gradients and AdamW's two moments per parameter
        assert off["offload/bytes"] >= 4 * sum(p.numel() * p.element_size() for p in params)
        assert off["offload/staging_bytes"] == 2**20
        assert all(p.untyped_storage().nbytes() == 0 for p in params)
        assert len(list(spill_dir.iterdir())) == 1
        with pytest.raises(RuntimeError, match="offloaded"):
            backend.train_step(batches[1])
        on = backend.onload()
        assert on["onload/bytes"] == off["offload/bytes"]
        assert list(spill_dir.iterdir()) == []
        got += [backend.train_step(b)["train/loss"] for b in batches[1:]]
    finally:
        backend.shutdown()
    assert got == want  # bit for bit on CPU
