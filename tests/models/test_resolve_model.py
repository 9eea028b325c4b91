"""resolve_model: builtin:NAME builds into the cache; a plain path must really be a model."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from miles.errors import ModelError
from miles.models.cache import build_atomically, cache_root
from miles.models.registry import BUILTIN_MODELS, builtin_path, resolve_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_cache_location_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c" / "models"
    monkeypatch.delenv("MILES_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "miles" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "miles" / "models"


def test_builtin_is_built_once_then_reused(cache: Path) -> None:
    pytest.importorskip("transformers")
    path = resolve_model("builtin:tiny-qwen3")
    assert Path(path) == cache / "tiny-qwen3" == builtin_path("tiny-qwen3")
    weights = Path(path) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert resolve_model("builtin:tiny-qwen3") == path
    assert weights.stat().st_mtime_ns == stamp
    assert resolve_model(path) == str(Path(path).resolve())  # and the folder passes the plain-path check
    assert not [p for p in cache.iterdir() if p.name.startswith(".tiny-qwen3.building")]


def test_unknown_builtin_suggests_a_name(cache: Path) -> None:
    with pytest.raises(ModelError, match=r"unknown built-in model 'tiny-qwen'.*did you mean 'tiny-qwen3'"):
        resolve_model("builtin:tiny-qwen")
    with pytest.raises(ModelError, match="known: " + ", ".join(BUILTIN_MODELS)):
        resolve_model("builtin:")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"does not exist.*builtin:NAME"):
        resolve_model(str(tmp_path / "nope"))


def test_a_file_is_not_a_model(tmp_path: Path) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ModelError, match="is a file"):
        resolve_model(str(f))


def test_a_directory_that_is_not_a_model_gives_one_error_naming_everything_missing(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelError) as info:
        resolve_model(str(tmp_path))
    msg = str(info.value)
    assert "is not a Hugging Face model directory" in msg
    assert "config.json" in msg and "weight files" in msg
    assert "model.gguf, notes.txt" in msg and "converted" in msg


def test_config_without_weights_and_weights_without_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=r"missing weight files") as info:
        resolve_model(str(tmp_path))
    assert "config.json and" not in str(info.value)
    (tmp_path / "config.json").unlink()
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match=r"missing config\.json;"):
        resolve_model(str(tmp_path))


def test_bad_config_and_missing_shards(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match=r"config\.json is not valid JSON"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").unlink()
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ModelError, match=r"weight shards model-00002-of-00002\.safetensors listed in"):
        resolve_model(str(tmp_path))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert resolve_model(str(tmp_path)) == str(tmp_path.resolve())


def test_concurrent_builders_build_once(tmp_path: Path) -> None:
    dest = tmp_path / "m"
    calls: list[int] = []

    def slow_build(tmp: Path) -> None:
        calls.append(1)
        time.sleep(0.3)
        (tmp / "config.json").write_text("{}")

    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(build_atomically(dest, slow_build))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [dest] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_a_failed_build_leaves_nothing_behind_and_force_replaces(tmp_path: Path) -> None:
    dest = tmp_path / "m"

    def broken(tmp: Path) -> None:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        build_atomically(dest, broken)
    assert not dest.exists()
    assert [p.name for p in tmp_path.iterdir()] == [".m.lock"]

    build_atomically(dest, lambda tmp: (tmp / "v").write_text("1"))
    build_atomically(dest, lambda tmp: (tmp / "v").write_text("2"))  # exists: not rebuilt
    assert (dest / "v").read_text() == "1"
    build_atomically(dest, lambda tmp: (tmp / "v").write_text("3"), force=True)
    assert (dest / "v").read_text() == "3"
    with pytest.raises(RuntimeError):
        build_atomically(dest, broken, force=True)
    assert (dest / "v").read_text() == "3"  # a failed rebuild keeps the old model
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]
