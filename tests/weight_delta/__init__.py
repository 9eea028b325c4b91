"""Shared helpers for the disk-delta format tests: small mixed-dtype states and index surgery."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small state with every shape the format must handle, odd sizes included."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w.f32": torch.randn(8, 16, generator=g),
        "w.bf16": torch.randn(33, 7, generator=g).bfloat16(),
        "w.f16": torch.randn(65, generator=g).half(),
        "ids.i64": torch.randint(-(2**40), 2**40, (4, 3), generator=g),
        "scale": torch.tensor(0.5),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "frozen": torch.randn(16, generator=g).bfloat16(),
    }


def step(state: dict[str, torch.Tensor], seed: int, fraction: float = 0.3) -> dict[str, torch.Tensor]:
    """The next state: about ``fraction`` of each trainable tensor's elements move; ``frozen`` never does."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, t in state.items():
        new = t.clone()
        if name != "frozen" and t.numel():
            pick = torch.rand(t.shape, generator=g) < fraction
            if not pick.any():
                pick.view(-1)[0] = True
            if t.is_floating_point():
                noise = torch.randn(t.shape, generator=g).to(t.dtype)
                new = torch.where(pick, t + noise, t)
            else:
                new = torch.where(pick, t + 1, t)
        out[name] = new
    return out


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Bit-exact equality of two states (dtype, shape and bytes)."""
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


def apply(current: dict[str, torch.Tensor], changed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an engine does with ``read_delta``'s answer: swap the changed tensors in."""
    return {**current, **changed}


def rewrite_index(vdir: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Load ``vdir/index.json``, let ``edit`` change it in place, write it back."""
    path = vdir / "index.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
