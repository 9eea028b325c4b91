"""One real short run (default recipe, 2 steps) with every tracker, the rollout dump and a tracker
that breaks; then the report, the replays and a raw engine request on what the run left."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from miles import hookimpl
from miles.cli import cli
from miles.config import load_recipe
from miles.loop import train
from miles.plugins import get_plugin_manager
from miles.tracking.base import NoOptions, TrackerContext

pytestmark = pytest.mark.slow

# The RL loop alone, whatever the default recipe adds in front of it (a supervised warm start,
# periodic evaluations): those have tests of their own, and would only slow this one down.
RL_ONLY = ["eval=null", "warm_start=null", "rollout.reward=numeric_closeness", "train.lr=0.01"]


class FailingTracker:
    """A tracker whose server goes away after the first step."""

    Options = NoOptions
    requires = ()
    install = ""

    def __init__(self, ctx: TrackerContext, options: NoOptions) -> None:
        pass

    def log(self, step, metrics):
        if step >= 1:
            raise ConnectionError("tracker server went away")

    def log_eval(self, step, metrics):
        pass

    def close(self, status):
        pass


class _Scraper:
    """Scrapes the run's Prometheus endpoint while the run is at its last step."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.text = ""
        self.reward: float | None = None

    @hookimpl(trylast=True)  # after the trackers have the step
    def miles_on_metrics(self, step, metrics):
        if step == 1:
            with open(os.path.join(self.run_dir, "prometheus_address"), encoding="utf-8") as f:
                url = f"http://{f.read().strip()}/metrics"
            deadline = time.monotonic() + 20  # the tracker takes the step on its own thread
            while 'miles_step{run="default"} 1.0' not in self.text and time.monotonic() < deadline:
                self.text = httpx.get(url, timeout=10).text
                time.sleep(0.05)
            self.reward = metrics["rollout/reward_mean"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("obs")
    os.environ["WANDB_SILENT"] = "true"
    config = load_recipe(
        "default",
        [
            f"run.output_dir={tmp}",
            "run.num_steps=2",
            "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=4",
            *RL_ONLY,
            "rollout.reward=numeric_closeness",  # partial credit: a random model's samples differ in reward
            "rollout.filters=[]",  # train on every group, so the step has a loss to plot
            "rollout.dump=true",
            "tracking.console=false",
            f"tracking.backends=[wandb, mlflow, prometheus, '{__name__}:FailingTracker']",
            "tracking.options.wandb.mode=offline",
            "tracking.options.prometheus.port=0",
        ],
    )
    scraper = _Scraper(os.path.join(str(tmp), config.run.name))
    pm = get_plugin_manager()
    pm.register(scraper)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("miles.tracking").addHandler(handler)
    try:
        result = train(config)
    finally:
        pm.unregister(scraper)
        logging.getLogger("miles.tracking").removeHandler(handler)
    return result, scraper, records, config


def _rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_every_tracker_gets_every_step_and_a_broken_one_only_warns(run):
    from .wandb_records import history, wait_for_exit

    result, scraper, records, _ = run
    assert result.steps_done == 2
    rows = _rows(result.metrics_path)
    assert [r["step"] for r in rows] == [0, 1]
    rewards = [r["rollout/reward_mean"] for r in rows]

    (wandb_file,) = glob.glob(os.path.join(result.run_dir, "wandb", "offline-run-*", "*.wandb"))
    wait_for_exit(wandb_file)
    logged = {
        int(h["_step"]): float(h["rollout/reward_mean"])
        for h in history(wandb_file)
        if "rollout/reward_mean" in h
    }
    assert logged == dict(enumerate(rewards))

    from mlflow.tracking import MlflowClient

    with open(os.path.join(result.run_dir, "mlflow_run_id"), encoding="utf-8") as f:
        run_id = f.read().strip()
    client = MlflowClient(tracking_uri="file:" + os.path.join(result.run_dir, "mlruns"))
    points = client.get_metric_history(run_id, "rollout/reward_mean")
    assert sorted((m.step, m.value) for m in points) == list(enumerate(rewards))
    assert client.get_run(run_id).info.status == "FINISHED"

    assert scraper.reward == rewards[1]
    assert f'miles_rollout_reward_mean{{run="default"}} {float(rewards[1])}' in scraper.text

    warned = [
        r.getMessage() for r in records if r.levelno == logging.WARNING and "FailingTracker" in r.getMessage()
    ]
    assert len(warned) == 1 and "went away" in warned[0]


def test_rollout_dump_holds_every_sample_of_every_step(run):
    result, *_ = run
    files = sorted(glob.glob(os.path.join(result.run_dir, "rollouts", "*.jsonl")))
    assert [os.path.basename(f) for f in files] == ["step_000000.jsonl", "step_000001.jsonl"]
    for step, path in enumerate(files):
        samples = _rows(path)
        assert len(samples) == 2 * 4
        for s in samples:
            assert s["step"] == step
            assert len(s["rollout_logprobs"]) == len(s["response_ids"]) == len(s["weight_versions"]) > 0
            assert all(v == step for v in s["weight_versions"])  # sync: each step samples the latest weights
            assert s["status"] in ("completed", "truncated") and isinstance(s["reward"], float)
            assert s["prompt_ids"] and isinstance(s["response_text"], str)


def test_report_draws_the_run_and_embeds_it_in_one_page(run, tmp_path):
    import matplotlib.image

    result, *_ = run
    out = CliRunner().invoke(cli, ["report", result.run_dir, "--out", str(tmp_path / "r")])
    assert out.exit_code == 0, out.output
    pngs = {p.name for p in (tmp_path / "r").glob("*.png")}
    assert {"reward.png", "loss.png", "mismatch.png", "response_length.png", "step_time.png"} <= pngs
    for name in pngs:
        pixels = matplotlib.image.imread(tmp_path / "r" / name)
        assert pixels.std() > 0.01, name  # something is drawn
    page = (tmp_path / "r" / "index.html").read_text()
    assert page.count("src='data:image/png;base64,") == len(pngs)
    assert "builtin:tiny-qwen3" in page  # the config
    assert "http" not in page.replace("http://", "")  # and nothing fetched from elsewhere

    # A running run: the metrics file ends mid-line.
    partial = tmp_path / "running"
    partial.mkdir()
    lines = Path(result.metrics_path).read_text().splitlines(keepends=True)
    (partial / "metrics.jsonl").write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    shutil.copy(os.path.join(result.run_dir, "config.yaml"), partial / "config.yaml")
    out = CliRunner().invoke(cli, ["report", str(partial)])
    assert out.exit_code == 0, out.output
    assert "from 1 steps" in out.output and (partial / "report" / "reward.png").is_file()


def test_report_page_renders_in_headless_chromium(run, tmp_path):
    browser = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    if browser is None:
        pytest.skip("no chromium binary on this machine (apt-get install chromium to run this test)")
    import matplotlib.image

    result, *_ = run
    CliRunner().invoke(cli, ["report", result.run_dir])
    shot = tmp_path / "page.png"
    page = os.path.join(result.run_dir, "report", "index.html")
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--screenshot={shot}",
            "--window-size=1000,2000",
            f"file://{page}",
        ],
        check=True,
        timeout=60,
        capture_output=True,
    )
    assert matplotlib.image.imread(shot).std() > 0.05


def _tiny_reward(sample):
    """A reward of the response's length: replay must hand the reward the dumped tokens."""
    return float(len(sample.response_ids))


def test_replay_reward_rescores_the_dump(run, tmp_path):
    result, _, _, config = run
    same = CliRunner().invoke(cli, ["replay", "reward", result.run_dir, "--reward", config.rollout.reward])
    assert same.exit_code == 0, same.output
    assert "16 samples" in same.output and "0 changed" in same.output  # the run's own reward, again

    out = tmp_path / "rescored.jsonl"
    other = CliRunner().invoke(
        cli,
        [
            "replay",
            "reward",
            result.run_dir,
            "--reward",
            f"{__name__}:_tiny_reward",
            "--step",
            "1",
            "--out",
            str(out),
        ],
    )
    assert other.exit_code == 0, other.output
    rows = _rows(str(out))
    assert len(rows) == 8
    assert all(r["reward"] == len(r["response_ids"]) and "dumped_reward" in r for r in rows)


def test_logprob_mismatch_of_step_zero_is_tiny_with_its_own_weights_and_found_with_others(run, tmp_path):
    result, _, _, config = run
    out = tmp_path / "mismatch.jsonl"
    ok = CliRunner().invoke(
        cli,
        [
            "replay",
            "logprobs",
            result.run_dir,
            "--step",
            "0",
            "--model",
            config.model.path,
            "--out",
            str(out),
        ],
    )
    assert ok.exit_code == 0, ok.output
    assert "0 diverge" in ok.output
    rows = _rows(str(out))
    assert len(rows) == 8 and all(r["max_abs_diff"] < 1e-3 and r["tokens"] > 0 for r in rows)

    # At another temperature the recomputed log-probs are not the engine's: found at the first token.
    off = CliRunner().invoke(
        cli,
        [
            "replay",
            "logprobs",
            result.run_dir,
            "--step",
            "0",
            "--model",
            config.model.path,
            "--temperature",
            "3",
            "--out",
            str(out),
        ],
    )
    assert off.exit_code == 0, off.output
    rows = _rows(str(out))
    assert all(r["first_divergence"] == 0 and r["max_abs_diff"] > 1e-2 for r in rows)


def test_engine_generate_prints_the_answer_with_logprobs(run):
    from miles.engines.launchers import free_port

    result, *_ = run
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.engines.embedded", "--model", result.final_dir, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        out = CliRunner().invoke(
            cli,
            [
                "engine",
                "generate",
                url,
                "--prompt",
                "3+4=",
                "--model",
                result.final_dir,
                "--chat",
                "--max-new-tokens",
                "5",
            ],
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    # The answer is sampled: the trained model may end it (EOS) before the 5-token limit.
    found = re.search(r"answer: (\d+) tokens, finish: (\w+)", lines[0])
    assert found, lines[0]
    n, finish = int(found.group(1)), found.group(2)
    assert 1 <= n <= 5 and (n == 5 or finish == "stop"), lines[0]
    table = lines[lines.index(next(line for line in lines if line.strip().startswith("pos"))) + 1 :]
    assert len(table) == n
    assert all(float(row.split()[2]) <= 0.0 for row in table)  # a log-probability per token


def test_replay_train_on_step_zero_reproduces_the_runs_loss(run):
    result, *_ = run
    logged = _rows(result.metrics_path)[0]
    out = CliRunner().invoke(cli, ["replay", "train", result.run_dir, "--step", "0"])
    assert out.exit_code == 0, out.output
    replayed = {line.split()[0]: line.split()[1:] for line in out.output.splitlines()[1:]}
    for key in ("train/loss", "train/grad_norm", "train/entropy", "train/num_loss_tokens"):
        value, was = (float(v) for v in replayed[key])
        assert value == pytest.approx(logged[key], rel=1e-5, abs=1e-12), key
        assert was == pytest.approx(logged[key], rel=1e-5, abs=1e-12), key
