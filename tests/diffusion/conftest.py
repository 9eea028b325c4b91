from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

# miles-diffusion needs diffusers; where it is missing (the GPU machine carries no wheel of it) the
# directory is skipped with the reason instead of failing at collection.
pytest.importorskip("diffusers", reason="miles-diffusion needs diffusers (pip install miles-diffusion)")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Torch on one thread: the engineers' machine is shared, and the standards were made so."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
