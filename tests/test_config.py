"""Config errors fail at start, naming the key (and the allowed values where there is a fixed set)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import REPO
from rl_tpu.config import RunConfig, register_configs
from rl_tpu.controller import validate

register_configs()


def compose_run(*overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return OmegaConf.to_object(compose("config", overrides=["+recipe=grpo_math", *overrides]))


def test_recipe_composes_into_typed_config():
    cfg = compose_run("algorithm.lr=1e-6", "trainer.world_size=2")
    assert isinstance(cfg, RunConfig)
    assert cfg.algorithm.lr == 1e-6 and cfg.trainer.world_size == 2 and cfg.sampler.n == 8
    assert cfg.model.path is None and cfg.model.tiny.hidden_size == 256


@pytest.mark.parametrize("override, named", [
    ("algorithm.lrr=1e-6", "lrr"),
    ("sampler.temperature=hot", "temperature"),
    ("device=gpu", "gpu"),
])
def test_bad_override_names_the_key(override, named):
    with pytest.raises(ConfigCompositionException) as err:
        compose_run(override)
    assert named in str(err.value) + str(err.value.__cause__)


def test_enum_error_lists_allowed_values():
    with pytest.raises(ConfigCompositionException) as err:
        compose_run("device=gpu")
    text = str(err.value.__cause__)
    assert "auto" in text and "cuda" in text and "tpu" in text


def test_value_checks_name_the_key():
    with pytest.raises(ValueError, match="trainer.world_size=3"):
        validate(compose_run("trainer.world_size=3", "data.train_batch_size=4", "sampler.n=2"))
    with pytest.raises(ValueError, match="algorithm.adv_estimator='ppo'"):
        validate(compose_run("algorithm.adv_estimator=ppo"))


def test_cli_typo_fails_fast_with_the_key_name():
    result = subprocess.run([sys.executable, "-m", "rl_tpu.main", "+recipe=grpo_math", "trainer.totl_steps=3"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "totl_steps" in result.stderr
