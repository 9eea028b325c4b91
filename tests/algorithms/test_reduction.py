"""masked_reduce: token and sample means over the global batch, split-invariant, blind to padding."""

from __future__ import annotations

import pytest

from miles.builtins.algorithms.reduction import check_reduction, masked_mean, masked_reduce
from miles.errors import ConfigError
from miles.interfaces import LossInputs

torch = pytest.importorskip("torch")

NAN, INF = float("nan"), float("inf")

# Global batch of 3 samples (rows), 5 loss tokens:
#   row 0: x = [1, 2, ·]  m = [1, 1, 0]  sum 3,  n = 2
#   row 1: x = [4, 5, 6]  m = [1, 1, 1]  sum 15, n = 3
#   row 2: x = [·, ·, ·]  m = [0, 0, 0]  sum 0,  n = 0 (contributes 0, no division by zero)
# token_mean  = (3 + 15) / 5 = 3.6
# sample_mean = (3/2 + 15/3 + 0) / 3 = 6.5 / 3
X = [[1.0, 2.0, NAN], [4.0, 5.0, 6.0], [INF, -INF, NAN]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
TOKEN_MEAN = 3.6
SAMPLE_MEAN = 6.5 / 3
GLOBAL = LossInputs(loss_mask=torch.tensor(MASK), num_loss_tokens=5, num_samples=3)


def test_token_mean_and_sample_mean_of_the_whole_batch() -> None:
    x = torch.tensor(X, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK)
    assert masked_reduce(x, mask, GLOBAL, "token_mean").item() == pytest.approx(TOKEN_MEAN)
    out = masked_reduce(x, mask, GLOBAL, "sample_mean")
    assert out.item() == pytest.approx(SAMPLE_MEAN)
    out.backward()
    # d/dx_it = m_it / (n_i * S): row 0 -> 1/(2*3), row 1 -> 1/(3*3); padding gets exactly 0, never nan.
    assert x.grad.flatten().tolist() == pytest.approx([1 / 6, 1 / 6, 0.0, 1 / 9, 1 / 9, 1 / 9, 0.0, 0.0, 0.0])


@pytest.mark.parametrize(("mode", "expected"), [("token_mean", TOKEN_MEAN), ("sample_mean", SAMPLE_MEAN)])
@pytest.mark.parametrize("split", [[1, 2], [2, 1], [1, 1, 1]])
def test_micro_batch_losses_add_up_to_the_global_formula(
    mode: str, expected: float, split: list[int]
) -> None:
    # Each micro-batch holds whole rows and divides by the *global* counts (5 tokens, 3 samples).
    x = torch.tensor(X, dtype=torch.float64)
    mask = torch.tensor(MASK)
    total, start = 0.0, 0
    for size in split:
        rows = slice(start, start + size)
        micro = LossInputs(loss_mask=mask[rows], num_loss_tokens=5, num_samples=3)
        total += masked_reduce(x[rows], mask[rows], micro, mode).item()
        start += size
    assert total == pytest.approx(expected)


def test_token_and_sample_mean_differ_on_rows_of_different_length() -> None:
    # Row 0 has 1 token of value 4, row 1 has 3 tokens of value 0.
    # token_mean = 4 / 4 = 1; sample_mean = (4/1 + 0/3) / 2 = 2: the short row weighs as much as the long one.
    x = torch.tensor([[4.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    inputs = LossInputs(loss_mask=mask, num_loss_tokens=4, num_samples=2)
    assert masked_reduce(x, mask, inputs, "token_mean").item() == pytest.approx(1.0)
    assert masked_reduce(x, mask, inputs, "sample_mean").item() == pytest.approx(2.0)


def test_masked_mean_for_metrics() -> None:
    # (1 + 2 + 4 + 5 + 6) / 5 = 3.6, padding ignored; no loss tokens -> 0.
    assert masked_mean(torch.tensor(X), torch.tensor(MASK)) == pytest.approx(3.6)
    assert masked_mean(torch.tensor([[NAN]]), torch.tensor([[0.0]])) == 0.0


def test_bad_mode_and_shapes() -> None:
    with pytest.raises(
        ConfigError, match="ppo_clip: reduction must be one of token_mean, sample_mean, got 'sum'"
    ):
        check_reduction("sum", "ppo_clip")
    assert check_reduction("sample_mean", "sft") == "sample_mean"
    mask = torch.tensor(MASK)
    with pytest.raises(ValueError, match="mode must be one of"):
        masked_reduce(torch.zeros(3, 3), mask, GLOBAL, "sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"per_token has shape \(3, 2\), mask \(3, 3\)"):
        masked_reduce(torch.zeros(3, 2), mask, GLOBAL, "token_mean")
