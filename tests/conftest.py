"""Shared fixtures: a tiny model folder built locally (no downloads) and a Ray cluster for actor tests."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# each xdist worker's runs lease cores among themselves only: the workers share the host on purpose, and a run's
# pinning (the core-loan tests) must not depend on what the other worker runs meanwhile
os.environ.setdefault("RL_TPU_CORE_LEASE_DIR", tempfile.mkdtemp(prefix="rl_tpu-cores-"))
# ... and each worker computes on its share of the cores (the runs' actors and engines set their own threads:
# rl_tpu/cluster/cores.py). With every core each, the workers' OpenMP threads wait on one another: a step of a
# 64-wide model took 1.27 s with 2 threads beside other work on a 2-core host, 0.05 s with one (2026-12-07).
os.environ.setdefault(
    "OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))))
)


def ship_by_value(module_name: str) -> None:
    """Ray's workers cannot import a test module by name: send its functions and classes by value."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[module_name])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_collection_modifyitems(config, items) -> None:
    """The two tiers: every test under tests/e2e/ is marked `e2e` (`pytest -m e2e`); tests/unit/ is the unit tier
    (`pytest -m "not e2e"`), pure functions and single processes, no Ray cluster or engine."""
    e2e = REPO / "tests" / "e2e"
    for item in items:
        if e2e in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny_arith preset with random weights (no warm start): a real Hugging Face folder."""
    from rl_tpu.config import DataConfig, TinyModelConfig
    from rl_tpu.models.resolve import build_tiny_arith

    folder = tmp_path_factory.mktemp("models") / "tiny"
    build_tiny_arith(TinyModelConfig(warm_start_steps=0), DataConfig(), folder)
    return folder


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    """A tiny model with Qwen2.5's chat template, warm-started to call the calculator (tests/chat_model.py)."""
    from chat_model import build_chat_model

    folder = tmp_path_factory.mktemp("models") / "tiny_chat"
    build_chat_model(folder)
    return folder


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
    yield ray
    ray.shutdown()


# The CLI runs of the end-to-end tests: the tiny model with random weights (no warm start), 4 prompts x 4
# completions, two FSDP2 ranks. Random weights earn no reward, so zero advantages; the entropy bonus still
# moves the weights.
E2E_OVERRIDES = (
    "+recipe=grpo_math",
    "model.tiny.warm_start_steps=0",
    "data.train_batch_size=4",
    "sampler.n=4",
    "data.num_eval=32",
    "trainer.eval_every=2",
    "trainer.world_size=2",
    "actor.entropy_coeff=0.01",
)


MODULE_CLI = (sys.executable, "-m", "rl_tpu.main")


def cli_command(run_dir, cache_dir, *overrides: str, program=MODULE_CLI) -> list[str]:
    return [*map(str, program), *E2E_OVERRIDES, f"hydra.run.dir={run_dir}", f"cache_dir={cache_dir}", *overrides]


def run_cli(run_dir, cache_dir, *overrides: str, program=MODULE_CLI, cwd=REPO) -> subprocess.CompletedProcess:
    result = subprocess.run(
        cli_command(run_dir, cache_dir, *overrides, program=program),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="session")
def installed_cli(tmp_path_factory) -> Path:
    """`rl-tpu` from a wheel of the checkout, installed into a new virtual environment.

    The environment sees this one's pinned dependencies through a .pth line (whose folder's own .pth
    files, the editable checkout among them, Python does not read), so the package comes from the wheel alone.
    """
    root = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(root / "dist"),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    (wheel,) = (root / "dist").glob("rl_tpu-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "pinned_dependencies.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-4000:]
    return venv / "bin" / "rl-tpu"


def start_cli(run_dir, cache_dir, *overrides: str) -> subprocess.Popen:
    """A run in the background (its output in RUN_DIR.out), for tests that interrupt it."""
    Path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    out = open(f"{run_dir}.out", "w")
    return subprocess.Popen(
        cli_command(run_dir, cache_dir, *overrides), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True
    )


def wait_for_step(run_dir, step: int, process: subprocess.Popen, timeout_s: float = 300) -> None:
    """Until metrics.jsonl has a line for `step` (the run's process must still be running)."""
    metrics, deadline = Path(run_dir) / "metrics.jsonl", time.monotonic() + timeout_s
    while not (metrics.exists() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines())):
        assert process.poll() is None, Path(f"{run_dir}.out").read_text()[-4000:]
        assert time.monotonic() < deadline, f"no step {step} in {metrics} within {timeout_s} s"
        time.sleep(0.2)


def actor_pid(run_dir, actor: str) -> int:
    """The process of one actor, as placement.json records it."""
    actors = json.loads((Path(run_dir) / "placement.json").read_text())["actors"]
    return next(a["pid"] for a in actors if a["actor"] == actor)


@pytest.fixture(scope="session")
def six_step_run(tmp_path_factory) -> Path:
    """An uninterrupted 6-step run: the reference that resumed, restarted and recovered runs must equal.

    Made once per session: the xdist workers share the session's folder, and the first to need the run makes it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "whole"
    with FileLock(f"{root}.lock", timeout=900):  # the other worker's run_cli has 600 s
        if not (root / "made").exists():
            shutil.rmtree(root, ignore_errors=True)  # what a failed attempt left
            run_cli(root / "run", root / "cache", "trainer.total_steps=6")
            (root / "made").touch()
    return root / "run"


# --- builders shared by test files of both folders (import them from conftest) ---


def placement_config(world_size: int = 1, engines: int = 1, layout: str = "auto", **ray_settings):
    """A RunConfig with the settings a placement plan reads."""
    from rl_tpu.config import RunConfig

    cfg = RunConfig()
    cfg.trainer.world_size, cfg.sampler.num_engines, cfg.placement = world_size, engines, layout
    for key, value in ray_settings.items():
        setattr(cfg.ray, key, value)
    return cfg


def make_batch(seed: int = 0, size: int = 8, temperature: float = 0.7):
    """A random TrainBatch of `size` rows in groups of 4, with verl's GRPO advantages of random 0/1 rewards."""
    import random

    from rl_tpu.algorithms import core as algorithms
    from rl_tpu.config import AlgorithmConfig
    from rl_tpu.records import TrainBatch

    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 60) for _ in range(rng.randint(3, 9))] for _ in range(size)]
    completions = [[rng.randrange(2, 60) for _ in range(rng.randint(1, 7))] for _ in range(size)]
    # "sampler" logprobs that differ from the policy's, so PPO clipping is exercised
    sampler = [[-rng.uniform(0.5, 6.0) for _ in c] for c in completions]
    rewards = [float(rng.random() < 0.5) for _ in range(size)]
    advantages = algorithms.advantages(
        rewards, [i // 4 for i in range(size)], [len(c) for c in completions], AlgorithmConfig()
    )
    return TrainBatch(prompts, completions, sampler, advantages, temperature)


def shared_prompt_batch():
    """Prompts of 3-9 and completions of 1-7 tokens; the three groups of 4 share their prompts, as in GRPO."""
    import dataclasses

    batch = make_batch(seed=11, size=12, temperature=1.0)
    return dataclasses.replace(batch, prompt_ids=[batch.prompt_ids[i - i % 4] for i in range(len(batch))])


def one_step(model_dir, batch, dtype: str = "float32", **trainer) -> tuple[dict, dict]:
    """The metrics of one train step and the (clipped) gradients the optimizer was given, in fp32; prompts are
    run with their completions, and every row is run, unless the call asks for `share_prompts` or
    `skip_zero_advantage_rows`."""
    import torch
    from torch.distributed.tensor import DTensor

    from rl_tpu.config import RunConfig
    from rl_tpu.models.hf import hf_name
    from rl_tpu.trainer.worker import TrainerWorker

    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.trainer.micro_batch_size = "cpu", dtype, 4
    cfg.trainer.share_prompts = cfg.trainer.skip_zero_advantage_rows = False
    for key, value in trainer.items():
        setattr(cfg.trainer, key, value)
    threads = torch.get_num_threads()
    worker = TrainerWorker(cfg, str(model_dir), 0, 1, "127.0.0.1", free_port())
    grads = {}
    step = worker.optimizer.step

    def capture(*args, **kwargs):
        for name, param in worker.model.named_parameters():
            grad = param.grad  # a DTensor where FSDP shards the model (bf16), else a plain tensor
            grads[hf_name(name)] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).float().clone()
        return step(*args, **kwargs)

    worker.optimizer.step = capture
    try:
        return worker.train_step(batch), grads
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)


def compose_run(*overrides: str):
    """The grpo_math recipe composed by Hydra with `overrides`, as the typed RunConfig a run gets."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from rl_tpu.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return OmegaConf.to_object(compose("config", overrides=["+recipe=grpo_math", *overrides]))


def tensorboard_scalars(folder) -> dict[str, dict[int, float]]:
    """tag -> step -> value, read back with TensorBoard's own event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
