"""Prompts from a Hugging Face ``datasets`` dataset (a local ``save_to_disk`` folder or a cached hub id)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field

from miles.builtins.data.records import PromptFormat, PromptPool, Where, check_options, map_records
from miles.capabilities import ComponentOptions
from miles.errors import DataError


class HFOptions(ComponentOptions):
    """``data.options`` of the ``hf`` source: passed to ``datasets.load_dataset``."""

    split: str = Field("train", description="the split to read")
    name: str | None = Field(None, description="the dataset's configuration name")
    revision: str | None = Field(None, description="a git revision of the dataset repository")
    data_dir: str | None = Field(None, description="data_dir of load_dataset")
    data_files: str | list[str] | dict[str, Any] | None = Field(
        None, description="data_files of load_dataset"
    )


_OPTIONS = tuple(HFOptions.model_fields)


class HFDataSource(PromptPool):
    """A :class:`~miles.interfaces.DataSource` over one split of a ``datasets`` dataset.

    ``path`` is a folder written by ``Dataset.save_to_disk`` or anything
    ``datasets.load_dataset`` accepts (a hub id must already be in the local cache:
    nothing is downloaded on machines without a hub). ``options``: ``split``
    (default ``train``), ``name`` (the dataset config), ``revision``, ``data_dir``, ``data_files``.
    """

    Options = HFOptions  # data.options

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
        opts = check_options(options, _OPTIONS, "hf")
        fmt = PromptFormat(
            prompt_key, label_key, tuple(metadata_keys), apply_chat_template, system_prompt, prompt_template
        )
        split = opts.pop("split", "train")
        dataset = _load(path, split, opts)
        label = f"dataset {path!r} (split {split!r})"
        super().__init__(map_records(_rows(dataset, label), fmt), shuffle=shuffle, seed=seed, name=label)


def _load(path: str, split: str, opts: dict[str, Any]) -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError(
            "data source 'hf' needs the datasets package; install it with `pip install 'miles-core[datasets]'`"
        ) from None
    local = Path(path).expanduser()
    try:
        if local.is_dir() and (
            (local / "dataset_info.json").is_file() or (local / "dataset_dict.json").is_file()
        ):
            loaded = datasets.load_from_disk(str(local))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(f"dataset {path!r} has no split {split!r}; splits: {', '.join(loaded)}")
                loaded = loaded[split]
            return loaded
        return datasets.load_dataset(path, split=split, **opts)
    except DataError:
        raise
    except Exception as exc:  # datasets raises many types (FileNotFoundError, ConnectionError, ValueError...)
        raise DataError(f"cannot load dataset {path!r} (split {split!r}): {exc}") from None


def _rows(dataset: Any, label: str) -> Iterator[tuple[Any, Where]]:
    for i, row in enumerate(dataset):
        yield row, _row_where(label, i)


def _row_where(label: str, i: int) -> Where:
    return lambda: f"{label}, row index {i}"
