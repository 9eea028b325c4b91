"""Every fault a reader can meet is refused before anything is returned, with what and where."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from miles_transports.weight_delta import DeltaError, DeltaWriter, read_delta, read_index, version_dir

from . import make_state, rewrite_index, step

TARGET = "w.bf16"  # a changed tensor whose payload the faults tamper with


@pytest.fixture(params=["xor", "overwrite"])
def published(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """ROOT with version 1 published against the base ``make_state()`` (version 0); returns (root, base)."""
    base = make_state()
    writer = DeltaWriter(str(tmp_path / "root"), encoding=request.param)
    writer.seed(base.items(), 0)
    writer.publish(step(base, seed=1).items(), 1)
    return tmp_path / "root", base


def refused(root: Path, base: dict[str, torch.Tensor], match: str, current_version: int = 0) -> DeltaError:
    before = {k: v.clone() for k, v in base.items()}
    with pytest.raises(DeltaError, match=match) as e:
        read_delta(root, 1, base, current_version)
    for name in base:  # the host's tensors are untouched
        assert torch.equal(base[name], before[name])
    return e.value


def payload_of(root: Path, name: str = TARGET) -> dict[str, Any]:
    return json.loads((version_dir(root, 1) / "index.json").read_text())["tensors"][name]


def test_truncated_data_file(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    data = version_dir(root, 1) / payload_of(root)["file"]
    os.truncate(data, data.stat().st_size - 3)
    err = refused(root, base, r"data-00000.bin: data file is \d+ bytes, the index says \d+ \(truncated\)")
    assert err.path == str(data)


def test_flipped_byte_in_a_payload(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    p = payload_of(root)
    data = version_dir(root, 1) / p["file"]
    with open(data, "r+b") as f:
        f.seek(p["offset"] + p["length"] - 3)  # inside the compressed payload, past the frame header
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    err = refused(
        root, base, r"data-00000.bin: tensor 'w.bf16': (payload at offset|the decoded tensor's digest)"
    )
    assert err.tensor == TARGET and err.path == str(data)


def test_wrong_base_version(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    err = refused(
        root, base, "v000001: delta applies to version 0, but this host holds version 7", current_version=7
    )
    assert err.path == str(version_dir(root, 1))


def test_missing_index_and_missing_version(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    (version_dir(root, 1) / "index.json").unlink()
    refused(root, base, r"v000001: no index.json: version 1 was not \(fully\) published")
    shutil.rmtree(version_dir(root, 1))
    refused(root, base, r"v000001: version 1 was not published \(no such directory\)")


def test_malformed_json(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    index = version_dir(root, 1) / "index.json"
    index.write_text(index.read_text()[:-20])  # cut mid-way
    err = refused(root, base, r"index.json: malformed index: not valid JSON")
    assert err.path == str(index)


def _drop(key: str):
    return lambda d: d.pop(key)


def _set(key: str, value: Any):
    return lambda d: d.__setitem__(key, value)


def _set_tensor(key: str, value: Any, name: str = TARGET):
    return lambda d: d["tensors"][name].__setitem__(key, value)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_set("format", "safetensors"), "'format' must be 'miles-weight-delta'"),
        (_set("format_version", 2), "format_version 2 is not supported"),
        (_drop("encoding"), "missing encoding"),
        (_set("surprise", 1), "unexpected surprise"),
        (_set("version", "1"), "'version' must be an integer"),
        (_set("base_version", 1), "base_version 1 must be lower than version 1"),
        (_set("encoding", "diff"), "'encoding' must be a string \\(one of xor, overwrite\\)"),
        (_set("compression", "gzip"), "'compression' must be a string \\(one of zstd\\)"),
        (_set("digest", "md5"), "unknown digest algorithm 'md5'"),
        (_set("tensors", []), "'tensors' must be an object"),
        (
            _set_tensor("dtype", "float128"),
            "tensor 'w.bf16': malformed index: dtype 'float128' is not supported",
        ),
        (_set_tensor("shape", [33, -7]), "shape must be a list of integers >= 0"),
        (_set_tensor("digest", "abc"), "'digest' must be 32 lowercase hex characters"),
        (_set_tensor("base_digest", "Z" * 32), "'base_digest' must be 32 lowercase hex characters"),
        (_set_tensor("offset", -1), "'offset' must be an integer >= 0"),
        (_set_tensor("offset", True), "'offset' must be an integer >= 0"),
        (_set_tensor("length", 10**9), "lies past the end of 'data-00000.bin'"),
        (
            _set_tensor("raw_length", 10**9),
            "raw_length 1000000000 does not fit a payload for bfloat16\\[33, 7\\]",
        ),
        (_set_tensor("file", "data-00009.bin"), "payload file 'data-00009.bin' is not listed in 'files'"),
        (lambda d: d["tensors"][TARGET].pop("file"), "unexpected base_digest, length, offset, raw_length"),
    ],
)
def test_malformed_index_fields(
    published: tuple[Path, dict[str, torch.Tensor]], edit: Any, match: str
) -> None:
    root, base = published
    rewrite_index(version_dir(root, 1), edit)
    err = refused(root, base, match)
    assert err.path == str(version_dir(root, 1) / "index.json")


def test_duplicate_tensor_in_index(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    index = version_dir(root, 1) / "index.json"
    text = index.read_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith('"frozen"'))
    index.write_text(text.replace(line, line.rstrip(",") + ",\n" + line))
    refused(root, base, "malformed index: not valid JSON \\(duplicate key 'frozen'\\)")


def test_index_for_another_version(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    rewrite_index(version_dir(root, 1), _set("version", 2))
    refused(root, base, "index says version 2, expected 1")


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "..", "sub\\dir.bin", "a/b.bin"])
def test_payload_file_name_must_be_plain(published: tuple[Path, dict[str, torch.Tensor]], name: str) -> None:
    root, base = published
    shutil.copy(version_dir(root, 1) / "data-00000.bin", root / "outside.bin")

    def point_elsewhere(doc: dict[str, Any]) -> None:
        doc["files"] = {name: doc["files"]["data-00000.bin"]}
        for entry in doc["tensors"].values():
            if "file" in entry:
                entry["file"] = name

    rewrite_index(version_dir(root, 1), point_elsewhere)
    refused(
        root,
        base,
        re.escape(f"data file name {name!r} is not a plain file name inside the version directory"),
    )


def test_symlink_out_of_the_version_directory(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    data = version_dir(root, 1) / "data-00000.bin"
    outside = root.parent / "elsewhere.bin"
    shutil.move(data, outside)
    data.symlink_to(outside)  # same bytes: only the escape can be wrong
    err = refused(
        root, base, r"data-00000.bin: data file resolves to .*elsewhere.bin, outside the version directory"
    )
    assert err.path == str(data)


def test_symlinked_index_out_of_the_version_directory(
    published: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    root, base = published
    index = version_dir(root, 1) / "index.json"
    outside = root.parent / "index-elsewhere.json"
    shutil.move(index, outside)
    index.symlink_to(outside)
    refused(root, base, "index.json: index is a link that leads outside the version directory")


def test_missing_data_file(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    (version_dir(root, 1) / "data-00000.bin").unlink()
    refused(root, base, "data-00000.bin: data file listed in the index is missing")


def test_tensor_missing_on_the_reader(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    del base["frozen"]
    err = refused(root, base, "v000001: tensor 'frozen': listed in the index but missing on this host")
    assert err.tensor == "frozen"


@pytest.mark.parametrize(
    ("held", "match"),
    [
        (
            torch.zeros(33, 7),
            r"the index has torch.bfloat16 \[33, 7\] but this host holds torch.float32 \[33, 7\]",
        ),
        (
            torch.zeros(7, 33).bfloat16(),
            r"the index has torch.bfloat16 \[33, 7\] but this host holds torch.bfloat16 \[7, 33\]",
        ),
    ],
)
def test_dtype_or_shape_mismatch(
    published: tuple[Path, dict[str, torch.Tensor]], held: torch.Tensor, match: str
) -> None:
    root, base = published
    base[TARGET] = held
    err = refused(root, base, f"tensor 'w.bf16': {match}")
    assert err.tensor == TARGET


def test_host_not_on_the_declared_base(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    root, base = published
    base["w.f32"] = base["w.f32"] + 1  # a changed tensor whose bytes are not the base
    refused(
        root, base, "tensor 'w.f32': this host's bytes .* are not the base the delta was computed against"
    )
    base = make_state()
    base["frozen"] = base["frozen"] * 2  # an unchanged tensor whose bytes are not the writer's
    refused(root, base, "tensor 'frozen': unchanged in this delta, but this host's bytes differ")


def test_result_digest_is_checked(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """An index whose result digest is wrong (or a payload that decodes to other bytes) is refused."""
    root, base = published
    rewrite_index(version_dir(root, 1), _set_tensor("digest", "0" * 32))
    refused(
        root, base, "data-00000.bin: tensor 'w.bf16': the decoded tensor's digest .* does not match the index"
    )


def test_payload_swapped_with_another_tensors(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Valid zstd, wrong content: the f16 tensor's payload pointed at from the bf16 entry."""
    root, base = published
    other = payload_of(root, "w.f16")

    def swap(doc: dict[str, Any]) -> None:
        doc["tensors"][TARGET].update(offset=other["offset"], length=other["length"])

    rewrite_index(version_dir(root, 1), swap)
    err = refused(root, base, "tensor 'w.bf16': (payload at offset|the decoded tensor's digest)")
    assert err.tensor == TARGET


def test_faults_leave_a_good_version_readable(published: tuple[Path, dict[str, torch.Tensor]]) -> None:
    """Sanity check for the fixture: untouched, the same delta reads fine."""
    root, base = published
    assert read_index(root, 1).base_version == 0
    assert read_delta(root, 1, base, 0)
