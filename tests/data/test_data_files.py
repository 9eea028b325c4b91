"""FileDataSource: JSON Lines and Parquet records become prompts; bad records fail with file, line and field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from miles.builtins.data.files import FileDataSource
from miles.config.schema import DataSection
from miles.errors import ConfigError, DataError
from miles.interfaces import DataSource


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def all_prompts(source: FileDataSource) -> list:
    return sorted(source.next_prompts(len(source)), key=lambda p: p.index)


def test_records_become_chat_prompts_with_labels_and_metadata(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "d.jsonl",
        [{"prompt": "2+2=", "label": "4", "id": "a"}, {"prompt": "3+3=", "label": 6, "id": "b", "extra": 1}],
    )
    source = FileDataSource(
        str(f), metadata_keys=["id"], system_prompt="Be brief.", prompt_template="Q: {prompt}", shuffle=False
    )
    assert isinstance(source, DataSource) and len(source) == 2
    first, second = source.next_prompts(2)
    assert first.index == 0 and first.label == "4" and first.metadata == {"id": "a"}
    assert first.prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 2+2="},
    ]
    assert second.label == "6"  # numbers are kept as their text


def test_plain_text_prompts_and_unlabeled_data(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "d.jsonl", [{"text": "hello"}, "", {"text": "world"}]
    )  # blank lines are skipped
    source = FileDataSource(
        str(f), prompt_key="text", label_key=None, apply_chat_template=False, shuffle=False
    )
    assert [(p.index, p.prompt, p.label) for p in source.next_prompts(2)] == [
        (0, "hello", None),
        (1, "world", None),
    ]


def test_chat_message_prompts(tmp_path: Path) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "7"},
    ]
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": messages, "label": "x"}])
    (p,) = FileDataSource(str(f), system_prompt="S", prompt_template="[{prompt}]").next_prompts(1)
    assert p.prompt == [{"role": "system", "content": "S"}, *messages[:2], {"role": "user", "content": "[7]"}]
    with pytest.raises(
        DataError, match=r"line 1: field 'prompt' is a list of chat messages but data.apply_chat_template"
    ):
        FileDataSource(str(f), apply_chat_template=False)


@pytest.mark.parametrize(
    ("rows", "kwargs", "pattern"),
    [
        ([{"prompt": "a", "label": "1"}, "{oops", {"prompt": "b"}], {}, r"d\.jsonl', line 2: invalid JSON"),
        (
            [{"prompt": "a", "label": "1"}, {"question": "b", "label": "2"}],
            {},
            r"line 2: missing field 'prompt'.*fields: question, label",
        ),
        (
            [{"prompt": 5, "label": "1"}],
            {},
            r"line 1: field 'prompt' must be a string or a list of chat messages, got int",
        ),
        ([{"prompt": "a"}], {}, r"line 1: missing field 'label' \(data.label_key; set it to null"),
        (
            [{"prompt": "a", "label": ["1"]}],
            {},
            r"line 1: field 'label' must be a string or a number, got list",
        ),
        (
            [{"prompt": "a", "label": "1"}],
            {"metadata_keys": ["source"]},
            r"line 1: missing field 'source' \(listed in data.metadata_keys\)",
        ),
        (
            [{"prompt": [{"content": "x"}], "label": "1"}],
            {},
            r"line 1: field 'prompt\[0\]' needs a string 'role'",
        ),
        ([{"prompt": "   ", "label": "1"}], {}, r"line 1: field 'prompt' is empty"),
        ([[1, 2]], {}, r"line 1: expected an object with a 'prompt' field, got list"),
    ],
)
def test_bad_records_name_file_line_and_field(tmp_path: Path, rows, kwargs, pattern) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=pattern):
        FileDataSource(str(f), **kwargs)


def test_bad_files_and_settings(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"'.*missing\.jsonl' does not exist.*builtin:arith"):
        FileDataSource(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="is a directory"):
        FileDataSource(str(tmp_path))
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="holds no prompts"):
        FileDataSource(str(empty))
    odd = write_jsonl(tmp_path / "d.txt", [{"prompt": "a", "label": "1"}])
    with pytest.raises(DataError, match=r"cannot tell its format.*data.options.format"):
        FileDataSource(str(odd))
    assert len(FileDataSource(str(odd), options={"format": "jsonl"})) == 1
    with pytest.raises(ConfigError, match=r"data.options: unknown key\(s\) limit.*allowed: format"):
        FileDataSource(str(odd), options={"limit": 3})
    with pytest.raises(ConfigError, match=r"prompt_template .* may only use \{prompt\}"):
        FileDataSource(str(odd), options={"format": "jsonl"}, prompt_template="{question}")
    with pytest.raises(ConfigError, match=r"system_prompt is set but data\.apply_chat_template is false"):
        FileDataSource(str(odd), options={"format": "jsonl"}, system_prompt="x", apply_chat_template=False)
    bad_utf8 = tmp_path / "b.jsonl"
    bad_utf8.write_bytes(b'{"prompt": "a", "label": "1"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match="line 2: not valid UTF-8"):
        FileDataSource(str(bad_utf8))


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "label": ["2", "4"]}), f)
    source = FileDataSource(str(f), shuffle=False)
    assert [(p.prompt[-1]["content"], p.label) for p in source.next_prompts(2)] == [
        ("1+1=", "2"),
        ("2+2=", "4"),
    ]
    pq.write_table(pa.table({"prompt": ["ok", None], "label": ["2", "4"]}), f)
    with pytest.raises(DataError, match=r"d\.parquet', row index 1: field 'prompt' must be a string"):
        FileDataSource(str(f))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        FileDataSource(str(tmp_path / "junk.parquet"))


def test_the_recipe_data_section_maps_onto_the_constructor(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", [{"q": "a", "a": "1"}])
    section = DataSection(path=str(f), prompt_key="q", label_key="a", seed=3, system_prompt="S")
    source = FileDataSource(**section.model_dump(exclude={"source"}))
    (p,) = source.next_prompts(1)
    assert p.label == "1" and p.prompt[0] == {"role": "system", "content": "S"}


def test_handed_out_prompts_are_copies(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "label": "1"}])
    source = FileDataSource(str(f))
    (p,) = source.next_prompts(1)
    p.prompt[0]["content"] = "changed"
    p.metadata["x"] = 1
    (again,) = source.next_prompts(1)
    assert again.prompt[0]["content"] == "a" and again.metadata == {}
