"""``miles run sd3_flow_grpo_proxy_lora`` / ``wan_flow_grpo_proxy_lora`` through the core CLI: a LoRA
adapter on the pipeline's transformer, each weight update exactly the adapter's factor bytes, merged
by the engine on arrival, the engine-trainer gap 0, checkpoints of the adapter that ``--resume``
continues exactly, and an export that loads onto the base transformer with peft (and that an engine
merges as ``W_base + alpha/r * B A``: the fleet's catch-up of a restarted engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from miles.config import load_recipe
from miles.models.registry import resolve_model
from miles_diffusion import lora as lora_mod
from miles_diffusion.engine.server import DiffusionEngine, LoadLoraBody
from miles_diffusion.families import load_model

from ._cli_runs import LORA_RESUMED_METRICS, metric_rows, miles

pytestmark = pytest.mark.slow

PIPELINE_CLASS = {
    "sd3_flow_grpo_proxy_lora": "StableDiffusion3Pipeline",
    "wan_flow_grpo_proxy_lora": "WanPipeline",
}
TRANSFORMER_CLASS = {
    "sd3_flow_grpo_proxy_lora": "SD3Transformer2DModel",
    "wan_flow_grpo_proxy_lora": "WanTransformer3DModel",
}


@pytest.fixture(scope="module", params=sorted(TRANSFORMER_CLASS))
def lora_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[str], Path, Any]:
    """Two steps of the recipe, a checkpoint after each: (recipe, the CLI arguments, the run directory, the result)."""
    recipe = str(request.param)
    out = tmp_path_factory.mktemp(recipe)
    overrides = [f"run.output_dir={out}", "run.num_steps=2", "run.save_every=1", "tracking.console=false"]
    args = ["run", recipe, *(a for o in overrides for a in ("--set", o))]
    return recipe, args, out / recipe, miles(*args)


def _transformer(recipe: str, path: str) -> torch.nn.Module:
    import diffusers

    cls = getattr(diffusers, TRANSFORMER_CLASS[recipe])
    module: torch.nn.Module = cls.from_pretrained(path, subfolder="transformer")
    return module.eval()


def test_a_pipeline_lora_run_sends_only_the_adapter_and_exports_a_peft_adapter(
    lora_run: tuple[str, list[str], Path, Any],
) -> None:
    recipe, _, run_dir, result = lora_run
    assert f"recipe {recipe}: evidence level" in result.stderr
    rows = metric_rows(run_dir)
    assert [r["engine/weight_version"] for r in rows] == [1, 2]
    # The engine-trainer gap: 0 at step 0 (B = 0: the base exactly on both sides); later the engine
    # samples with the merged W + s B A and the trainer computes W x + s B (A x), which round apart
    # by a few float32 ulps (at most 2.4e-7 over the 40-step curves, as on the tiny UNet).
    assert rows[0]["train/logprob_mismatch_max"] == 0.0
    assert all(r["train/logprob_mismatch_max"] <= 1e-6 for r in rows)

    # The adapter's factor bytes, from the recipe's lora section on the base, independently of the run.
    config = load_recipe(recipe, [])
    assert config.lora is not None
    path = resolve_model(config.model.path)
    prompts = tuple(config.rollout.options["prompts"])
    model = load_model(path, prompts=prompts)
    full = sum(p.numel() * p.element_size() for p in model.transformer.parameters())
    lora_mod.wrap(model, config.lora, path)
    adapter = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad)
    assert 0 < adapter < full / 5
    assert [r["weight_sync/bytes"] for r in rows] == [adapter] * 2  # every update: the adapter, whole, alone
    for r in rows:
        assert r["train/grad_norm"] > 0 and r["rollout/groups_kept"] == 4

    # Checkpoints hold the adapter and no transformer.
    step = run_dir / "checkpoints" / "step_000001" / "trainer"
    assert (step / "adapter" / "adapter_model.safetensors").is_file() and not (step / "transformer").exists()

    # The export: a peft adapter directory that loads onto the base's bare transformer.
    final = run_dir / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model_index.json").exists()
    assert (final / lora_mod.DIFFUSERS_WEIGHTS).is_file()
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(_transformer(recipe, path), str(final))
    b = [p for n, p in loaded.named_parameters() if ".lora_B." in n]
    assert b and any(float(p.detach().abs().max()) > 0 for p in b)  # trained, not the initial B = 0
    merged_by_peft = loaded.merge_and_unload().state_dict()

    # An engine on the base that merges the export (the fleet's catch-up): every adapted weight is
    # W_base + alpha/r * B A of the exported factors, peft's merge agrees, the rest is the base bit for bit.
    engine = DiffusionEngine(path)
    base = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.load_lora(LoadLoraBody(lora_name=config.lora.name, lora_path=str(final)))
    merged = engine.model.state_dict()
    factors = load_file(str(final / lora_mod.ADAPTER_WEIGHTS))
    scale = config.lora.alpha / config.lora.rank
    adapted = set()
    for key, a in factors.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix(lora_mod.PEFT_PREFIX).split(".lora_A.")[0]
        bmat = factors[key.replace(".lora_A.", ".lora_B.")]
        name = f"transformer.{module}.weight"
        adapted.add(name)
        torch.testing.assert_close(merged[name], base[name] + scale * (bmat @ a), rtol=0, atol=1e-6)
        torch.testing.assert_close(merged[name], merged_by_peft[f"{module}.weight"], rtol=0, atol=1e-6)
    assert adapted and all(torch.equal(merged[k], base[k]) for k in base if k not in adapted)

    # The same factors for diffusers: the pipeline's load_lora_weights(final), fused, is peft's merge
    # (the scale alpha/r read from the file's metadata).
    import diffusers

    pipeline_class = getattr(diffusers, PIPELINE_CLASS[recipe])
    pipe = pipeline_class.from_pretrained(
        path, **({"text_encoder_3": None, "tokenizer_3": None} if "sd3" in recipe else {})
    )
    pipe.load_lora_weights(str(final))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    fused = pipe.transformer.state_dict()
    assert set(fused) == set(merged_by_peft)
    assert all(torch.equal(fused[k], merged_by_peft[k]) for k in fused)
    assert not all(torch.equal(fused[k], base[f"transformer.{k}"]) for k in fused)


def test_a_pipeline_lora_run_resumes_its_adapter_exactly(lora_run: tuple[str, list[str], Path, Any]) -> None:
    """From step 1's checkpoint: the fresh engine gets the checkpoint's adapter before it generates,
    and step 1 is redone bit for bit."""
    _, args, run_dir, _ = lora_run
    before = metric_rows(run_dir)
    (run_dir / "checkpoints" / "latest").write_text("step_000001")
    miles(*args, "--resume")
    after = metric_rows(run_dir)
    assert [r["step"] for r in after] == [0, 1]
    assert {k: after[1][k] for k in LORA_RESUMED_METRICS} == {k: before[1][k] for k in LORA_RESUMED_METRICS}
