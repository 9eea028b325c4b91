"""``miles run tiny_flow_grpo_lora`` through the core CLI: a LoRA adapter trained on the denoiser, each
weight update exactly the adapter's bytes, merged by the engine on arrival, the export a peft adapter.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.config import load_recipe
from miles.models.registry import resolve_model
from miles_diffusion import lora as lora_mod
from miles_diffusion.model import load_pretrained

from ._cli_runs import LORA_RESUMED_METRICS, metric_rows, miles

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path, Any]:
    """Two steps of the recipe, a checkpoint after each: (the CLI arguments, the run directory, the result)."""
    out = tmp_path_factory.mktemp("lora-run")
    overrides = [
        f"run.output_dir={out}",
        "run.num_steps=2",
        "run.save_every=1",
        "tracking.console=false",
        "engine.options.torch_threads=1",
        "diffusion.torch_threads=1",
    ]
    args = ["run", "tiny_flow_grpo_lora", *(a for o in overrides for a in ("--set", o))]
    return args, out / "tiny_flow_grpo_lora", miles(*args)


def test_a_lora_flow_grpo_run_sends_only_the_adapter(lora_run: tuple[list[str], Path, Any]) -> None:
    _, run_dir, result = lora_run
    assert "recipe tiny_flow_grpo_lora: evidence level" in result.stderr
    rows = metric_rows(run_dir)
    assert [r["engine/weight_version"] for r in rows] == [1, 2]

    # The adapter's size, from the recipe's lora section on the base, independently of the run.
    config = load_recipe("tiny_flow_grpo_lora", [])
    assert config.lora is not None
    base_path = resolve_model(config.model.path)
    peft_model = lora_mod.wrap(load_pretrained(base_path), config.lora, base_path)
    adapter = sum(p.numel() * p.element_size() for n, p in peft_model.named_parameters() if p.requires_grad)
    full = sum(p.numel() * p.element_size() for p in load_pretrained(base_path).parameters())
    assert adapter == 92640 and full == 659276
    assert [r["weight_sync/bytes"] for r in rows] == [adapter] * 2  # every update: the adapter, whole, alone
    for r in rows:
        assert 0.0 < r["rollout/reward_mean"] < 1.0 and math.isfinite(r["rollout/reward_std"])
        assert r["train/grad_norm"] > 0 and r["train/logprob_mismatch_max"] < 1e-5
        assert r["rollout/groups_kept"] == 4

    # The final output is a peft adapter directory that loads onto the base.
    final = run_dir / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(load_pretrained(base_path), str(final))
    b = [p for n, p in loaded.named_parameters() if ".lora_B." in n]
    assert len(b) == 26 and any(
        float(p.detach().abs().max()) > 0 for p in b
    )  # trained, not the initial B = 0
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        assert not torch.equal(
            loaded(x, torch.tensor([0.5]), torch.tensor([1])),
            load_pretrained(base_path)(x, torch.tensor([0.5]), torch.tensor([1])),
        )


def test_a_lora_run_resumes_its_adapter_exactly(lora_run: tuple[list[str], Path, Any]) -> None:
    """From step 1's checkpoint: the engine restarts with the initial adapter, the checkpoint's adapter
    is sent and merged before it generates, and step 1 is redone bit for bit."""
    args, run_dir, _ = lora_run
    before = metric_rows(run_dir)
    assert (
        run_dir / "checkpoints" / "step_000001" / "trainer" / "adapter" / "adapter_model.safetensors"
    ).is_file()
    (run_dir / "checkpoints" / "latest").write_text("step_000001")
    miles(*args, "--resume")
    after = metric_rows(run_dir)
    assert [r["step"] for r in after] == [0, 1]
    assert {k: after[1][k] for k in LORA_RESUMED_METRICS} == {k: before[1][k] for k in LORA_RESUMED_METRICS}
