"""Shared fixtures: a tiny model folder built locally (no downloads) and a Ray cluster for actor tests."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def ship_by_value(module_name: str) -> None:
    """Ray's workers cannot import a test module by name: send its functions and classes by value."""
    import sys

    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[module_name])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny_arith preset with random weights (no warm start): a real Hugging Face folder."""
    from rl_tpu.config import DataConfig, TinyModelConfig
    from rl_tpu.models import build_tiny_arith

    folder = tmp_path_factory.mktemp("models") / "tiny"
    build_tiny_arith(TinyModelConfig(warm_start_steps=0), DataConfig(), folder)
    return folder


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False)
    yield ray
    ray.shutdown()
