"""Prompts from a local file: JSON Lines or Parquet, or a dataset shipped with Miles (``builtin:NAME``)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from miles.builtins.data.records import PromptFormat, PromptPool, Where, check_options, map_records
from miles.capabilities import ComponentOptions
from miles.errors import DataError

FORMATS = ("jsonl", "parquet")
_SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}


class FileOptions(ComponentOptions):
    """``data.options`` of the file sources (jsonl, parquet)."""

    format: Literal["jsonl", "parquet"] | None = Field(
        None, description="the file format (default: from the suffix)"
    )


class FileDataSource(PromptPool):
    """A :class:`~miles.interfaces.DataSource` over a ``.jsonl`` or ``.parquet`` file.

    Every record is read and checked when the source is built; a bad one raises a
    DataError naming the file, the line (or row) and the field. ``options`` may hold
    ``format`` (``jsonl`` or ``parquet``) for a file whose suffix says neither.
    """

    Options = FileOptions  # data.options

    def __init__(
        self,
        path: str,
        prompt_key: str = "prompt",
        label_key: str | None = "label",
        metadata_keys: Sequence[str] = (),
        shuffle: bool = True,
        seed: int = 0,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        prompt_template: str = "{prompt}",
        options: dict[str, Any] | None = None,
    ) -> None:
        opts = check_options(options, ["format"], "file")
        fmt = PromptFormat(
            prompt_key, label_key, tuple(metadata_keys), apply_chat_template, system_prompt, prompt_template
        )
        file = resolve_data_path(path)
        kind = opts.get("format") or _SUFFIXES.get(file.suffix.lower())
        if kind not in FORMATS:
            raise DataError(
                f"data file {str(file)!r}: cannot tell its format from the suffix {file.suffix!r}; use .jsonl or "
                ".parquet, or set data.options.format to jsonl or parquet"
            )
        records = read_jsonl(file) if kind == "jsonl" else read_parquet(file)
        self.path = file
        super().__init__(
            map_records(records, fmt), shuffle=shuffle, seed=seed, name=f"data file {str(file)!r}"
        )


def resolve_data_path(path: str) -> Path:
    """A local path, or ``builtin:NAME`` → the file shipped in ``miles/datasets``."""
    if path.startswith("builtin:"):
        return builtin_dataset(path[len("builtin:") :])
    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a directory" if file.is_dir() else "does not exist"
        raise DataError(
            f"data file {path!r} {what}; give a .jsonl or .parquet file, or builtin:NAME ({', '.join(builtin_datasets())})"
        )
    return file


def builtin_datasets() -> list[str]:
    folder = resources.files("miles.datasets")
    return sorted(
        f"builtin:{Path(entry.name).stem}"
        for entry in folder.iterdir()
        if Path(entry.name).suffix in _SUFFIXES
    )


def builtin_dataset(name: str) -> Path:
    folder = resources.files("miles.datasets")
    for candidate in (name, f"{name}.jsonl", f"{name}.parquet"):
        entry = folder / candidate
        if Path(candidate).suffix in _SUFFIXES and entry.is_file():
            return Path(str(entry))
    raise DataError(
        f"unknown built-in dataset {name!r}; available: {', '.join(builtin_datasets()) or 'none'}"
    )


def read_jsonl(file: Path) -> Iterator[tuple[Any, Where]]:
    """Yield ``(record, where)`` for each non-blank line."""
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise DataError(f"data file {str(file)!r} cannot be read: {exc.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad_line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{_where(file, 'line', bad_line)()}: not valid UTF-8 text") from None
    # Split on newlines only: JSON strings may legally hold other line separators (U+2028).
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = _where(file, "line", lineno)
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where()}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        yield record, where


def read_parquet(file: Path) -> Iterator[tuple[Any, Where]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"reading {str(file)!r} needs pyarrow; install it with `pip install 'miles-core[parquet]'`"
        ) from None
    try:
        table = pq.read_table(file)
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise DataError(f"data file {str(file)!r} is not a readable Parquet file: {exc}") from None
    for row, record in enumerate(table.to_pylist()):
        yield record, _where(file, "row index", row)


def _where(file: Path, unit: str, n: int) -> Where:
    return lambda: f"data file {str(file)!r}, {unit} {n}"
