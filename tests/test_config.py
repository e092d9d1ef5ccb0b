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
    with initialize_config_dir(config_dir=str(REPO / "rl_tpu" / "configs"), version_base=None):
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


def compose_recipe(recipe: str, *overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(REPO / "rl_tpu" / "configs"), version_base=None):
        return OmegaConf.to_object(compose("config", overrides=[f"+recipe={recipe}", *overrides]))


@pytest.mark.parametrize("recipe, reward", [("grpo_gsm8k", "gsm8k"), ("grpo_math_boxed", "math")])
def test_real_model_recipes_need_model_and_data_paths(recipe, reward, tmp_path):
    with pytest.raises(Exception, match="model.path is required by this recipe"):
        compose_recipe(recipe)
    with pytest.raises(Exception, match="data.train_files is required by this recipe"):
        compose_recipe(recipe, f"model.path={tmp_path}")
    cfg = compose_recipe(recipe, f"model.path={tmp_path}", "data.train_files=t.parquet", "data.val_files=v.parquet")
    validate(cfg)
    assert cfg.reward.name == reward and cfg.model.dtype.value == "bfloat16" and cfg.actor.use_kl_loss
    assert cfg.sampler.response_length >= 1024 and cfg.ray.object_store_mb >= 4096


def test_reward_settings_are_checked_at_start():
    with pytest.raises(ValueError, match="reward name 'gsm9k': allowed values are"):
        validate(compose_run("reward.name=gsm9k"))
    with pytest.raises(ValueError, match="reward.max_failure_rate=2.0 must be in"):
        validate(compose_run("reward.max_failure_rate=2.0"))
    cfg = compose_run("custom_reward_function.path=examples/custom_reward/reward.py", "+reward.combine={custom: 1, format: 0.1}")
    validate(cfg)
    assert cfg.custom_reward_function.name == "compute_score" and cfg.reward.combine == {"custom": 1.0, "format": 0.1}


@pytest.mark.parametrize("device, missing", [("cuda", "this process sees no accelerator"),
                                             ("tpu", "device=tpu needs the torch-tpu package")])
def test_a_missing_accelerator_fails_at_once_naming_it(device, missing):
    result = subprocess.run([sys.executable, "-m", "rl_tpu.main", "+recipe=grpo_math", f"device={device}"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and missing in result.stderr
    assert "Started a local Ray instance" not in result.stderr  # before Ray, before any model is built


def test_an_unknown_tracker_is_refused_with_the_allowed_names():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as refused:
        compose_run("trainer.logger=[jsonl,tensorbord]")
    assert "Invalid value 'tensorbord', expected one of [console, jsonl, tensorboard, wandb" in str(refused.value.__cause__)
