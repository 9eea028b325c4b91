"""The example plugin's components behave as documented (and reach miles through entry points)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miles.config import load_recipe
from miles.interfaces import LossInputs
from miles.plugins import build_plugin_manager, load_component, make_component
from miles.types import Prompt, Sample

torch.set_num_threads(1)

pytestmark = pytest.mark.usefixtures("fixture_plugins")  # installs tests/plugins/miles-example-plugin

TINY = str(Path(__file__).parent / "data" / "recipes" / "tiny.yaml")


def _sample(n_tokens: int | None = None, text: str = "") -> Sample:
    ids = list(range(n_tokens)) if n_tokens is not None else []
    return Sample(prompt=Prompt(index=0, prompt="q"), response_ids=ids, response_text=text)


@pytest.mark.parametrize(
    ("length", "reward"), [(0, 1.0), (8, 1.0), (9, 0.9), (13, 0.5), (18, 0.0), (40, 0.0)]
)
def test_length_penalty_reward(length: int, reward: float) -> None:
    score = load_component("reward", "length_penalty")
    assert score(_sample(length)) == pytest.approx(reward)


def test_length_penalty_counts_words_when_there_are_no_token_ids() -> None:
    score = load_component("reward", "length_penalty")
    assert score(_sample(text=" ".join(["w"] * 10))) == pytest.approx(0.8)


def test_the_example_section_sets_the_target(monkeypatch: pytest.MonkeyPatch) -> None:
    import miles_example_plugin  # importable only once the fixture installed it

    monkeypatch.setattr(miles_example_plugin, "target_length", 8)  # restored after the test
    pm = build_plugin_manager(strict=False, disabled=["broken"])
    config = load_recipe(TINY, ["example.target_length=4"], pm=pm)
    assert config.example.target_length == 4
    pm.hook.miles_configure.call_historic(kwargs={"config": config})
    assert load_component("reward", "length_penalty")(_sample(6)) == pytest.approx(0.8)


def _inputs(**overrides: object) -> LossInputs:
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -4.0]], requires_grad=True)
    values = dict(
        logprobs=logprobs,
        old_logprobs=logprobs.detach(),
        rollout_logprobs=logprobs.detach(),
        advantages=torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, -2.0]]),
        loss_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        num_loss_tokens=5,
    )
    values.update(overrides)
    return LossInputs(**values)  # type: ignore[arg-type]


def test_reinforce_loss_value_and_gradient() -> None:
    loss_fn = make_component("loss", "reinforce")
    inputs = _inputs()
    out = loss_fn(inputs)
    # -(A * logp * mask).sum() / 5 = -(1*(-1) + 1*(-2) + (-2)*(-0.3) + (-2)*(-0.7) + (-2)*(-4)) / 5
    expected = -(-1.0 - 2.0 + 0.6 + 1.4 + 8.0) / 5
    assert out.loss.item() == pytest.approx(expected)
    assert out.metrics["pg_loss"] == pytest.approx(expected)
    out.loss.backward()
    grad = inputs.logprobs.grad
    assert torch.allclose(grad, -inputs.advantages * inputs.loss_mask / 5)
    assert grad[0, 2] == 0  # masked token: no gradient


def test_reinforce_loss_applies_correction_weights() -> None:
    weights = torch.tensor([[0.5, 2.0, 1.0], [1.0, 0.0, 1.0]])
    inputs = _inputs(correction_weights=weights)
    make_component("loss", "reinforce")(inputs).loss.backward()
    assert torch.allclose(inputs.logprobs.grad, -inputs.advantages * inputs.loss_mask * weights / 5)


def test_reinforce_micro_batches_add_up_to_the_global_token_mean() -> None:
    loss_fn = make_component("loss", "reinforce")
    whole = _inputs()
    halves = [
        LossInputs(
            **{k: (v[i : i + 1] if isinstance(v, torch.Tensor) else v) for k, v in vars(whole).items()}
        )
        for i in range(2)
    ]
    assert sum(loss_fn(h).loss.item() for h in halves) == pytest.approx(loss_fn(whole).loss.item())
