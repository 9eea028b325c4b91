"""The default recipe end to end: engine, rollout, FSDP step, broadcast update, checkpoint, export."""

from __future__ import annotations

import json
import os
import sys

import pytest

from miles import hookimpl
from miles.errors import RunDirError
from miles.loop import train
from miles.plugins import get_plugin_manager

pytestmark = pytest.mark.slow


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class _Recorder:
    """Records which prompts each step trained on and, optionally, interrupts the run."""

    def __init__(self, stop_after_step: int | None = None) -> None:
        self.prompts: dict[int, list[int]] = {}
        self.versions: dict[int, set[int]] = {}
        self.stop_after_step = stop_after_step

    @hookimpl
    def miles_rollout_postprocess(self, groups, step):
        self.prompts.setdefault(step, []).extend(g.prompt.index for g in groups)
        self.versions.setdefault(step, set()).update(
            v for g in groups for s in g.samples for v in s.weight_versions
        )

    @hookimpl
    def miles_on_metrics(self, step, metrics):
        if self.stop_after_step is not None and step == self.stop_after_step:
            raise KeyboardInterrupt("simulated kill")


def _with_plugin(plugin, fn):
    pm = get_plugin_manager()
    pm.register(plugin)
    try:
        return fn()
    finally:
        pm.unregister(plugin)


def test_default_recipe_trains_writes_metrics_tensorboard_and_hf_checkpoint(small_run):
    config = small_run("run.save_every=2")
    rec = _Recorder()
    # the check is on what this run imports: an earlier test in this process may have loaded megatron
    already_loaded = set(sys.modules)
    result = _with_plugin(rec, lambda: train(config))
    newly_loaded = set(sys.modules) - already_loaded

    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert r["engine/weight_version"] == r["step"] + 1
        assert r["weight_sync/bytes"] > 0
    # every sample of step k was generated under weight version k (synchronous loop)
    assert rec.versions == {0: {0}, 1: {1}, 2: {2}}
    tb = os.path.join(result.run_dir, "tensorboard")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))
    # the learning curves (matplotlib is a dev dependency, so tracking.plot's default draws them)
    with open(os.path.join(result.run_dir, "reward_curve.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.isfile(os.path.join(result.run_dir, "time_breakdown.txt"))
    final = result.final_dir
    assert final and os.path.exists(os.path.join(final, "config.json"))
    assert any(n.endswith(".safetensors") for n in os.listdir(final))
    assert os.path.exists(os.path.join(final, "tokenizer.json"))
    # the exported policy loads as a plain Hugging Face model
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(final)
    # the default recipe never pulls in the Megatron backend or diffusers (heavy imports live where
    # they are used; the diffusion plugin's recipe check once imported diffusers in every run)
    assert not {
        m
        for m in newly_loaded
        if m.split(".")[0] in ("megatron", "diffusers") or m.startswith("miles_megatron.backend")
    }


def test_run_refuses_to_overwrite_results_unless_asked(small_run):
    config = small_run("run.num_steps=1", "run.export_hf=false")
    train(config)
    with pytest.raises(RunDirError, match="--resume"):
        train(config)
    train(config, overwrite=True)


def test_killed_run_resumes_with_same_prompts_and_weight_version(small_run, tmp_path):
    # Reference: four uninterrupted steps.
    # Dynamic sampling would make the prompts drawn per step depend on sampled rewards; turn it off.
    fixed = ("run.num_steps=4", "run.export_hf=false", "rollout.max_rounds=1", "rollout.filters=[]")
    ref = _Recorder()
    _with_plugin(ref, lambda: train(small_run(*fixed, "run.name=ref")))

    config = small_run(*fixed, "run.save_every=2", "run.name=killed")
    first = _Recorder(stop_after_step=2)  # dies after step 2, whose checkpoint was not due
    with pytest.raises(KeyboardInterrupt):
        _with_plugin(first, lambda: train(config))
    resumed = _Recorder()
    result = _with_plugin(resumed, lambda: train(config, resume=True))

    assert sorted(resumed.prompts) == [2, 3]  # resumed from the step-2 checkpoint
    for step in (2, 3):
        assert resumed.prompts[step] == ref.prompts[step]
        assert resumed.versions[step] == {step}  # the engines got the checkpoint's weights back
    steps = [r["step"] for r in _rows(result.metrics_path)]
    assert steps == [0, 1, 2, 3]
