"""Config errors fail at start, naming the key (and the allowed values where there is a fixed set)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import subprocess
import sys
import typing
from enum import Enum

import pytest
from conftest import REPO, compose_run
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from rl_tpu.config import RunConfig, register_configs
from rl_tpu.controller.checks import validate

register_configs()


def test_recipe_composes_into_typed_config():
    cfg = compose_run("algorithm.lr=1e-6", "trainer.world_size=2")
    assert isinstance(cfg, RunConfig)
    assert cfg.algorithm.lr == 1e-6 and cfg.trainer.world_size == 2 and cfg.sampler.n == 8
    assert cfg.model.path is None and cfg.model.tiny.hidden_size == 256


@pytest.mark.parametrize(
    "override, named",
    [
        ("algorithm.lrr=1e-6", "lrr"),
        ("sampler.temperature=hot", "temperature"),
        ("device=gpu", "gpu"),
    ],
)
def test_bad_override_names_the_key(override, named):
    with pytest.raises(ConfigCompositionException) as err:
        compose_run(override)
    assert named in str(err.value) + str(err.value.__cause__)


def test_enum_error_lists_allowed_values():
    with pytest.raises(ConfigCompositionException) as err:
        compose_run("device=gpu")
    text = str(err.value.__cause__)
    assert "auto" in text and "cuda" in text and "tpu" in text


def enum_keys(schema: type = RunConfig, prefix: str = "") -> list[tuple[str, type, bool]]:
    """(key, its enum, whether the key holds a list of them) for every enum-typed key of the schema."""
    found = []
    for name, hint in typing.get_type_hints(schema).items():
        listed = typing.get_origin(hint) is list
        inner = typing.get_args(hint)[0] if listed else hint
        if dataclasses.is_dataclass(inner):
            found += enum_keys(inner, f"{prefix}{name}.")
        elif isinstance(inner, type) and issubclass(inner, Enum):
            found.append((prefix + name, inner, listed))
    return found


ENUM_KEYS = enum_keys()


@pytest.mark.parametrize("key, choices, listed", ENUM_KEYS, ids=[key for key, _, _ in ENUM_KEYS])
def test_a_typo_in_any_enum_key_lists_its_allowed_values(key, choices, listed):
    with pytest.raises(ConfigCompositionException) as err:
        compose_run(f"{key}=[nope]" if listed else f"{key}=nope")
    allowed = ", ".join(member.value for member in choices)
    assert f"Invalid value 'nope', expected one of [{allowed}]" in str(err.value.__cause__)


def test_an_enum_setting_reads_as_its_string():
    """Enum keys are `StrEnum`s: a setting formats, compares and converts as the string it names, so messages
    and the arguments handed to vLLM and verl carry `cpu`, not `DeviceKind.cpu`, with no conversion at each use."""
    assert len(ENUM_KEYS) >= 9
    cfg = compose_run("device=cpu", "actor.loss_agg_mode=seq-mean-token-sum", "trainer.logger=[jsonl]")
    for key, _, listed in ENUM_KEYS:
        setting = functools.reduce(getattr, key.split("."), cfg)
        for value in setting if listed else [setting]:
            assert f"{value}" == str(value) == value.value and type(str(value)) is str, key
    assert (cfg.device, cfg.actor.loss_agg_mode, cfg.trainer.logger) == ("cpu", "seq-mean-token-sum", ["jsonl"])


def test_help_describes_the_keys_of_every_config_module():
    """`rl-tpu --help` reads the field comments of every module of rl_tpu/config/ by itself: a section moved to or
    added in a module of its own keeps its descriptions (data.reasoning_gym's were missing)."""
    from rl_tpu.cli_help import field_comments, help_text, one_line

    shown = help_text()
    for path in sorted((REPO / "rl_tpu" / "config").glob("*.py")):
        module = importlib.import_module("rl_tpu.config" + ("" if path.stem == "__init__" else f".{path.stem}"))
        for (schema, key), comment in field_comments(path.read_text()).items():
            if not dataclasses.is_dataclass(typing.get_type_hints(getattr(module, schema))[key]):  # a leaf key
                assert one_line(comment) in shown, f"{path.name}: {schema}.{key}"


def test_value_checks_name_the_key():
    with pytest.raises(ValueError, match="trainer.world_size=3"):
        validate(compose_run("trainer.world_size=3", "data.train_batch_size=4", "sampler.n=2"))
    with pytest.raises(ValueError, match="algorithm.adv_estimator='ppo'"):
        validate(compose_run("algorithm.adv_estimator=ppo"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.adv_estimator=gae"], "'gae' is not supported: it needs a value model"),
        (["algorithm.adv_estimator=remax"], "greedy rollout of every prompt"),
        (["algorithm.adv_estimator=rloo", "sampler.n=1"], "sampler.n=1: rloo compares the completions"),
        (["algorithm.adv_estimator=gdpo"], r"gdpo_reward_keys=None must name some of this run's rewards, arithmetic"),
        (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[format]"], "gdpo_reward_keys=\\['format'\\]"),
        (["actor.policy_loss.loss_mode=dro"], "needs actor.policy_loss.dro_beta > 0"),
        (["actor.policy_loss.loss_mode=bypass_mode", "actor.rollout_is=token"], "computes its own importance weights"),
        (["actor.ppo_mini_batch_size=5"], "actor.ppo_mini_batch_size=5 prompts must divide data.train_batch_size=16"),
        (["actor.ppo_epochs=0"], "actor.ppo_epochs=0"),
        (["actor.policy_loss.rollout_correction.loss_type=ppo"], "loss_type='ppo': allowed values are ppo_clip"),
        (["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k9"], "algorithm.kl_penalty='k9': allowed values"),
        (["trainer.total_steps=-1"], r"trainer.total_steps=-1 and trainer.eval_pass_k=0 at least 0"),
        (["trainer.eval_pass_k=-2"], r"trainer.eval_pass_k=-2 at least 0 \(total_steps 0: evaluate the model only"),
        (["sync.transport=tpu_sync", "trainer.max_staleness=1"], "tpu_sync with trainer.max_staleness=1: an engine"),
        (["episode.enable=true"], "episode.enable=true needs episode.tools_config_file or episode.function_tool_path"),
        (["episode.renderer=jinja"], "episode.renderer='jinja': allowed values are auto, chat, plain"),
        (["episode.reward=both"], "episode.reward='both': allowed values are plugin, tools, sum"),
        (["episode.max_turns=0"], "episode.max_turns=0 must be >= 1"),
        (["episode.tool_response_format=no placeholder"], "must contain {result}"),
        (["sampler.top_p=0.9"], "sampler.top_p=0.9 and sampler.top_k=-1: the engine samples from the distribution"),
        (["sampler.top_k=20"], "sampler.top_p=1.0 and sampler.top_k=20: .* evaluation-only runs"),
        (["sampler.tensor_parallel_size=0"], "sampler.tensor_parallel_size=0 >= 1"),
        (["sampler.tensor_parallel_size=2", "device=cpu"], "splits an engine's 1 thread.* set sampler.threads"),
        (["sampler.tensor_parallel_size=2", "sync.transport=cuda_ipc"], "needs a host transport: .*object_store"),
        (["sampler.tensor_parallel_size=2", "actor.lora.lora_rank=8"], "LoRA adapter served as one"),
    ],
)
def test_algorithm_settings_are_checked_at_start(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_run(*overrides))
    assert compose_run("actor.policy_loss.loss_mode=gspo").actor.policy_loss.loss_mode == "gspo"
    with pytest.raises(ValueError, match=r"loss_mode='ppo': allowed values are vanilla, .*, or an import path"):
        validate(compose_run("actor.policy_loss.loss_mode=ppo"))


REAL = ("model.path=/models/m", "data.train_files=t.parquet", "data.val_files=v.parquet")


@pytest.mark.parametrize(
    "recipe, overrides, expected",
    [
        ("dapo_math", (), {"clip_ratio_high": 0.28, "filter_groups": True, "overlong": True, "agg": "token-mean"}),
        ("dr_grpo_math", (), {"norm_std": False, "agg": "seq-mean-token-sum-norm"}),
        ("gspo_math", (), {"mode": "gspo", "clip_ratio_high": 0.0004, "agg": "seq-mean-token-mean", "mini": 4}),
        ("dapo_gsm8k", REAL, {"filter_groups": True, "kl": False, "lr": 1e-6}),
        ("gspo_gsm8k", REAL, {"mode": "gspo", "mini": 8, "lr": 1e-6}),
        ("grpo_gsm8k", (*REAL, "+algo=dr_grpo"), {"norm_std": False, "kl": False}),  # an algorithm on any recipe
        ("grpo_math", ("actor.loss_agg_mode=seq-mean-token-sum",), {"agg": "seq-mean-token-sum"}),  # verl's spelling
    ],
)
def test_algorithm_presets_compose_and_pass_validation(recipe, overrides, expected):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg: RunConfig = OmegaConf.to_object(compose("config", overrides=[f"+recipe={recipe}", *overrides]))
    validate(cfg)
    a, algo = cfg.actor, cfg.algorithm
    got = {
        "clip_ratio_high": a.clip_ratio_high,
        "filter_groups": algo.filter_groups.enable,
        "kl": a.use_kl_loss,
        "overlong": cfg.reward.overlong_buffer.enable,
        "agg": a.loss_agg_mode.value,
        "lr": algo.lr,
        "norm_std": algo.norm_adv_by_std_in_grpo,
        "mode": a.policy_loss.loss_mode,
        "mini": a.ppo_mini_batch_size,
    }
    assert {k: got[k] for k in expected} == expected


def test_cli_typo_fails_fast_with_the_key_name():
    result = subprocess.run(
        [sys.executable, "-m", "rl_tpu.main", "+recipe=grpo_math", "trainer.totl_steps=3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "totl_steps" in result.stderr


def compose_recipe(recipe: str, *overrides: str) -> RunConfig:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
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
    cfg = compose_run(
        "custom_reward_function.path=examples/custom_reward/reward.py", "+reward.combine={custom: 1, format: 0.1}"
    )
    validate(cfg)
    assert cfg.custom_reward_function.name == "compute_score" and cfg.reward.combine == {"custom": 1.0, "format": 0.1}


@pytest.mark.parametrize(
    "device, missing", [("cuda", "this process sees no accelerator"), ("tpu", "device=tpu needs the torch-tpu package")]
)
def test_a_missing_accelerator_fails_at_once_naming_it(device, missing):
    result = subprocess.run(
        [sys.executable, "-m", "rl_tpu.main", "+recipe=grpo_math", f"device={device}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and missing in result.stderr
    assert "Started a local Ray instance" not in result.stderr  # before Ray, before any model is built


def test_an_unknown_tracker_is_refused_with_the_allowed_names():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException) as refused:
        compose_run("trainer.logger=[jsonl,tensorbord]")
    assert "Invalid value 'tensorbord', expected one of [console, jsonl, tensorboard, wandb" in str(
        refused.value.__cause__
    )


def test_a_section_checks_its_own_fields_when_made_and_again_at_start():
    with pytest.raises(ValueError, match=r"reward.timeout_s=0(\.0)? > 0"):
        compose_run("reward.timeout_s=0")  # Hydra makes the dataclasses: the section's __post_init__ runs
    cfg = compose_run("trainer.max_staleness=1")
    assert cfg.trainer.is_async and not RunConfig().trainer.is_async  # derived once, beside its field
    cfg.sampler.temperature = 0.0  # a program changed a made section: the check at start still sees it
    with pytest.raises(ValueError, match="sampler.temperature=0.0 must be > 0"):
        validate(cfg)


def test_a_context_longer_than_the_models_positions_is_refused_naming_the_keys(tiny_model_dir):
    from rl_tpu.models.resolve import check_context

    check_context(tiny_model_dir, 64, 64, "sampler.response_length")  # the tiny preset's 128 positions, exactly
    with pytest.raises(ValueError, match=r"data.max_prompt_length=96 plus 64 .*sampler.response_length.*over the 128"):
        check_context(tiny_model_dir, 96, 64, "sampler.response_length")


def test_top_p_and_top_k_are_allowed_where_nothing_is_trained():
    """An evaluation-only run (trainer.total_steps=0) samples pass@k at top_p / top_k and uses no logprob."""
    validate(compose_run("trainer.total_steps=0", "sampler.top_p=0.9", "sampler.top_k=20"))
    validate(compose_run("sampler.top_k=0"))  # vLLM's other spelling of off
