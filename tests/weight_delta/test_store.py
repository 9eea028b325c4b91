"""Publishing and reading deltas: round trips, the index, exactly-once xor, idempotent overwrite, atomicity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from miles_transports.weight_delta import (
    DeltaError,
    DeltaWriter,
    published_versions,
    read_delta,
    read_index,
    version_dir,
)

from . import apply, assert_same, make_state, step

ENCODINGS = ["xor", "overwrite"]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_round_trip_over_several_versions(tmp_path: Path, encoding: str) -> None:
    states = [make_state()]
    for v in range(1, 4):
        states.append(step(states[-1], seed=v))
    writer = DeltaWriter(str(tmp_path), encoding=encoding)
    writer.seed(states[0].items(), version=0)
    engine = {k: v.clone() for k, v in states[0].items()}
    for v in range(1, 4):
        stats = writer.publish(states[v].items(), version=v)
        before = {k: t.clone() for k, t in engine.items()}
        changed = read_delta(tmp_path, v, engine, current_version=v - 1)
        assert_same(engine, before)  # current is not modified
        # Only changed tensors come back (not the frozen, empty or identical ones), as fresh tensors.
        assert set(changed) == {k for k in engine if not torch.equal(engine[k], states[v][k])}
        assert {"frozen", "empty"}.isdisjoint(changed)
        for name, t in changed.items():
            assert t.device.type == "cpu" and t.data_ptr() != engine[name].data_ptr()
        engine = apply(engine, changed)
        assert_same(engine, states[v])
        assert (stats.version, stats.base_version, stats.tensors) == (v, v - 1, len(engine))
        assert stats.tensors_changed == len(changed)
    assert writer.version == 3


def test_index_lists_every_tensor_and_payloads_of_changed_ones(tmp_path: Path) -> None:
    base = make_state()
    new = step(base, seed=1)
    writer = DeltaWriter(str(tmp_path))
    writer.seed(base.items(), version=4)
    stats = writer.publish(new.items(), version=5)
    vdir = version_dir(tmp_path, 5)
    assert vdir.name == "v000005" and stats.path == str(vdir)
    doc = json.loads((vdir / "index.json").read_text())
    assert {k: doc[k] for k in ("version", "base_version", "encoding", "compression", "digest")} == {
        "version": 5,
        "base_version": 4,
        "encoding": "xor",
        "compression": "zstd",
        "digest": "xxh3_128",
    }
    assert list(doc["tensors"]) == list(new)  # publish order, every tensor
    assert doc["tensors"]["frozen"].keys() == {"dtype", "shape", "digest"}
    assert doc["tensors"]["w.bf16"]["dtype"] == "bfloat16" and doc["tensors"]["w.bf16"]["shape"] == [33, 7]
    assert {"file", "offset", "length", "raw_length", "base_digest"} <= doc["tensors"]["w.bf16"].keys()
    # The files map records exact sizes; nothing else (no .tmp) is left in the directory.
    on_disk = {p.name: p.stat().st_size for p in vdir.iterdir()}
    assert on_disk == {**doc["files"], "index.json": (vdir / "index.json").stat().st_size}
    assert stats.file_bytes == sum(on_disk.values())
    index = read_index(tmp_path, 5)
    assert index.tensors["scale"].shape == () and index.tensors["empty"].payload is None


def test_stats_count_bytes(tmp_path: Path) -> None:
    base = {"a": torch.zeros(100, dtype=torch.int32), "b": torch.zeros(10, dtype=torch.bfloat16)}
    new = {"a": base["a"].clone(), "b": base["b"].clone()}
    new["a"][:3] = 0x0101  # 3 elements, 6 bytes
    writer = DeltaWriter(str(tmp_path))
    writer.seed(base.items(), 0)
    stats = writer.publish(new.items(), 1)
    assert (stats.total_bytes, stats.changed_bytes, stats.tensors_changed) == (420, 6, 1)
    assert stats.density == pytest.approx(6 / 420) and stats.seconds > 0


def test_xor_applies_exactly_once(tmp_path: Path) -> None:
    base = make_state()
    new = step(base, seed=1)
    writer = DeltaWriter(str(tmp_path), encoding="xor")
    writer.seed(base.items(), 0)
    writer.publish(new.items(), 1)
    # A host that already applied the delta but still reports the old version must not apply it again.
    with pytest.raises(DeltaError, match=r"already holds the result of this delta.*exactly once") as e:
        read_delta(tmp_path, 1, new, current_version=0)
    assert e.value.tensor is not None and e.value.path == str(version_dir(tmp_path, 1))


def test_overwrite_is_idempotent(tmp_path: Path) -> None:
    base = make_state()
    new = step(base, seed=1)
    writer = DeltaWriter(str(tmp_path), encoding="overwrite")
    writer.seed(base.items(), 0)
    writer.publish(new.items(), 1)
    once = apply(base, read_delta(tmp_path, 1, base, current_version=0))
    twice = apply(once, read_delta(tmp_path, 1, once, current_version=0))
    assert_same(once, new)
    assert_same(twice, new)
    # A host that crashed half-way through swapping tensors in can simply retry.
    half = {**base, "w.f32": new["w.f32"], "ids.i64": new["ids.i64"]}
    assert_same(apply(half, read_delta(tmp_path, 1, half, current_version=0)), new)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_several_data_files(tmp_path: Path, encoding: str) -> None:
    base = make_state()
    new = step(base, seed=1)
    writer = DeltaWriter(str(tmp_path), encoding=encoding, max_file_bytes=64)
    writer.seed(base.items(), 0)
    writer.publish(new.items(), 1)
    files = read_index(tmp_path, 1).files
    assert len(files) > 2 and all(name.startswith("data-") for name in files)
    assert_same(apply(base, read_delta(tmp_path, 1, base, 0)), new)


def test_other_digests_and_levels(tmp_path: Path) -> None:
    base = make_state()
    new = step(base, seed=1)
    writer = DeltaWriter(str(tmp_path), digest="sha256", level=5)
    writer.seed(base.items(), 0)
    writer.publish(new.items(), 1)
    assert read_index(tmp_path, 1).digest == "sha256"
    assert_same(apply(base, read_delta(tmp_path, 1, base, 0)), new)


def test_keep_prunes_old_versions_but_never_the_base(tmp_path: Path) -> None:
    states = [make_state()]
    writer = DeltaWriter(str(tmp_path), keep=2)
    writer.seed(states[0].items(), 0)
    for v in range(1, 6):
        states.append(step(states[-1], seed=v))
        writer.publish(states[-1].items(), v)
    assert published_versions(tmp_path) == [4, 5]

    one = DeltaWriter(str(tmp_path / "one"), keep=1)
    one.seed(states[0].items(), 0)
    one.publish(states[1].items(), 1)
    one.publish(states[2].items(), 3)  # version numbers may skip
    one.publish(states[3].items(), 7)
    assert published_versions(tmp_path / "one") == [3, 7]  # 7 and its base 3


def test_noncontiguous_and_parameter_inputs(tmp_path: Path) -> None:
    base = {"t": torch.arange(12.0).reshape(3, 4).t(), "p": torch.nn.Parameter(torch.ones(3))}
    new = {"t": base["t"] * 2, "p": torch.nn.Parameter(torch.full((3,), 2.0))}
    writer = DeltaWriter(str(tmp_path))
    writer.seed(base.items(), 0)
    writer.publish(new.items(), 1)
    out = read_delta(tmp_path, 1, {k: v.detach() for k, v in base.items()}, 0)
    assert torch.equal(out["t"], new["t"]) and torch.equal(out["p"], new["p"].detach())


# ------------------------------------------------------------------ failed publishes


def test_a_failed_publish_rolls_back(tmp_path: Path) -> None:
    base = make_state()
    new = step(base, seed=1)
    writer = DeltaWriter(str(tmp_path))
    writer.seed(base.items(), 0)

    def producer_that_dies():
        yield from list(new.items())[:4]  # some tensors already encoded and the snapshot moved
        raise RuntimeError("gather failed on rank 3")

    with pytest.raises(RuntimeError, match="gather failed"):
        writer.publish(producer_that_dies(), 1)
    assert not version_dir(tmp_path, 1).exists() and writer.version == 0

    bad = {**new, "w.bf16": new["w.bf16"].float()}  # a dtype change half-way through
    with pytest.raises(DeltaError, match=r"'w.bf16'.*torch.float32.*base holds torch.bfloat16"):
        writer.publish(bad.items(), 1)

    # The snapshot is back on version 0: the retried publish is a correct delta against it.
    writer.publish(new.items(), 1)
    assert_same(apply(base, read_delta(tmp_path, 1, base, 0)), new)


def test_publish_refuses_bad_input(tmp_path: Path) -> None:
    base = make_state()
    writer = DeltaWriter(str(tmp_path))
    with pytest.raises(DeltaError, match="publish before seed"):
        writer.publish(base.items(), 1)
    with pytest.raises(DeltaError, match="appears twice in the seed"):
        writer.seed([("a", torch.zeros(1)), ("a", torch.zeros(1))], 0)
    writer.seed(base.items(), 2)
    with pytest.raises(DeltaError, match="version 2 must be greater than the current version 2"):
        writer.publish(base.items(), 2)
    with pytest.raises(DeltaError, match="appears twice in one publish"):
        writer.publish([*base.items(), ("scale", base["scale"])], 3)
    with pytest.raises(DeltaError, match="'extra': not in the base"):
        writer.publish([*base.items(), ("extra", torch.zeros(1))], 3)
    with pytest.raises(DeltaError, match=r"1 tensor\(s\) of the base were not published: frozen"):
        writer.publish([(k, v) for k, v in base.items() if k != "frozen"], 3)
    with pytest.raises(DeltaError, match=r"'w.f32'.*\[16, 8\] but the base holds torch.float32 \[8, 16\]"):
        writer.publish({**base, "w.f32": base["w.f32"].t().contiguous()}.items(), 3)
    assert published_versions(tmp_path) == []
    writer.publish(base.items(), 3)
    second = DeltaWriter(str(tmp_path))
    second.seed(base.items(), 2)
    with pytest.raises(DeltaError, match="v000003: this version is already published"):
        second.publish(base.items(), 3)
    for kwargs, message in [
        ({"encoding": "diff"}, "encoding must be one of xor, overwrite"),
        ({"keep": 0}, "keep must be an integer >= 1"),
        ({"digest": "md5"}, "unknown digest algorithm"),
        ({"level": 100}, "zstd level"),
    ]:
        with pytest.raises(DeltaError, match=message):
            DeltaWriter(str(tmp_path), **kwargs)


# ------------------------------------------------------------------ atomicity


def test_data_without_index_is_not_published(tmp_path: Path) -> None:
    """What a crash between the data files and the index leaves: data files, no index."""
    base = make_state()
    writer = DeltaWriter(str(tmp_path))
    writer.seed(base.items(), 0)
    writer.publish(step(base, seed=1).items(), 1)
    (version_dir(tmp_path, 1) / "index.json").unlink()
    assert any(version_dir(tmp_path, 1).glob("data-*.bin"))
    with pytest.raises(DeltaError, match=r"v000001: no index.json: version 1 was not \(fully\) published"):
        read_delta(tmp_path, 1, base, 0)
    assert published_versions(tmp_path) == []


def test_a_writer_killed_mid_publish_leaves_no_index(tmp_path: Path) -> None:
    """A real crash: the writing process dies (os._exit) after its last payload, before the index."""
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from weight_delta import make_state, step
        from miles_transports.weight_delta import DeltaWriter

        writer = DeltaWriter({str(tmp_path)!r})
        writer.seed(make_state().items(), 0)

        def tensors_then_crash():
            yield from step(make_state(), seed=1).items()
            os._exit(0)  # runs when the writer asks for the tensor after the last one

        writer.publish(tensors_then_crash(), 1)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    vdir = version_dir(tmp_path, 1)
    left = sorted(p.name for p in vdir.iterdir())
    assert left and "index.json" not in left  # payloads were written, the index never was
    base = make_state()
    with pytest.raises(DeltaError, match="not \\(fully\\) published"):
        read_delta(tmp_path, 1, base, 0)
    # A restarted writer publishes the same version over the leftovers.
    writer = DeltaWriter(str(tmp_path))
    writer.seed(base.items(), 0)
    writer.publish(step(base, seed=1).items(), 1)
    assert not any(name.endswith(".tmp") for name in os.listdir(vdir))
    assert_same(apply(base, read_delta(tmp_path, 1, base, 0)), step(base, seed=1))
