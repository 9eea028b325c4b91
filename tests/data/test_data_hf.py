"""HFDataSource over a real ``datasets`` dataset, or one clear error when the package is missing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from miles.builtins.data.hf import HFDataSource
from miles.errors import ConfigError, DataError


def test_without_datasets_the_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # what an environment without the package looks like
    with pytest.raises(DataError, match=r"needs the datasets package.*miles-core\[datasets\]"):
        HFDataSource("some/dataset")


def test_unknown_options_are_refused_before_loading() -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) streaming.*allowed: split, name"):
        HFDataSource("x", options={"streaming": True})


def test_a_saved_dataset_maps_like_a_file(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"{i}+1=", "answer": str(i + 1), "level": i % 2} for i in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    source = HFDataSource(
        str(tmp_path / "dd"), prompt_key="question", label_key="answer", metadata_keys=["level"], seed=4
    )
    assert len(source) == 5
    prompts = sorted(source.next_prompts(5), key=lambda p: p.index)
    assert [(p.prompt[-1]["content"], p.label, p.metadata) for p in prompts[:2]] == [
        ("0+1=", "1", {"level": 0}),
        ("1+1=", "2", {"level": 1}),
    ]
    other = HFDataSource(str(tmp_path / "dd"), prompt_key="question", label_key="answer", seed=4)
    other.load_state_dict(source.state_dict())
    assert [p.index for p in other.next_prompts(7)] == [p.index for p in source.next_prompts(7)]
    with pytest.raises(DataError, match=r"has no split 'test'; splits: train"):
        HFDataSource(
            str(tmp_path / "dd"), prompt_key="question", label_key="answer", options={"split": "test"}
        )
    with pytest.raises(DataError, match=r"split 'train'\), row index 0: missing field 'prompt'"):
        HFDataSource(str(tmp_path / "dd"))
    datasets.Dataset.from_list(rows).to_json(str(tmp_path / "rows.jsonl"))
    via_builder = HFDataSource(
        "json",
        label_key="answer",
        prompt_key="question",
        options={"data_files": str(tmp_path / "rows.jsonl")},
    )
    assert len(via_builder) == 5
