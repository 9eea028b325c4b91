"""Prompt order: seeded per-epoch shuffles, put-back first, and exact resumption from a state dict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.builtins.data.files import FileDataSource
from miles.errors import DataError

N = 7


@pytest.fixture
def data_file(tmp_path: Path) -> Path:
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"p{i}", "label": str(i)}) + "\n" for i in range(N)))
    return f


def indices(prompts) -> list[int]:
    return [p.index for p in prompts]


def test_each_epoch_is_a_seeded_permutation(data_file: Path) -> None:
    a = FileDataSource(str(data_file), seed=5)
    epochs = [indices(a.next_prompts(N)) for _ in range(4)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(N))  # no prompt lost or repeated within an epoch
    assert len({tuple(e) for e in epochs}) > 1  # reshuffled per epoch
    b = FileDataSource(str(data_file), seed=5)
    assert [indices(b.next_prompts(N)) for _ in range(4)] == epochs
    c = FileDataSource(str(data_file), seed=6)
    assert [indices(c.next_prompts(N)) for _ in range(4)] != epochs
    d = FileDataSource(str(data_file), shuffle=False)
    assert indices(d.next_prompts(10)) == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]


def test_requests_cross_epoch_boundaries(data_file: Path) -> None:
    whole = indices(FileDataSource(str(data_file), seed=1).next_prompts(3 * N))
    source = FileDataSource(str(data_file), seed=1)
    pieces = [indices(source.next_prompts(k)) for k in (3, 5, 0, 6, 7)]
    assert [i for piece in pieces for i in piece] == whole
    assert source.state_dict() == {"epoch": 3, "offset": 0, "retry": [], "num_prompts": N}
    assert source.next_prompts(0) == []


def test_put_back_returns_prompts_to_the_front(data_file: Path) -> None:
    source = FileDataSource(str(data_file), shuffle=False)
    first = source.next_prompts(3)
    source.put_back(first[1:])
    source.put_back(first[:1])  # the latest put-back goes first
    assert indices(source.next_prompts(4)) == [0, 1, 2, 3]
    with pytest.raises(DataError, match=r"put_back: prompt indices \[99\] are not from this data source"):
        source.put_back([type(first[0])(index=99, prompt="x")])


def test_resuming_from_a_state_dict_continues_the_exact_sequence(data_file: Path) -> None:
    plan = [3, 4, "back", 6, 2, "back", 5, 9, 1, 7, 8]

    def run(source: FileDataSource, steps: list, resume_at: int | None = None) -> list[int]:
        out: list[int] = []
        for n, step in enumerate(steps):
            if resume_at is not None and n == resume_at:
                state = json.loads(json.dumps(source.state_dict()))  # what a checkpoint stores
                source = FileDataSource(str(data_file), seed=11)
                source.load_state_dict(state)
            if step == "back":
                source.put_back(source.next_prompts(2))
                out.append(-1)
            else:
                out.extend(indices(source.next_prompts(step)))
        return out

    reference = run(FileDataSource(str(data_file), seed=11), plan)
    for resume_at in range(len(plan)):
        assert run(FileDataSource(str(data_file), seed=11), plan, resume_at) == reference
    # Across a resume in the middle of an epoch, that epoch still hands out every prompt exactly once.
    source = FileDataSource(str(data_file), seed=11)
    head = indices(source.next_prompts(3))
    resumed = FileDataSource(str(data_file), seed=11)
    resumed.load_state_dict(source.state_dict())
    assert sorted(head + indices(resumed.next_prompts(N - 3))) == list(range(N))


def test_a_retry_queue_survives_a_resume(data_file: Path) -> None:
    source = FileDataSource(str(data_file), seed=2)
    taken = source.next_prompts(3)
    source.put_back(taken[:2])
    state = source.state_dict()
    assert state["retry"] == indices(taken[:2])
    resumed = FileDataSource(str(data_file), seed=2)
    resumed.load_state_dict(state)
    assert indices(resumed.next_prompts(5)) == indices(source.next_prompts(5))


def test_a_state_from_another_dataset_is_refused(data_file: Path, tmp_path: Path) -> None:
    source = FileDataSource(str(data_file))
    with pytest.raises(DataError, match=r"checkpoint was taken over 9 prompts, the data now has 7"):
        source.load_state_dict({"epoch": 0, "offset": 0, "retry": [], "num_prompts": 9})
    with pytest.raises(DataError, match="lacks epoch/offset/retry/num_prompts"):
        source.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="bad position"):
        source.load_state_dict({"epoch": 0, "offset": 8, "retry": [], "num_prompts": N})
    with pytest.raises(DataError, match="not from this data source"):
        source.load_state_dict({"epoch": 0, "offset": 0, "retry": [12], "num_prompts": N})
